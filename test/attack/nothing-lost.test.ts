import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import { readCallFile } from '../helpers/invariants.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';
import { bedFor, dirFor, type Finished, gate, lease, QUICK_RECOVERY, TestBed, workerEnv } from '../helpers/env.ts';
import { type WorkerProcess, workerFor } from '../helpers/worker-process.ts';

const BIN = fileURLToPath(new URL('../../bin/lease-ops.js', import.meta.url));
const PROVIDER = fileURLToPath(new URL('../helpers/recording-provider.ts', import.meta.url));

/** A worker process with the recording provider, optionally stopping itself at fault points; killed when the test ends. */
async function worker(finished: Finished, b: TestBed, callFile: string, extra: Record<string, string> = {}, awaitReady = true): Promise<WorkerProcess> {
  const w = workerFor(finished, workerEnv(b, { ...QUICK_RECOVERY, LEASE_OPS_PROVIDERS: PROVIDER, RECORDING_FILE: callFile, RECORDING_MAX_MS: '0', ...extra }));
  if (awaitReady) await w.ready;
  return w;
}

/** A bed and a directory for the calls file, closed and removed when the test ends: tests with their own run at once. */
const setUp = async (finished: Finished, overrides: Record<string, string> = {}) => {
  const bed = await bedFor(finished, { LEASE_OPS_KEEP_COMPLETED_S: '3600', ...overrides });
  const dir = dirFor(finished, 'lease-ops-lost-');
  return { bed, callFile: join(dir, 'calls.jsonl') };
};

// Scenarios 1 to 4 run at once (worker processes killed at fault points, each test with its own bed).
describe.concurrent('scenario 1: an enqueue cut short after its idempotency key was stored, before its job was', () => {
  it('a retry with the same key makes and runs the operation, once', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const { bed, callFile } = await setUp(onTestFinished);
    await worker(onTestFinished, bed, callFile);
    // The CLI dies at that exact step (its process is killed there).
    const cli = spawn(process.execPath, [BIN, 'enqueue', 'stop', '--provider', 'recording', '--company', 'co', '--environment', 'env', '--lease', 'cut', '--params', '{"providerLeaseId":"cut"}', '--idempotency-key', 'cut-1'], {
      env: { ...process.env, REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_FAULT_POINTS: 'enqueue-after-key=kill', LEASE_OPS_LOG_LEVEL: 'silent' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const [, signal] = (await once(cli, 'exit')) as [number | null, string | null];
    expect(signal).toBe('SIGKILL');
    expect(Object.values(await bed.ops.queue.getJobCounts()).reduce((a, b) => a + b, 0)).toBe(0);

    const retried = await bed.ops.enqueue({ op: 'stop', lease: lease('cut'), params: { providerLeaseId: 'cut' }, idempotencyKey: 'cut-1' });
    expect((await bed.waitForAll([retried.jobId])).get(retried.jobId)).toBe('completed');
    const again = await bed.ops.enqueue({ op: 'stop', lease: lease('cut'), params: { providerLeaseId: 'cut' }, idempotencyKey: 'cut-1' });
    expect(again).toMatchObject({ jobId: retried.jobId, deduplicated: 'idempotency-key' });
    expect(readCallFile(callFile).filter((c) => c.leaseId === 'cut')).toHaveLength(1);
  });
});

describe.concurrent('scenario 2: a stall never turns a recorded outcome into another one, and every failure has a code', () => {
  it('stalled once, then its worker dies between the lane\'s release and BullMQ\'s completion: it completes, once', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const { bed, callFile } = await setUp(onTestFinished);
    const first = await worker(onTestFinished, bed, callFile, { LEASE_OPS_FAULT_POINTS: 'before-provider-call=kill' });
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('s2'), params: { providerLeaseId: 's2' } });
    await first.exited; // its first attempt's worker died before the provider call: stalled once
    const second = await worker(onTestFinished, bed, callFile, { LEASE_OPS_FAULT_POINTS: 'after-release=kill' });
    await second.exited; // released with its outcome, then died before BullMQ completed it
    await worker(onTestFinished, bed, callFile);
    expect((await bed.waitForAll([jobId], 30_000)).get(jobId)).toBe('completed');
    const job = (await bed.ops.queue.getJob(jobId))!;
    expect(job.stalledCounter).toBe(2);
    expect(job.returnvalue).toEqual({ providerLeaseId: 's2', state: 'stopped' });
    expect(readCallFile(callFile).filter((c) => c.jobId === jobId)).toHaveLength(1); // the replay made no call
  });

  it('with LEASE_OPS_MAX_STALLED=0, one crash after the release: the recorded outcome still stands', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const { bed, callFile } = await setUp(onTestFinished);
    const first = await worker(onTestFinished, bed, callFile, { LEASE_OPS_MAX_STALLED: '0', LEASE_OPS_FAULT_POINTS: 'after-release=kill' });
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('s0'), params: { providerLeaseId: 's0' } });
    await first.exited;
    await worker(onTestFinished, bed, callFile, { LEASE_OPS_MAX_STALLED: '0' });
    expect((await bed.waitForAll([jobId], 30_000)).get(jobId)).toBe('completed');
  });

  it('two attempts that each died with their worker: it fails with stalled_too_often, and its lane goes on', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const { bed, callFile } = await setUp(onTestFinished);
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('s3'), params: { providerLeaseId: 's3' } });
    const next = await bed.ops.enqueue({ op: 'resume', lease: lease('s3'), params: { providerLeaseId: 's3' } });
    // Each may take the job and die before its "started" line is out: wait for its end only.
    for (let i = 0; i < 2; i++) await (await worker(onTestFinished, bed, callFile, { LEASE_OPS_FAULT_POINTS: 'before-provider-call=kill' }, false)).exited;
    await worker(onTestFinished, bed, callFile);
    const ended = await bed.waitForAll([jobId, next.jobId], 30_000);
    expect(ended.get(jobId)).toBe('failed');
    expect((await bed.ops.queue.getJob(jobId))!.failedReason).toMatch(/^stalled_too_often: /);
    expect(ended.get(next.jobId)).toBe('completed');
  });
});

describe.concurrent('scenario 3: a Redis error inside a lane step retries the operation instead of failing it', () => {
  it.for(['lane-acquire', 'lane-yield', 'lane-park'])('a real Redis error at %s: the operation still completes', { timeout: 60_000 }, async (point, { onTestFinished }) => {
    const { bed, callFile } = await setUp(onTestFinished);
    // Every operation settles once, so its second attempt takes the lane again (lane-acquire),
    // and its first backs off (lane-yield); a promoted queued job parks itself (lane-park).
    const w = await worker(onTestFinished, bed, callFile, { RECORDING_SETTLE_FIRST: '1', LEASE_OPS_FAULT_POINTS: `${point}=redis-error*1` });
    const a = await bed.ops.enqueue({ op: 'stop', lease: lease('r3'), params: { providerLeaseId: 'r3' } });
    const b = await bed.ops.enqueue({ op: 'resume', lease: lease('r3'), params: { providerLeaseId: 'r3' } });
    if (point === 'lane-park') await (await bed.ops.queue.getJob(b.jobId))!.promote(); // not its turn: it parks itself
    const ended = await bed.waitForAll([a.jobId, b.jobId], 30_000);
    expect([...ended.values()]).toEqual(['completed', 'completed']);
    expect(w.logs.some((l) => l.includes(`lease-ops fault point ${point}: redis-error`))).toBe(true);
  });
});

describe.concurrent('scenario 4: Bull Board\'s retry of a failed operation runs it again', () => {
  it('retried as Bull Board retries it (job.retry), it calls the provider again and completes', async ({ onTestFinished }) => {
    const { bed } = await setUp(onTestFinished);
    let calls = 0;
    const { provider } = createRecordingProvider({ behaviour: () => (++calls === 1 ? 'permanent' : 'ok') });
    await bed.startWorker(provider);
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('r4'), params: { providerLeaseId: 'r4' } });
    expect((await bed.waitForAll([jobId])).get(jobId)).toBe('failed');
    const ranAgain = new Promise<void>((resolve) => {
      const on = ({ jobId: id }: { jobId: string }) => id === jobId && (bed.events.off('completed', on), resolve());
      bed.events.on('completed', on);
    });
    await (await bed.ops.queue.getJob(jobId))!.retry('failed');
    await ranAgain;
    expect(calls).toBe(2);
    expect((await bed.ops.queue.getJob(jobId))!.returnvalue).toEqual({ providerLeaseId: 'r4', state: 'stopped' });
    // Its lane was joined and left again: nothing stays behind.
    expect(await bed.laneKeys()).toEqual([]);
  });
});

describe('a stale attempt never fails its operation', () => {
  let bed: TestBed | undefined;
  afterEach(async () => {
    await bed?.close();
    bed = undefined;
  });

  it("its lane's token moved on while BullMQ still counts it the job's runner: the operation retries and completes (it failed 'attempt of ... is stale', no code)", async () => {
    bed = await TestBed.create();
    const reached = gate<void>();
    const proceed = gate<void>();
    const { provider, calls } = createRecordingProvider({
      callsPerOp: 2,
      behaviour: async ({ ctx }) => {
        if (ctx.attempt === 1) {
          reached.open();
          await proceed.promise;
        }
        return 'ok' as const;
      },
    });
    await bed.startWorker(provider);
    const { jobId, laneId } = await bed.ops.enqueue({ op: 'stop', lease: lease('moved-on'), params: { providerLeaseId: 'moved-on' } });
    await reached.promise;
    // The lane now names another token for this job (its BullMQ lock is untouched): the
    // attempt's next fenced call finds itself stale.
    await bed.redis.hset(bed.ops.lanes.execKey(laneId), 'token', '999999999');
    proceed.open();
    expect((await bed.waitForAll([jobId], 10_000)).get(jobId)).toBe('completed');
    expect(calls.filter((c) => c.end && c.attempt === 2).length).toBeGreaterThan(0);
  });
});
