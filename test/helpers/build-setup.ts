import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

/**
 * Builds dist/ once per run (both projects list this): the CLI that tests start as a child
 * process runs the compiled code, which must be the code under test. A dist/ built from the
 * same sources (its .source-hash says so: `npm ci` builds it) is used as it is.
 */
export default async function buildOnce(): Promise<void> {
  // The tests' provider module their worker children load, compiled here, before any test runs:
  // the first compile loads TypeScript, 0.3-0.4 s that would hold up a test's own process.
  const { childModule } = await import('./child-module.ts');
  childModule(fileURLToPath(new URL('./recording-provider.ts', import.meta.url)));
  if (process.env.LEASE_OPS_TEST_BUILT === '1') return;
  const root = fileURLToPath(new URL('../..', import.meta.url));
  const { sourceHash } = (await import(pathToFileURL(join(root, 'scripts', 'source-hash.js')).href)) as { sourceHash: (root: string) => string };
  const built = existsSync(join(root, 'dist', '.source-hash')) ? readFileSync(join(root, 'dist', '.source-hash'), 'utf8') : null;
  if (built !== sourceHash(root)) execFileSync(process.execPath, [join(root, 'scripts', 'build.js')], { stdio: 'inherit' });
  process.env.LEASE_OPS_TEST_BUILT = '1';
}
