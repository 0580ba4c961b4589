import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';
import { expect, it } from 'vitest';

const FIXTURE = fileURLToPath(new URL('./fixtures/signal-at-hand-over.ts', import.meta.url));

it('a SIGTERM caught just before the hand-over to the graceful stop still stops the process gracefully', async () => {
  const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE], { stdio: ['ignore', 'pipe', 'inherit'] });
  let output = '';
  child.stdout!.on('data', (chunk: Buffer) => (output += chunk.toString()));
  // Lost, the signal leaves the process running: it is killed after 10 s and the test fails.
  const killer = setTimeout(() => child.kill('SIGKILL'), 10_000);
  const [code, signal] = (await once(child, 'exit')) as [number | null, NodeJS.Signals | null];
  clearTimeout(killer);
  expect({ code, signal }).toEqual({ code: 0, signal: null });
  expect(output).toContain('"msg":"stopping gracefully"');
  expect(output).toContain('"msg":"graceful stop ran"');
});
