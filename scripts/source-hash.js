// What dist/ (and packages/client/dist/) is built from, as one digest: every file under src/
// and packages/client/src/, the builds' tsconfigs, package.json files and the lockfile. The build writes it
// into dist/; a test run whose sources hash the same skips the rebuild.
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { join, relative } from 'node:path';

export function sourceHash(root) {
  const hash = createHash('sha256');
  const client = join(root, 'packages', 'client');
  const files = [join(root, 'src'), join(client, 'src')]
    .flatMap((dir) => readdirSync(dir, { recursive: true, withFileTypes: true }))
    .filter((entry) => entry.isFile())
    .map((entry) => join(entry.parentPath, entry.name))
    // The lockfile too: the build is where src/ is type-checked (the test run's check reads its
    // declarations), so new dependency types, or a new TypeScript, must build it again (helper-40).
    .concat([join(root, 'tsconfig.build.json'), join(root, 'tsconfig.json'), join(root, 'package.json'), join(root, 'package-lock.json'), join(root, 'scripts', 'build.js')])
    .concat([join(client, 'tsconfig.json'), join(client, 'package.json')])
    .sort();
  for (const file of files) hash.update(relative(root, file)).update('\0').update(readFileSync(file)).update('\0');
  return hash.digest('hex');
}
