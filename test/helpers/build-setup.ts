import { execFileSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';

/**
 * Builds dist/ once per run (both projects list this): the CLI that tests start as a child
 * process runs the compiled code, which must be the code under test.
 */
export default function buildOnce(): void {
  if (process.env.LEASE_OPS_TEST_BUILT === '1') return;
  execFileSync(process.execPath, [fileURLToPath(new URL('../../scripts/build.js', import.meta.url))], { stdio: 'inherit' });
  process.env.LEASE_OPS_TEST_BUILT = '1';
}
