#!/usr/bin/env node
// `npm run test`: the type check runs beside the suites instead of before them (about 20 s of
// one core here), and the run fails if either fails. Its report is printed when it ends, so it
// does not cut into the suites' output. It checks the tests, benches and examples against the
// declarations of src/ (tsconfig.json references the build): src/ itself was checked by the
// build that `npm run test` runs first, so it is not checked twice (28 s of CPU became 21 s).
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';

const require = createRequire(import.meta.url);
const tsc = require.resolve('typescript/bin/tsc');
// vitest's own bin (its package exports do not list it).
const vitest = join(dirname(require.resolve('vitest/package.json')), 'vitest.mjs');

const typeCheck = new Promise((resolve) => {
  const child = spawn(process.execPath, [tsc, '--noEmit'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let report = '';
  child.stdout.on('data', (chunk) => (report += chunk));
  child.stderr.on('data', (chunk) => (report += chunk));
  child.on('close', (code, signal) => {
    const ok = code === 0;
    process.stdout.write(ok ? '\ntype check (tsc --noEmit): no errors\n' : `\ntype check (tsc --noEmit) failed${signal ? ` (${signal})` : ''}:\n${report}\n`);
    resolve(ok ? 0 : 1);
  });
});
const suites = new Promise((resolve) => {
  const child = spawn(process.execPath, [vitest, 'run', '--configLoader', 'runner', ...process.argv.slice(2)], { stdio: 'inherit' });
  child.on('close', (code) => resolve(code ?? 1));
});
const [checked, ran] = await Promise.all([typeCheck, suites]);
process.exit(ran !== 0 ? ran : checked);
