#!/usr/bin/env node
// Runs the compiled CLI (dist/). In a checkout (scripts/ beside bin/), a missing dist/ is
// built first, once; an installed package ships dist/ built.
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const ensureBuilt = new URL('../scripts/ensure-built.js', import.meta.url);
if (!existsSync(new URL('../dist/cli.js', import.meta.url)) && existsSync(ensureBuilt)) {
  execFileSync(process.execPath, [fileURLToPath(ensureBuilt)], { stdio: ['ignore', 'inherit', 'inherit'] });
}
try {
  await import('../dist/cli.js');
} catch (err) {
  if (err?.code !== 'ERR_MODULE_NOT_FOUND' || !String(err.message).includes('dist/cli.js')) throw err;
  process.stderr.write('lease-ops: dist/ is missing: run `npm run build` in this checkout\n');
  process.exit(2);
}
