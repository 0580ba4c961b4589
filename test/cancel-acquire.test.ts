import { afterEach, describe, expect, it, onTestFinished } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import type { LeaseProvider } from '../src/providers/types.ts';
import { createLogger } from '../src/logger.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { OperatorActions } from '../src/queues/operator-actions.ts';
import { LeaseWorker } from '../src/queues/worker.ts';
import { loadLuaScript } from '../src/queues/lua-scripts.ts';
import { bullmqFetchingScripts, FETCHING_SCRIPTS, quietScript } from '../src/queues/quiet-fetch.ts';
import { createRedis } from '../src/queues/redis.ts';
import { gate, readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { captureLog } from './helpers/log-capture.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { TcpProxy } from './helpers/tcp-proxy.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// A host that gave up on an acquire cancels it: queued, backing off or executing, it ends
// failed with `cancelled`, and whatever sandbox it made is destroyed by its clean-up (never a
// second one made).

let bed: TestBed | undefined;
let fake: DaytonaFake | undefined;
afterEach(async () => {
  await bed?.close();
  await fake?.close();
  bed = undefined;
  fake = undefined;
});

const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
const lease = (leaseId: string) => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });
/** Sandboxes the fake made for one acquire job (named after it), and whether each is gone. */
const madeFor = (f: DaytonaFake, jobId: string) => [...f.sandboxes.values()].filter((sb) => sb.name.includes(jobId.replace(/[^A-Za-z0-9-]/g, '-'))).map((sb) => f.stateOf(sb.id));
/** Waits for the clean-up to destroy what an acquire made: one sandbox, gone. */
async function destroyedOnce(f: DaytonaFake, jobId: string, withinMs: number): Promise<void> {
  await readUntil(async () => madeFor(f, jobId).every((state) => state === 'gone'), withinMs, 'the clean-up destroying the sandbox');
  expect(madeFor(f, jobId)).toEqual(['gone']);
}

/** The Daytona fake these tests run against: creates take `createMs`, every other transition 10 ms (a force-stop none). */
const daytonaFake = (createMs: number) => new DaytonaFake({ apiKey: 'k', timings: { create: createMs, start: 10, stop: 10, forceStop: 0, destroy: 10 } });

/**
 * An acquire on `worker` (its fault points pause it just before its release): once it pauses,
 * the host cancels it, as its sandbox runs and after its attempt looked for a cancel and found
 * none, and the worker goes on.
 */
async function cancelledAtItsEnd(worker: WorkerProcess, leaseId: string): Promise<{ jobId: string }> {
  const acquired = await bed!.ops.enqueue({ op: 'acquire', lease: lease(leaseId), params: { runId: leaseId } });
  await worker.waitForLog('fault point before-acquire-release: pause');
  expect(await new OperatorActions(bed!.ops).cancel(acquired.jobId, 'host')).toMatchObject({ cancelled: true, whileExecuting: true });
  worker.child.kill('SIGCONT');
  return acquired;
}

async function setUp(timings: { create: number }, wrap: (p: LeaseProvider) => LeaseProvider = (p) => p, env: Record<string, string> = {}) {
  bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '600', ...env });
  fake = daytonaFake(timings.create);
  await bed.startWorker(wrap(createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced })));
  return { bed, fake, actions: new OperatorActions(bed.ops) };
}

describe('cancelling an acquire', () => {
  it('executing: it stops at its next step, fails with cancelled, and the sandbox it made is destroyed', async () => {
    const held = gate();
    const inside = gate();
    const { bed, fake, actions } = await setUp({ create: 10 }, (p) => ({
      ...p,
      async acquire(ctx, params) {
        const lease = await p.acquire(ctx, params);
        // The sandbox runs; the attempt is still executing when the host gives up.
        inside.open();
        await held.promise;
        return lease;
      },
    }));
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-x'), params: { runId: 'run-x' } });
    await inside.promise;
    expect(madeFor(fake, acquired.jobId)).toEqual(['started']);
    const cancelled = await actions.cancel(acquired.jobId, 'host');
    expect(cancelled).toMatchObject({ cancelled: true, whileExecuting: true });
    held.open();
    expect((await bed.waitForAll([acquired.jobId])).get(acquired.jobId)).toBe('failed');
    expect((await bed.ops.queue.getJob(acquired.jobId))!.failedReason).toMatch(/^cancelled: /);
    await destroyedOnce(fake, acquired.jobId, 10_000);
  });

  it('backing off while its sandbox is still being created: it leaves its lane, and the sandbox is destroyed once it exists', async () => {
    // A backoff of 5 s (at least 3.75 with its jitter): the cancel lands while the acquire
    // backs off, not in its next attempt (a CI run stalled past a 250 ms backoff between the
    // two and got whileExecuting).
    const { bed, fake, actions } = await setUp({ create: 600 }, undefined, { LEASE_OPS_BACKOFF_BASE_MS: '5000' });
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-y'), params: { runId: 'run-y' } });
    await readUntil(async () => (await bed.ops.queue.getJobState(acquired.jobId)) === 'delayed' && madeFor(fake, acquired.jobId).length === 1, 10_000, 'the acquire backing off');
    expect(await actions.cancel(acquired.jobId, 'host')).toMatchObject({ cancelled: true, whileExecuting: false });
    expect((await bed.waitForAll([acquired.jobId])).get(acquired.jobId)).toBe('failed');
    await readUntil(async () => madeFor(fake, acquired.jobId).every((s) => s === 'gone'), 15_000, 'the clean-up destroying the sandbox');
    // One sandbox was ever made for it.
    expect(madeFor(fake, acquired.jobId)).toEqual(['gone']);
  });

  it('queued behind another operation: it leaves its lane and nothing is made', async () => {
    const held = gate();
    const { bed, fake, actions } = await setUp({ create: 10 }, (p) => ({
      ...p,
      async stop(ctx, params) {
        await held.promise;
        return p.stop(ctx, params);
      },
    }));
    const first = await bed.ops.enqueue({ op: 'stop', lease: lease('run-z'), params: { providerLeaseId: 'run-z' } });
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-z'), params: { runId: 'run-z' } });
    expect(await actions.cancel(acquired.jobId, 'host')).toMatchObject({ cancelled: true, whileExecuting: false });
    held.open();
    const ended = await bed.waitForAll([first.jobId, acquired.jobId]);
    expect(ended.get(acquired.jobId)).toBe('failed');
    expect(madeFor(fake, acquired.jobId)).toEqual([]);
  });
});

describe('a cancel taken after the lane handed the acquire off and before its first attempt started', () => {
  /**
   * The acquire is the lane's holder, handed off by the release of the operation before it,
   * while no worker fetches (the queue is paused): the cancel marks it, and it starts after.
   */
  async function handedOffThenCancelled(before: (bed: TestBed) => Promise<{ jobId: string }>, lastLease: string) {
    const held = gate();
    const inside = gate();
    const { bed, fake, actions } = await setUp({ create: 10 }, (p) => ({
      ...p,
      async stop(ctx, params) {
        inside.open();
        await held.promise;
        return p.stop(ctx, params);
      },
      async acquire(ctx, params) {
        const made = await p.acquire(ctx, params);
        inside.open();
        await held.promise;
        return made;
      },
    }));
    const first = await before(bed);
    await inside.promise;
    await bed.ops.queue.pause();
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease(lastLease), params: { runId: `${lastLease}-again` } });
    held.open();
    expect((await bed.waitForAll([first.jobId])).get(first.jobId)).toBe('completed');
    expect(await bed.ops.queue.getJobState(acquired.jobId)).toBe('waiting');
    expect(await actions.cancel(acquired.jobId, 'host')).toMatchObject({ cancelled: true, whileExecuting: true });
    await bed.ops.queue.resume();
    expect((await bed.waitForAll([acquired.jobId])).get(acquired.jobId)).toBe('failed');
    return { fake, acquired, job: (await bed.ops.queue.getJob(acquired.jobId))! };
  }

  it('behind a stop: it makes nothing, and fails with cancelled', async () => {
    const { fake, acquired, job } = await handedOffThenCancelled((bed) => bed.ops.enqueue({ op: 'stop', lease: lease('run-h'), params: { providerLeaseId: 'run-h' } }), 'run-h');
    expect(job.failedReason).toMatch(/^cancelled: /);
    expect(madeFor(fake, acquired.jobId)).toEqual([]);
  });

  it('where it would also be refused (accepted while the lease\'s first acquire ran, which made a sandbox): the cancel is what it fails with', async () => {
    const { fake, acquired, job } = await handedOffThenCancelled((bed) => bed.ops.enqueue({ op: 'acquire', lease: lease('run-k'), params: { runId: 'run-k' } }), 'run-k');
    expect(job.failedReason).toMatch(/^cancelled: /);
    expect(madeFor(fake, acquired.jobId)).toEqual([]);
  });
});

describe('a cancel that races the acquire\'s end', () => {
  it('taken after the attempt looked for a cancel and before its end was recorded: the acquire still fails with cancelled, and its sandbox is destroyed', { timeout: 60_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '600' });
    fake = daytonaFake(10);
    const worker = new WorkerProcess(
      workerEnv(bed, {
        LEASE_OPS_PROVIDERS: 'daytona',
        DAYTONA_API_URL: await fake.listen(),
        DAYTONA_API_KEY: 'k',
        // Long enough that the pause below never costs the attempt its lock.
        LEASE_OPS_LOCK_MS: '10000',
        LEASE_OPS_FAULT_POINTS: 'before-acquire-release=pause*1',
      }),
    );
    try {
      await worker.ready;
      const acquired = await cancelledAtItsEnd(worker, 'run-race');
      expect((await bed.waitForAll([acquired.jobId], 20_000)).get(acquired.jobId)).toBe('failed');
      expect((await bed.ops.queue.getJob(acquired.jobId))!.failedReason).toMatch(/^cancelled: /);
      await destroyedOnce(fake!, acquired.jobId, 15_000);
    } finally {
      worker.child.kill('SIGCONT');
      await worker.terminate();
    }
  });

  it('killed as it fails it (BullMQ refused the completion sent with the refused release, quiet-fetch.ts): another worker fails it as cancelled once its lock lapses, and its sandbox is destroyed', { timeout: 60_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '600' });
    fake = daytonaFake(10);
    const providerEnv = { LEASE_OPS_PROVIDERS: 'daytona', DAYTONA_API_URL: await fake.listen(), DAYTONA_API_KEY: 'k' };
    const first = new WorkerProcess(
      workerEnv(bed, { ...providerEnv, LEASE_OPS_LOCK_MS: '5000', LEASE_OPS_FAULT_POINTS: 'before-acquire-release=pause*1,refused-end=kill*1' }),
    );
    let second: WorkerProcess | undefined;
    try {
      await first.ready;
      const acquired = await cancelledAtItsEnd(first, 'run-refused');
      // The release refused, BullMQ's completion refused, and the worker dies as it begins to fail it.
      await first.waitForLog('fault point refused-end: kill');
      await first.exited;
      expect(await bed.ops.queue.getJobState(acquired.jobId)).toBe('active');
      second = new WorkerProcess(workerEnv(bed, { ...providerEnv, LEASE_OPS_STALLED_INTERVAL_MS: '500' }));
      await second.ready;
      expect((await bed.waitForAll([acquired.jobId], 40_000)).get(acquired.jobId)).toBe('failed');
      expect((await bed.ops.queue.getJob(acquired.jobId))!.failedReason).toMatch(/^cancelled: /);
      await destroyedOnce(fake!, acquired.jobId, 15_000);
    } finally {
      first.child.kill('SIGCONT');
      await first.terminate();
      await second?.terminate();
    }
  });
});

// ioredis sends a script by its SHA once it ran it on a connection, and sends it again (as EVAL)
// only when the NOSCRIPT reply comes back: Redis has run the completion sent in the same write
// by then. So with the script cache flushed under a connected worker (SCRIPT FLUSH, or a Redis
// that evicts scripts), an acquire's release can run after BullMQ's completion (helper-43).
describe("an acquire whose release Redis runs after BullMQ's completion (the scripts flushed under a connected worker)", () => {
  async function releasedLate(cancel: boolean) {
    const server = await RedisProcess.start();
    onTestFinished(() => server.stop());
    bed = await TestBed.create({ REDIS_URL: server.url, LEASE_OPS_KEEP_COMPLETED_S: '600' });
    fake = daytonaFake(10);
    const side = createRedis(server.url);
    onTestFinished(() => side.disconnect());
    const daytona = createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced });
    let armed = false;
    const worker = await bed.startWorker({
      ...daytona,
      async acquire(ctx, params) {
        const made = await daytona.acquire(ctx, params);
        if (ctx.lease.leaseId === 'run-late') {
          await side.script('FLUSH');
          // Another replica's completion loads its script again; nobody loads the release.
          await side.script('LOAD', quietScript(bullmqFetchingScripts()[1]!, FETCHING_SCRIPTS[1]!.rewrites)!.content);
          armed = true;
        }
        return made;
      },
    });
    // Its connection has run every script once: it sends them by their SHA from now on.
    const warm = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-warm'), params: { runId: 'run-warm' } });
    expect((await bed.waitForAll([warm.jobId])).get(warm.jobId)).toBe('completed');
    // The release sent again after its NOSCRIPT reply is held until the test lets it go.
    const resent = gate<() => void>();
    type Sent = { name: string; args: unknown[]; promise: Promise<unknown> };
    const connection = (worker as unknown as { workerConnection: { sendCommand(cmd: Sent): unknown } }).workerConnection;
    const send = connection.sendCommand.bind(connection);
    let releases = 0;
    connection.sendCommand = (cmd: Sent) => {
      if (armed && cmd.name === 'evalsha' && cmd.args.some((a) => String(a).includes('"status":"completed"')) && ++releases === 2) {
        resent.open(() => void send(cmd));
        return cmd.promise;
      }
      return send(cmd);
    };
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-late'), params: { runId: 'run-late' } });
    const letGo = await resent.promise;
    // Answered in order on that connection: the completion sent with the release has been answered.
    await (connection as unknown as { ping(): Promise<string> }).ping();
    // Not completed ahead of its release.
    expect(await bed.ops.queue.getJobState(acquired.jobId)).toBe('active');
    const cancelled = cancel ? await new OperatorActions(bed.ops).cancel(acquired.jobId, 'host').catch((err: Error) => err.message) : null;
    letGo();
    const state = (await bed.waitForAll([acquired.jobId], 20_000)).get(acquired.jobId);
    return { acquired, cancelled, state, job: (await bed.ops.queue.getJob(acquired.jobId))! };
  }

  it('cancelled meanwhile: the cancel is taken, and the acquire fails with cancelled and its sandbox is destroyed', { timeout: 60_000 }, async () => {
    const { acquired, cancelled, state, job } = await releasedLate(true);
    expect(cancelled).toMatchObject({ cancelled: true, whileExecuting: true });
    expect(state).toBe('failed');
    expect(job.failedReason).toMatch(/^cancelled: /);
    await destroyedOnce(fake!, acquired.jobId, 15_000);
  });

  it('not cancelled: it completes once its release has run, and the lease\'s next operation runs', { timeout: 60_000 }, async () => {
    const { acquired, state, job } = await releasedLate(false);
    expect(state).toBe('completed');
    expect(JSON.parse((await bed!.redis.hget(bed!.ops.queue.toKey(acquired.jobId), 'lo:outcome'))!)).toMatchObject({ status: 'completed' });
    expect(madeFor(fake!, acquired.jobId)).toEqual(['started']);
    const sandbox = (job.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const stop = await bed!.ops.enqueue({ op: 'stop', lease: lease('run-late'), params: { providerLeaseId: sandbox } });
    expect((await bed!.waitForAll([stop.jobId], 20_000)).get(stop.jobId)).toBe('completed');
  });
});

// The release sent again after its NOSCRIPT reply runs and ends the job, its reply is lost, and
// ioredis sends it once more after it reconnects: that run finds the lane moved on and answers
// 'stale'. The acquire ended all the same, and is completed, its provider called once (helper-44).
it("an acquire whose late release ran twice (its reply lost, sent again on reconnect) completes once, its provider called once", { timeout: 60_000 }, async () => {
  const server = await RedisProcess.start();
  onTestFinished(() => server.stop());
  const proxy = await TcpProxy.start(server.port);
  onTestFinished(() => proxy.close());
  bed = await TestBed.create({ REDIS_URL: server.url, LEASE_OPS_KEEP_COMPLETED_S: '600' });
  const inside = gate();
  const held = gate();
  const recording = createRecordingProvider({
    behaviour: async ({ op, ctx }) => {
      if (op === 'acquire' && ctx.lease.leaseId === 'twice') {
        inside.open();
        await held.promise;
      }
      return 'ok' as const;
    },
  });
  const logged = captureLog();
  const worker = new LeaseWorker({ ...bed.config, REDIS_URL: proxy.url }, new ProviderRegistry([recording.provider]), logged.log);
  await worker.start();
  onTestFinished(() => worker.close());
  const recorded = (leaseId: string) => ({ provider: 'recording', companyId: 'co', environmentId: 'env', leaseId });
  // Its connection has run every script once: it sends them by their SHA from now on.
  const warm = await bed.ops.enqueue({ op: 'acquire', lease: recorded('warm'), params: { runId: 'warm' } });
  expect((await bed.waitForAll([warm.jobId])).get(warm.jobId)).toBe('completed');
  const acquired = await bed.ops.enqueue({ op: 'acquire', lease: recorded('twice'), params: { runId: 'twice' } });
  await inside.promise;
  await bed.redis.script('FLUSH');
  await bed.redis.script('LOAD', quietScript(bullmqFetchingScripts()[1]!, FETCHING_SCRIPTS[1]!.rewrites)!.content);
  // Only the release sent as EVAL carries its text: the one sent again after NOSCRIPT.
  proxy.loseNextReplyTo(new RegExp(loadLuaScript('lane-release').slice(0, 120).replace(/[.*+?^${}()|[\]\\]/g, '\\$&')));
  held.open();
  expect((await bed.waitForAll([acquired.jobId], 20_000)).get(acquired.jobId)).toBe('completed');
  expect(proxy.lostReplies).toBe(1);
  const job = (await bed.ops.queue.getJob(acquired.jobId))!;
  expect(job.attemptsMade).toBe(1);
  expect(recording.calls.filter((c) => c.op === 'acquire' && c.jobId === acquired.jobId && !c.end)).toHaveLength(1);
  // Nothing says it was superseded, or an error: it was not.
  const about = logged.lines.filter((line) => line.includes(acquired.jobId));
  expect(about.filter((line) => /superseded|"level":50/.test(line))).toEqual([]);
});
