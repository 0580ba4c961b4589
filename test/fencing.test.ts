import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import { lease, TestBed, workerEnv } from './helpers/env.ts';
import { readCallFile } from './helpers/invariants.ts';
import { waitForCall } from './helpers/watch-file.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));

let bed: TestBed | undefined;
let dir: string | undefined;
const workers: WorkerProcess[] = [];
afterEach(async () => {
  for (const w of workers.splice(0)) {
    w.child.kill('SIGCONT');
    w.child.kill('SIGKILL');
    await w.exited;
  }
  await bed?.close();
  if (dir) rmSync(dir, { recursive: true, force: true });
  bed = undefined;
  dir = undefined;
});

describe('fencing', () => {
  it('a stale attempt (its worker paused past its lock) makes no provider call after its successor starts', { timeout: 60_000 }, async () => {
    bed = await TestBed.create();
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-fence-'));
    const callFile = join(dir, 'calls.jsonl');
    const env = workerEnv(bed, {
      LEASE_OPS_PROVIDERS: PROVIDER,
      LEASE_OPS_LOCK_MS: '1500',
      LEASE_OPS_STALLED_INTERVAL_MS: '500',
      RECORDING_FILE: callFile,
      RECORDING_CALLS: '2',
      RECORDING_MIN_MS: '1000',
      RECORDING_MAX_MS: '1100',
    });
    const first = new WorkerProcess(env);
    workers.push(first);
    await first.ready;
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('f'), params: { providerLeaseId: 'f' } });

    // The first attempt is in its first provider call: freeze its process past the lock.
    await waitForCall(callFile, (c) => c.pid === first.pid);
    first.child.kill('SIGSTOP');
    const second = new WorkerProcess(env);
    workers.push(second);
    await second.ready;
    const successorStart = await waitForCall(callFile, (c) => c.pid === second.pid);

    // Thaw the stale attempt: it finishes the call it was in, then must be refused.
    first.child.kill('SIGCONT');
    await first.waitForLog('stale attempt refused a provider call');
    const ended = await bed.waitForAll([jobId]);
    expect(ended.get(jobId)).toBe('completed');

    const calls = readCallFile(callFile);
    const staleAfter = calls.filter((c) => c.pid === first.pid && BigInt(c.start) >= BigInt(successorStart.start));
    expect(staleAfter).toEqual([]);
    // The successor made both of its calls; the stale attempt only its first.
    expect(calls.filter((c) => c.pid === second.pid)).toHaveLength(2);
    expect(calls.filter((c) => c.pid === first.pid)).toHaveLength(1);
  });
});
