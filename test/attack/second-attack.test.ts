import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { loadConfig } from '../../src/config.ts';
import { DaytonaFake } from '../../src/fakes/daytona-fake.ts';
import { laneIdOf, type LeaseIdentity } from '../../src/lease.ts';
import { LeaseRecords } from '../../src/queues/lease-records.ts';
import { createDaytonaProvider } from '../../src/providers/daytona/index.ts';
import { OperationsQueue } from '../../src/queues/operations-queue.ts';
import { createRedis } from '../../src/queues/redis.ts';
import { bedFor, gate, lease, QUICK_RECOVERY, readUntil, TestBed, workerEnv, type Finished } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';
import { TcpProxy } from '../helpers/tcp-proxy.ts';
import { type WorkerProcess, workerFor } from '../helpers/worker-process.ts';

// What the second, independent attack on issue 11's changes found (docs/design.md lists it),
// each as the attack ran it, against real processes, a real Redis and the cloud fake.

const SKEWED_CLOCK = fileURLToPath(new URL('../helpers/skewed-clock.mjs', import.meta.url));
const daytonaLease = (leaseId: string): LeaseIdentity => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });
const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };

/** A Daytona fake, closed when the test ends (tests with their own run at once). */
async function cloud(finished: Finished, timings: Partial<{ create: number; start: number; stop: number; forceStop: number; destroy: number }> = {}): Promise<{ fake: DaytonaFake; url: string }> {
  const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 10, stop: 10, forceStop: 0, destroy: 10, ...timings } });
  const url = await fake.listen();
  finished(() => fake.close());
  return { fake, url };
}

/** A worker process on that fake, killed (paused or not) when the test ends. */
function worker(finished: Finished, bed: TestBed, url: string, env: Record<string, string> = {}): WorkerProcess {
  return workerFor(finished, workerEnv(bed, { ...QUICK_RECOVERY, LEASE_OPS_PROVIDERS: 'daytona', DAYTONA_API_URL: url, DAYTONA_API_KEY: 'k', ...env }));
}

describe.concurrent('a stale attempt never cleans up after an acquire that its successor completed', () => {
  it('frozen past its lock and its deadline, it wakes after the re-run handed the sandbox out: the sandbox stays', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished, { LEASE_OPS_KEEP_COMPLETED_S: '0' });
    const { fake, url } = await cloud(onTestFinished);
    const env = { LEASE_OPS_KEEP_COMPLETED_S: '0' };
    const frozen = worker(onTestFinished, bed, url, { ...env, LEASE_OPS_FAULT_POINTS: 'after-lane-acquire=pause*1' });
    await frozen.ready;
    // The acquire's own end (any other job's, such as a clean-up's, is not the re-run's): its
    // deadline must leave the successor time to start and complete it, and under load 6 s did
    // not (the acquire failed deadline_exceeded, and a clean-up's end was taken for it).
    const DEADLINE_MS = 10_000;
    // (It cannot end before its id is known: its first attempt stops before any provider call.)
    let acquireId = '';
    const completed = new Promise<{ providerLeaseId: string }>((resolve, reject) => {
      bed.events.on('completed', ({ jobId: id, returnvalue }) => id === acquireId && resolve((typeof returnvalue === 'string' ? JSON.parse(returnvalue) : returnvalue) as { providerLeaseId: string }));
      bed.events.on('failed', ({ jobId: id, failedReason }) => id === acquireId && reject(new Error(`the re-run did not complete: ${failedReason}`)));
    });
    completed.catch(() => undefined); // awaited below
    const startedAt = Date.now();
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('handed-out'), params: { runId: 'r' }, deadlineMs: DEADLINE_MS });
    acquireId = jobId;
    await frozen.waitForLog('fault point after-lane-acquire: pause');
    worker(onTestFinished, bed, url, env); // the successor
    const { providerLeaseId } = await completed; // the re-run; BullMQ removes the job as it completes
    // The acquire's deadline passing.
    await new Promise((r) => setTimeout(r, Math.max(0, startedAt + DEADLINE_MS + 500 - Date.now())));
    frozen.child.kill('SIGCONT');
    // It wakes, and says what it does with the acquire: refuses as stale, or queues a clean-up.
    await readUntil(async () => frozen.logs.some((l) => l.includes(jobId) && /stale attempt|clean-up of what it made is queued/.test(l)), 10_000, 'the frozen attempt deciding');
    await readUntil(async () => (await bed.ops.lanes.openLaneCount()) === 0, 10_000, 'every lane idle');
    expect(fake.calls.filter((c) => c.sandboxId === providerLeaseId && c.method === 'DELETE')).toEqual([]);
    expect(fake.stateOf(providerLeaseId)).toBe('started');
  });
});

describe.concurrent('an acquire frozen after its provider call wakes after its re-run completed', () => {
  it('it notes nothing on the lease, says so, and the sandbox the re-run handed out stays the lease\'s', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished, { LEASE_OPS_KEEP_COMPLETED_S: '600' });
    const { fake, url } = await cloud(onTestFinished);
    const frozen = worker(onTestFinished, bed, url, { LEASE_OPS_FAULT_POINTS: 'after-provider-call=pause*1' });
    await frozen.ready;
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('frozen-after-call'), params: { runId: 'r' } });
    await frozen.waitForLog('fault point after-provider-call: pause');
    worker(onTestFinished, bed, url); // the successor re-runs it once the frozen one's lock lapsed
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('completed');
    const sandbox = ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    frozen.child.kill('SIGCONT');
    await frozen.waitForLog('the sandbox it acquired is not noted', 15_000);
    const view = await new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX).acquiredLive(await bed.ops.names.resolve(laneIdOf(daytonaLease('frozen-after-call'))));
    expect(view).toEqual({ sandbox, by: jobId });
    expect(fake.stateOf(sandbox)).toBe('started');
  });
});

describe.concurrent('a lane push whose reply is lost (the link cut after Redis ran it): the client sends it again, and the job is in its lane once', () => {
  const pushes = [
    { op: 'resume' as const, key: undefined },
    { op: 'stop' as const, key: undefined },
    { op: 'resume' as const, key: 'K' },
  ];
  it.for(pushes)('%o', async ({ op, key }, { onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const proxy = await TcpProxy.start(Number(new URL(bed.config.REDIS_URL).port || 6379));
    onTestFinished(() => proxy.close());
    const ops = new OperationsQueue(createRedis(proxy.url), bed.config);
    onTestFinished(() => ops.close());
    const companyId = `lost-reply-${op}-${key ?? 'nokey'}`;
    const identity: LeaseIdentity = { provider: 'test', companyId, environmentId: 'env', leaseId: 'sb-1' };
    // The push's arguments hold its position ('tail') and then the lease's company.
    proxy.loseNextReplyTo(new RegExp(`\\$4\\r\\ntail\\r\\n[\\s\\S]*${companyId}`));
    const enqueued = await ops.enqueueHere({ op, lease: identity, params: { providerLeaseId: 'sb-1' }, ...(key ? { idempotencyKey: key } : {}) });
    expect(proxy.lostReplies).toBe(1);
    expect(enqueued).toMatchObject({ joinedHere: true });
    expect(enqueued.deduplicated).toBeUndefined();
    expect((await bed.ops.lanes.view(enqueued.laneId)).jobs).toEqual([enqueued.jobId]);
    expect(await bed.ops.queue.getJob(enqueued.jobId)).toBeDefined();
    const accepted = (await bed.ops.history.read(enqueued.laneId)).filter((e) => e.kind === 'accepted');
    expect(accepted.map((e) => e.jobId)).toEqual([enqueued.jobId]);
  });
  it.for([{ key: undefined }, { key: 'K2' }])('a stop absorbed by the identical stop queued before it, %o: absorbed once, answered coalesced (helper-30)', async ({ key }, { onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const proxy = await TcpProxy.start(Number(new URL(bed.config.REDIS_URL).port || 6379));
    onTestFinished(() => proxy.close());
    const ops = new OperationsQueue(createRedis(proxy.url), bed.config);
    onTestFinished(() => ops.close());
    const companyId = `absorb-lost-${key ?? 'nokey'}`;
    const identity: LeaseIdentity = { provider: 'test', companyId, environmentId: 'env', leaseId: 'sb-1' };
    await bed.ops.enqueue({ op: 'resume', lease: identity, params: { providerLeaseId: 'sb-1', leaseMetadata: {} } });
    const first = await bed.ops.enqueue({ op: 'stop', lease: identity, params: { providerLeaseId: 'sb-1' } });
    proxy.loseNextReplyTo(new RegExp(`\\$4\\r\\ntail\\r\\n[\\s\\S]*${companyId}`));
    const second = await ops.enqueue({ op: 'stop', lease: identity, params: { providerLeaseId: 'sb-1' }, ...(key ? { idempotencyKey: key } : {}) });
    expect(proxy.lostReplies).toBe(1);
    expect(second).toMatchObject({ jobId: first.jobId, deduplicated: 'coalesced' });
    expect((await bed.ops.history.read(first.laneId)).filter((e) => e.kind === 'absorbed')).toHaveLength(1);
  });
});

describe.concurrent('two requests with one idempotency key put their job into its lane once', () => {
  it('a retry while the first request is slow between its key and its job: one resume, run once, before the stop accepted after it', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const slow = new OperationsQueue(createRedis(bed.config.REDIS_URL), bed.config);
    onTestFinished(() => slow.close());
    // The first request pauses between storing its key and storing its job (a GC pause, a slow link).
    const add = slow.queue.add.bind(slow.queue);
    const paused = gate();
    const resumeFirst = gate();
    slow.queue.add = (async (...args: Parameters<typeof add>) => {
      paused.open();
      await resumeFirst.promise;
      return add(...args);
    }) as typeof add;
    const request = { op: 'resume' as const, lease: lease('twice'), params: { providerLeaseId: 'twice' }, idempotencyKey: 'K' };
    const first = slow.enqueue(request);
    await paused.promise;
    const retry = await bed.ops.enqueue(request);
    const stop = await bed.ops.enqueue({ op: 'stop', lease: lease('twice'), params: { providerLeaseId: 'twice' } });
    resumeFirst.open();
    expect((await first).jobId).toBe(retry.jobId);
    expect((await bed.ops.lanes.view(retry.laneId)).jobs).toEqual([retry.jobId, stop.jobId]);
    const { provider, calls } = createRecordingProvider();
    await bed.startWorker(provider);
    await bed.waitForAll([retry.jobId, stop.jobId]);
    expect(calls.filter((c) => c.end).map((c) => c.op)).toEqual(['resume', 'stop']);
  });
});

describe.concurrent('a force-stop that absorbs a queued stop keeps both callers\' times', () => {
  it('one with an earlier deadline than the stop\'s is queued on its own, fails at its deadline, and the stop is unharmed', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const held = gate();
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ op }) => (op === 'resume' ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
    onTestFinished(() => held.open());
    const resume = await bed.ops.enqueue({ op: 'resume', lease: lease('absorb'), params: { providerLeaseId: 'absorb' } });
    await readUntil(async () => (await bed.ops.queue.getJobState(resume.jobId)) === 'active', 5_000, 'the resume running');
    const stop = await bed.ops.enqueue({ op: 'stop', lease: lease('absorb'), params: { providerLeaseId: 'absorb' } });
    const enqueuedAt = Date.now();
    const force = await bed.ops.enqueue({ op: 'force-stop', lease: lease('absorb'), params: { providerLeaseId: 'absorb' }, deadlineMs: 1_000 });
    expect(force.deduplicated).toBeUndefined();
    expect((await bed.waitForAll([force.jobId], 5_000)).get(force.jobId)).toBe('failed');
    expect(Date.now() - enqueuedAt).toBeLessThan(2_500);
    held.open();
    expect((await bed.waitForAll([resume.jobId, stop.jobId])).get(stop.jobId)).toBe('completed');
  });
});

describe.concurrent('an idempotent force-stop that absorbed a stop is accepted in the same step', () => {
  it('its enqueue cut short right after (the key never marked by a separate write): the retry gets the same job, no second force-stop', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    // A paused lane keeps the stop parked at its head, where a force-stop absorbs it.
    const laneId = await bed.ops.laneOf(lease('cut'));
    await bed.ops.lanes.pause(laneId, 'test', Date.now(), lease('cut'));
    const stop = await bed.ops.enqueue({ op: 'stop', lease: lease('cut'), params: { providerLeaseId: 'cut' } });
    // A producer whose connection is lost for any write it sends after the lane step.
    const connection = createRedis(bed.config.REDIS_URL);
    const cut = new OperationsQueue(connection, bed.config);
    onTestFinished(() => cut.close());
    const set = connection.set.bind(connection) as (...args: unknown[]) => Promise<unknown>;
    (connection as unknown as { set: (...args: unknown[]) => Promise<unknown> }).set = (...args: unknown[]) => (args.includes('KEEPTTL') ? Promise.reject(new Error('connection lost')) : set(...args));
    const request = { op: 'force-stop' as const, lease: lease('cut'), params: { providerLeaseId: 'cut' }, idempotencyKey: 'F' };
    await cut.enqueue(request).catch(() => undefined);
    const retry = await bed.ops.enqueue(request);
    expect(retry.jobId).toBe(stop.jobId);
    expect((await bed.ops.lanes.view(laneId)).jobs).toEqual([stop.jobId]);
    expect((await bed.ops.queue.getJob(stop.jobId))?.name).toBe('force-stop');
  });
});

describe.concurrent('replicas whose clocks differ agree on how long a sandbox has been stopping', () => {
  it('a stop recorded by a replica 20 s behind is not forced early by one with the right clock', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const { fake, url } = await cloud(onTestFinished, { stop: 2_500 });
    const settings = { LEASE_OPS_STUCK_STOPPING_MS: '4000', LEASE_OPS_WATCHDOG_INTERVAL_MS: '200' };
    const behind = worker(onTestFinished, bed, url, { ...settings, NODE_OPTIONS: `--import ${SKEWED_CLOCK}`, CLOCK_SKEW_MS: '-20000' });
    await behind.ready;
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('skew'), params: { runId: 'skew' } });
    await bed.waitForAll([acquired.jobId]);
    const id = ((await bed.ops.queue.getJob(acquired.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(id), params: { providerLeaseId: id } });
    await readUntil(async () => (await bed.redis.hget(`${bed.config.LEASE_OPS_PREFIX}:lease:${stop.laneId}`, 'providerState')) === 'stopping', 5_000, 'the stop seen stopping');
    const rightClock = worker(onTestFinished, bed, url, settings);
    await rightClock.ready;
    expect((await bed.waitForAll([stop.jobId], 10_000)).get(stop.jobId)).toBe('completed');
    expect(fake.calls.filter((c) => c.sandboxId === id && c.query.includes('force=true'))).toEqual([]);
  });
});

describe.concurrent('a request that may still be running at the cloud keeps the lane a while', () => {
  it('a read that times out at its operation\'s deadline: the next operation\'s calls wait, and none overlaps it', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished, { LEASE_OPS_INFLIGHT_GRACE_MS: '2000' });
    const { fake, url } = await cloud(onTestFinished);
    await bed.startWorker(createDaytonaProvider({ apiUrl: url, apiKey: 'k', rateLimits: unpaced }));
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('slow-cloud'), params: { runId: 'slow' } });
    await bed.waitForAll([acquired.jobId]);
    const id = ((await bed.ops.queue.getJob(acquired.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    fake.control(id, { replyDelayMs: 1_500 }); // a congested API: every answer about it takes 1.5 s
    const resume = await bed.ops.enqueue({ op: 'resume', lease: daytonaLease(id), params: { providerLeaseId: id }, deadlineMs: 800 });
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(id), params: { providerLeaseId: id } });
    expect((await bed.waitForAll([resume.jobId], 10_000)).get(resume.jobId)).toBe('failed');
    fake.control(id, { replyDelayMs: 0 });
    expect((await bed.waitForAll([stop.jobId], 10_000)).get(stop.jobId)).toBe('completed');
    await readUntil(async () => fake.http.inFlight === 0, 5_000, 'every request answered'); // the log is complete
    expect(fake.calls.filter((c) => c.sandboxId === id && c.method === 'GET').length).toBeGreaterThan(1);
    expect(fake.http.overlaps()).toEqual([]);
  });
});

describe.concurrent('the stall bound the README states', () => {
  it('a crashed worker\'s job runs again within LEASE_OPS_LOCK_MS + 2 x LEASE_OPS_STALLED_INTERVAL_MS: 40 s by default', () => {
    const defaults = loadConfig({});
    expect(defaults.LEASE_OPS_LOCK_MS + 2 * defaults.LEASE_OPS_STALLED_INTERVAL_MS).toBe(40_000);
  });
});
