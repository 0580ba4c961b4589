// What dist/ is built from, as one digest: every file under src/, the build's tsconfig and
// package.json. The build writes it into dist/; a test run whose sources hash the same skips
// the rebuild (dist/ is already the code under test).
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { join, relative } from 'node:path';

export function sourceHash(root) {
  const hash = createHash('sha256');
  const files = readdirSync(join(root, 'src'), { recursive: true, withFileTypes: true })
    .filter((entry) => entry.isFile())
    .map((entry) => join(entry.parentPath, entry.name))
    .concat([join(root, 'tsconfig.build.json'), join(root, 'tsconfig.json'), join(root, 'package.json'), join(root, 'scripts', 'build.js')])
    .sort();
  for (const file of files) hash.update(relative(root, file)).update('\0').update(readFileSync(file)).update('\0');
  return hash.digest('hex');
}
