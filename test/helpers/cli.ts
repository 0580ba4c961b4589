import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

export const BIN = fileURLToPath(new URL('../../bin/lease-ops.js', import.meta.url));

/**
 * Runs `lease-ops ...args`; resolves with the exit code and output, never rejects. A command
 * still running after `timeoutMs` is killed (code null): give it less than the test's own
 * timeout, so a hang fails the test with what the command printed.
 */
export async function cli(args: string[], env: Record<string, string>, timeoutMs = 60_000): Promise<{ code: number | null; stdout: string; stderr: string }> {
  try {
    const { stdout, stderr } = await promisify(execFile)(process.execPath, [BIN, ...args], { env: { ...process.env, ...env }, timeout: timeoutMs });
    return { code: 0, stdout, stderr };
  } catch (err) {
    const e = err as { code: number | null; stdout: string; stderr: string };
    return { code: e.code, stdout: e.stdout, stderr: e.stderr };
  }
}
