#!/usr/bin/env node
// Builds dist/ when it is missing or was built from other sources (its .source-hash says
// which); otherwise does nothing. `npm start`, `npm test` and the other scripts that run the
// compiled code call it first, so a checkout needs no install-time build (no `prepare`
// script, which npm warns about to everyone who installs the package).
import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { sourceHash } from './source-hash.js';

const root = fileURLToPath(new URL('..', import.meta.url));
const recorded = join(root, 'dist', '.source-hash');
if (!existsSync(recorded) || readFileSync(recorded, 'utf8') !== sourceHash(root)) {
  process.stderr.write('lease-ops: building dist/ from the sources (once per change)\n');
  execFileSync(process.execPath, [join(root, 'scripts', 'build.js')], { stdio: 'inherit' });
}
