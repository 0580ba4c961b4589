import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { laneIdOfJobId } from '../src/lease.ts';
import { createLogger } from '../src/logger.ts';
import { Attempt, Fencing, StaleAttemptError } from '../src/queues/fencing.ts';
import { createRedis } from '../src/queues/redis.ts';
import { bedFor, dirFor, lease, QUICK_RECOVERY, readUntil, REDIS_URL, workerEnv } from './helpers/env.ts';
import { readCallFile } from './helpers/invariants.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { waitForCall } from './helpers/watch-file.ts';
import { workerFor } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));

// Each test has its own bed, directory and worker processes: they run at once (most of their
// time is spent waiting on a lock to lapse or a deadline to pass).
describe.concurrent('fencing', () => {
  it('a stale attempt (its worker paused past its lock) makes no provider call after its successor starts', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const dir = dirFor(onTestFinished, 'lease-ops-fence-');
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
    const first = workerFor(onTestFinished, env);
    await first.ready;
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('f'), params: { providerLeaseId: 'f' } });

    // The first attempt is in its first provider call: freeze its process past the lock.
    await waitForCall(callFile, (c) => c.pid === first.pid);
    first.child.kill('SIGSTOP');
    const second = workerFor(onTestFinished, env);
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

  // Found in the chaos campaign (a lane left holding a completed job): a worker frozen between
  // BullMQ handing it a job and its lane step. Its lock lapsed and a second worker ran the job;
  // when the first woke, the lane gave it a fresh token anyway, which made the running attempt
  // stale: its result was discarded by the lane while BullMQ completed the job, and the lease's
  // next operation waited for the sweep. The lane must ask whose BullMQ lock it is.
  it('a start whose worker froze before its lane step, after another worker took the job, gets no token: the running attempt keeps its lane and releases it, and the next operation follows at once', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished, { LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    const dir = dirFor(onTestFinished, 'lease-ops-stale-start-');
    const callFile = join(dir, 'calls.jsonl');
    // The sweep is kept out of it: it would repair a lane left behind, and hide the fault.
    const env = workerEnv(bed, { ...QUICK_RECOVERY, LEASE_OPS_SWEEP_STALE_MS: '120000', LEASE_OPS_PROVIDERS: PROVIDER, RECORDING_FILE: callFile });
    // The first worker's first attempt settles, so its retry asks the lane; the worker
    // freezes right there, holding BullMQ's lock.
    const frozen = workerFor(onTestFinished, { ...env, RECORDING_MAX_MS: '0', RECORDING_SETTLE_FIRST: '1', LEASE_OPS_FAULT_POINTS: 'lane-acquire=pause*1' });
    await frozen.ready;
    const first = await bed.ops.enqueue({ op: 'stop', lease: lease('frozen'), params: { providerLeaseId: 'frozen' } });
    const next = await bed.ops.enqueue({ op: 'resume', lease: lease('frozen'), params: { providerLeaseId: 'frozen' } });
    await frozen.waitForLog('lease-ops fault point lane-acquire: pause');

    // Its lock lapses; a second worker, whose calls take 1.5 s, runs the job.
    const runner = workerFor(onTestFinished, { ...env, RECORDING_MIN_MS: '1500', RECORDING_MAX_MS: '1501' });
    await runner.ready;
    await waitForCall(callFile, (c) => c.jobId === first.jobId && c.pid === runner.pid && !c.end);
    // The frozen worker wakes while that call runs, and takes its lane step.
    frozen.child.kill('SIGCONT');

    const ended = await bed.waitForAll([first.jobId, next.jobId], 15_000);
    expect([...ended.values()]).toEqual(['completed', 'completed']);
    // The lane heard how the operation ended, from the attempt that ran it.
    const job = (await bed.ops.queue.getJob(first.jobId))!;
    expect(await bed.redis.hget(bed.ops.queue.toKey(first.jobId), 'lo:outcome')).toContain('"completed"');
    expect(job.returnvalue).toEqual({ providerLeaseId: 'frozen', state: 'stopped' });
    expect(runner.logs.some((l) => l.includes('superseded while it ran'))).toBe(false);
    await frozen.waitForLog('attempt started after its lock lapsed', 1_000);
    // The woken worker made no call: its attempt was stale from the start.
    const calls = readCallFile(callFile).filter((c) => c.jobId === first.jobId && c.end);
    expect(calls.map((c) => [c.pid === runner.pid ? 'runner' : 'frozen', c.attempt, c.outcome])).toEqual([
      ['frozen', 1, 'settling'],
      ['runner', 2, 'ok'],
    ]);
    expect(await bed.laneKeys()).toEqual([]);
  });

  // Found by the attack on the change above: an attempt told to park froze before it parked;
  // a successor ran the job to its end, and the frozen one woke past the job's deadline and
  // dropped it from its lane as expired, writing a false "failed" on the lease's timeline.
  // Alone, after the two above: its successor must start and run both jobs within a deadline.
  it.sequential('an attempt that froze between its park answer and its park, past the job\'s deadline, drops nothing: a successor ran the job', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished, { LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    const dir = dirFor(onTestFinished, 'lease-ops-stale-park-');
    const callFile = join(dir, 'calls.jsonl');
    const env = workerEnv(bed, { ...QUICK_RECOVERY, LEASE_OPS_PROVIDERS: PROVIDER, RECORDING_FILE: callFile });
    // The first worker's calls take 1 s, so the next operation, promoted by hand, parks.
    const frozen = workerFor(onTestFinished, { ...env, RECORDING_MIN_MS: '1000', RECORDING_MAX_MS: '1001', LEASE_OPS_FAULT_POINTS: 'before-park=pause*1' });
    await frozen.ready;
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('parks'), params: { providerLeaseId: 'parks' } });
    // A deadline the successor meets with room to spare on a loaded machine (8 s failed beside a
    // CPU hog: the second worker's start took most of it); the test then waits it out.
    const next = await bed.ops.enqueue({ op: 'resume', lease: lease('parks'), params: { providerLeaseId: 'parks' }, deadlineMs: 15_000 });
    await waitForCall(callFile, (c) => c.jobId === head.jobId);
    await (await bed.ops.queue.getJob(next.jobId))!.promote();
    await frozen.waitForLog('lease-ops fault point before-park: pause');
    // Both of its jobs' locks lapse; a second worker runs them, in order, within the deadline.
    const runner = workerFor(onTestFinished, { ...env, RECORDING_MAX_MS: '0' });
    await runner.ready;
    const ended = await bed.waitForAll([head.jobId, next.jobId], 20_000);
    expect([ended.get(head.jobId), ended.get(next.jobId)]).toEqual(['completed', 'completed']);
    // The frozen worker wakes past the deadline, where it was: about to drop the job as expired.
    const { deadlineAt } = (await bed.ops.queue.getJob(next.jobId))!.data as { deadlineAt: number };
    await new Promise((resolve) => setTimeout(resolve, Math.max(0, deadlineAt - Date.now() + 100)));
    frozen.child.kill('SIGCONT');
    const kinds = async () => (await bed.ops.history.read(laneIdOfJobId(next.jobId)!)).filter((e) => e.jobId === next.jobId).map((e) => e.kind);
    const refused = () => frozen.logs.some((l) => l.includes('attempt started after its lock lapsed'));
    await readUntil(async () => refused() || (await kinds()).includes('failed'), 10_000, 'the woken attempt to act');
    expect(await kinds()).not.toContain('failed');
    expect(refused()).toBe(true);
    expect(await bed.redis.hget(bed.ops.queue.toKey(next.jobId), 'lo:outcome')).toContain('"completed"');
    expect(await bed.ops.queue.getJobState(next.jobId)).toBe('completed');
  });
});

describe('Fencing.abandonAll (a worker closing without waiting)', () => {
  it('stops the attempts it tracks, and any it tracks after: their signals abort and their checks refuse', async () => {
    const redis = createRedis(REDIS_URL);
    try {
      const fencing = new Fencing(redis, (laneId) => `{lo-abandon}:lane:${laneId}:exec`, (jobId) => `{lo-abandon}:job:${jobId}:lock`, createLogger({ level: 'silent' }), 60_000);
      const running = new Attempt('j1', 'l1', '1', 'lock-1');
      fencing.track(running);
      expect(fencing.abandonAll()).toBe(1);
      // A job BullMQ hands over as the worker closes.
      const late = new Attempt('j2', 'l2', '1', 'lock-2');
      fencing.track(late);
      for (const attempt of [running, late]) {
        expect(attempt.abandoned).toBe(true);
        expect(attempt.signal.aborted).toBe(true);
        await expect(fencing.check(attempt)).rejects.toThrow(/worker closed without waiting/);
      }
    } finally {
      redis.disconnect();
    }
  });

  it('many checks of one attempt out at once leave its signal alone (no listener warning for a provider sending in parallel)', async () => {
    const redis = createRedis(REDIS_URL);
    const exec = (laneId: string) => `{lo-many-checks}:lane:${laneId}:exec`;
    const lock = (jobId: string) => `{lo-many-checks}:job:${jobId}:lock`;
    const warnings: string[] = [];
    const onWarning = (warning: Error) => warnings.push(`${warning.name}: ${warning.message}`);
    process.on('warning', onWarning);
    try {
      await redis.hset(exec('l1'), 'token', '3');
      await redis.set(lock('j1'), 'lock-1', 'PX', 30_000);
      const fencing = new Fencing(redis, exec, lock, createLogger({ level: 'silent' }), 60_000);
      const attempt = new Attempt('j1', 'l1', '3', 'lock-1');
      fencing.track(attempt);
      // The provider's requests listen to the signal too.
      expect(attempt.signal.aborted).toBe(false);
      await Promise.all(Array.from({ length: 50 }, () => fencing.check(attempt)));
      await new Promise((r) => setImmediate(r));
      expect(warnings).toEqual([]);
    } finally {
      process.off('warning', onWarning);
      await redis.del(exec('l1'), lock('j1'));
      redis.disconnect();
    }
  });

  it('a check already out when the worker closes without waiting rejects at once: the answer that comes after is not taken', async () => {
    // helper-32: the answer ("current": the lock was still there) came over the closing
    // socket after the close, and the abandoned attempt's next request went out.
    const server = await RedisProcess.start();
    const redis = createRedis(server.url);
    try {
      const exec = (laneId: string) => `{lo-abandon}:lane:${laneId}:exec`;
      const lock = (jobId: string) => `{lo-abandon}:job:${jobId}:lock`;
      await redis.hset(exec('l1'), 'token', '5');
      await redis.set(lock('j1'), 'lock-1', 'PX', 30_000);
      const fencing = new Fencing(redis, exec, lock, createLogger({ level: 'silent' }), 60_000);
      const attempt = new Attempt('j1', 'l1', '5', 'lock-1');
      fencing.track(attempt);
      await fencing.check(attempt);
      server.pause();
      const checked = fencing.check(attempt).then(
        () => 'confirmed',
        (err: unknown) => (err instanceof StaleAttemptError ? 'stale' : `error: ${String(err)}`),
      );
      await new Promise((r) => setImmediate(r));
      fencing.abandonAll();
      server.resume();
      expect(await checked).toBe('stale');
    } finally {
      server.resume();
      redis.disconnect();
      await server.stop();
    }
  });
});
