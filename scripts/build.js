#!/usr/bin/env node
// Builds the packages: dist/ holds the compiled JavaScript, its declarations and the Lua
// scripts the lanes load at run time; packages/client/dist/ the light HTTP client. `npm run build`
// always builds; `npm pack` (prepack) and the scripts that run dist/ build only when the sources changed.
import { execFileSync } from 'node:child_process';
import { cpSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { sourceHash } from './source-hash.js';

const root = fileURLToPath(new URL('..', import.meta.url));
const dist = join(root, 'dist');
rmSync(dist, { recursive: true, force: true });
// The build is a composite project (the type check of the tests reads its declarations
// instead of checking src/ again, tsconfig.json): without its build info, tsc emits it all.
rmSync(join(root, '.cache', 'tsc'), { recursive: true, force: true });
const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
execFileSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.build.json')], { stdio: 'inherit' });
cpSync(join(root, 'src', 'queues', 'lua'), join(dist, 'queues', 'lua'), { recursive: true });

// tsc rewrites `./x.ts` to `./x.js` in the JavaScript it emits, not in declarations: a
// consumer's compiler would look for sources that are not shipped.
const relativeTs = /(from\s+|import\s*\(\s*)(['"])(\.{1,2}\/[^'"]+)\.ts\2/g;
for (const entry of readdirSync(dist, { recursive: true, withFileTypes: true })) {
  if (!entry.isFile() || !entry.name.endsWith('.d.ts')) continue;
  const path = join(entry.parentPath, entry.name);
  const text = readFileSync(path, 'utf8');
  const rewritten = text.replace(relativeTs, (_all, lead, quote, stem) => `${lead}${quote}${stem}.js${quote}`);
  if (rewritten !== text) writeFileSync(path, rewritten);
}

// The light client (packages/client): a package of its own, with no dependencies.
const clientDist = join(root, 'packages', 'client', 'dist');
rmSync(clientDist, { recursive: true, force: true });
execFileSync(process.execPath, [tsc, '-p', join(root, 'packages', 'client', 'tsconfig.json')], { stdio: 'inherit' });

// What it was built from (test/helpers/build-setup.ts skips a rebuild of the same sources).
writeFileSync(join(dist, '.source-hash'), sourceHash(root));
