import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../../src/fakes/daytona-fake.ts';
import { laneIdOf, type LeaseIdentity } from '../../src/lease.ts';
import { createLogger } from '../../src/logger.ts';
import { createDaytonaProvider } from '../../src/providers/daytona/index.ts';
import { ProviderRegistry } from '../../src/providers/registry.ts';
import type { LeaseProvider, SandboxState } from '../../src/providers/types.ts';
import { LeaseHistory } from '../../src/queues/lease-history.ts';
import { leaseRecordKey, LeaseRecords } from '../../src/queues/lease-records.ts';
import { registry } from '../../src/metrics.ts';
import { OperationsQueue } from '../../src/queues/operations-queue.ts';
import { LeaseOpsClient } from '../../src/client.ts';
import { Watchdog } from '../../src/queues/watchdog.ts';
import { bedFor, gate, lease, QUICK_RECOVERY, readUntil, TestBed, workerEnv } from '../helpers/env.ts';
import { workerFor } from '../helpers/worker-process.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

describe('scenario 14: a queued operation whose deadline passes while it waits fails at its deadline', () => {
  let bed: TestBed;
  const held = gate();
  beforeAll(async () => {
    bed = await TestBed.create();
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ op }) => (op === 'stop' ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
  });
  afterAll(async () => {
    held.open();
    await bed.close();
  });

  it('a resume behind a stop that runs for long: its caller hears "failed" at its deadline, not when the stop ends', async () => {
    await bed.ops.enqueue({ op: 'stop', lease: lease('slow-head'), params: { providerLeaseId: 'slow-head' } });
    const enqueuedAt = Date.now();
    const resume = await bed.ops.enqueue({ op: 'resume', lease: lease('slow-head'), params: { providerLeaseId: 'slow-head' }, deadlineMs: 1_500 });
    expect((await bed.waitForAll([resume.jobId], 10_000)).get(resume.jobId)).toBe('failed');
    const waited = Date.now() - enqueuedAt;
    expect(waited).toBeGreaterThanOrEqual(1_400);
    expect(waited).toBeLessThan(3_500);
    expect((await bed.ops.queue.getJob(resume.jobId))!.failedReason).toBe('deadline_exceeded: the deadline passed while it waited in its lane');
    // It left its lane: the stop is alone there, still running.
    expect((await bed.ops.lanes.view(resume.laneId)).jobs).toHaveLength(1);
  });
});

/** A Daytona fake and an in-process worker that watches for stuck stops: stuck after `STUCK_MS`. */
const STUCK_MS = 1_000;
async function daytonaBed(overrides: Record<string, string>, { forceStopMs = 0, more = [] as LeaseProvider[] } = {}): Promise<{ bed: TestBed; fake: DaytonaFake }> {
  const bed = await TestBed.create({ LEASE_OPS_STUCK_STOPPING_MS: String(STUCK_MS), LEASE_OPS_BACKOFF_BASE_MS: '50', LEASE_OPS_BACKOFF_CAP_MS: '300', ...overrides });
  const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 20, stop: 20, forceStop: forceStopMs, destroy: 10 } });
  const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
  await bed.startWorker(createDaytonaProvider({ apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced }), ...more);
  return { bed, fake };
}

const daytonaLease = (leaseId: string): LeaseIdentity => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });

async function startedSandbox(bed: TestBed, name: string): Promise<string> {
  const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease(name), params: { runId: name } });
  expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
  return ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
}

/** A graceful stop, then a resume queued behind it: how long from the stop's enqueue to the resume's end. */
async function stopThenResume(bed: TestBed, id: string): Promise<{ ms: number; states: string[] }> {
  const startedAt = Date.now();
  const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(id), params: { providerLeaseId: id } });
  const resume = await bed.ops.enqueue({ op: 'resume', lease: daytonaLease(id), params: { providerLeaseId: id } });
  const states = await bed.waitForAll([stop.jobId, resume.jobId], 60_000);
  return { ms: Date.now() - startedAt, states: [states.get(stop.jobId)!, states.get(resume.jobId)!] };
}

const forced = (fake: DaytonaFake, id: string) => fake.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/stop') && c.query.includes('force=true'));

describe('scenarios 11 and 15: every stuck stop is forced when its budget ends, the second of a lease too', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  beforeAll(async () => {
    // The periodic scan is out of the picture: each episode's own check must do it.
    ({ bed, fake } = await daytonaBed({ LEASE_OPS_WATCHDOG_INTERVAL_MS: '600000' }));
  });
  afterAll(async () => {
    await bed.close();
    await fake.close();
  });

  it('two stuck stops of one sandbox in a row: each forced, each resume done within the budget + 1.5 s', async () => {
    const id = await startedSandbox(bed, 'twice');
    for (const round of [1, 2]) {
      fake.control(id, { stuckStoppingMs: 600_000 }); // a process that ignores SIGTERM
      const { ms, states } = await stopThenResume(bed, id);
      expect(states).toEqual(['completed', 'completed']);
      expect(ms).toBeLessThan(STUCK_MS + 1_500);
      expect(forced(fake, id)).toHaveLength(round);
      expect(fake.stateOf(id)).toBe('started');
    }
    expect(fake.http.overlaps()).toEqual([]);
  });
});

describe('a force that takes time to stop the sandbox is sent once, then waited for', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  beforeAll(async () => {
    ({ bed, fake } = await daytonaBed({ LEASE_OPS_WATCHDOG_INTERVAL_MS: '600000' }, { forceStopMs: 600 }));
  });
  afterAll(async () => {
    await bed.close();
    await fake.close();
  });

  it('its retries read the sandbox until it stopped; none sends the force again (which would start it over)', async () => {
    const id = await startedSandbox(bed, 'slow-force');
    fake.control(id, { stuckStoppingMs: 600_000 });
    const { states } = await stopThenResume(bed, id);
    expect(states).toEqual(['completed', 'completed']);
    expect(forced(fake, id)).toHaveLength(1);
  });
});

describe('scenario 12: sandboxes stuck for good never hide a newly stuck one', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  // A provider that cannot force a stop: its stuck sandboxes stay stuck for good.
  const noForce: LeaseProvider = { ...createRecordingProvider({ name: 'noforce' }).provider, capabilities: { stop: true, pause: false, forceStop: false } };
  beforeAll(async () => {
    ({ bed, fake } = await daytonaBed({ LEASE_OPS_WATCHDOG_INTERVAL_MS: '200' }, { more: [noForce] }));
  });
  afterAll(async () => {
    await bed.close();
    await fake.close();
  });

  it('with 600 sandboxes stuck for good, a newly stuck one is forced on time, and one scan looks at all 601', async () => {
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    const stuck: SandboxState = { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' };
    for (let i = 0; i < 600; i++) {
      const identity = { provider: 'noforce', companyId: 'co', environmentId: 'env', leaseId: `stuck-${i}` };
      await records.observe(laneIdOf(identity), identity, identity.leaseId, stuck);
    }
    const id = await startedSandbox(bed, 'newly-stuck');
    fake.control(id, { stuckStoppingMs: 600_000 });
    const { ms, states } = await stopThenResume(bed, id);
    expect(states).toEqual(['completed', 'completed']);
    expect(ms).toBeLessThan(STUCK_MS + 1_500);
    expect(forced(fake, id)).toHaveLength(1);

    // The scan itself, a page of 100 at a time: one more lease stuck after the 600, the
    // newest, is still reached (one whose provider can force would be forced by the worker
    // meanwhile, and leave the index mid-scan: the worker's part is checked above).
    const newest = { provider: 'noforce', companyId: 'co', environmentId: 'env', leaseId: 'stuck-newest' };
    await records.observe(laneIdOf(newest), newest, newest.leaseId, stuck);
    // A watchdog of the test's own that counts a sandbox stuck at once.
    const watchdog = new Watchdog(bed.ops, records, new ProviderRegistry([noForce]), { stuckAfterMs: 0, maxForceStops: 5 }, createLogger({ level: 'silent' }));
    const report = await watchdog.scan(100);
    expect(report.inspected).toBe(601);
    expect(report.unsupported).toBe(601);
  });
});

describe('scenario 13: the watchdog never calls a sandbox itself; no two calls to one sandbox overlap, reads included', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  beforeAll(async () => {
    ({ bed, fake } = await daytonaBed({ LEASE_OPS_WATCHDOG_INTERVAL_MS: '100' }));
  });
  afterAll(async () => {
    await bed.close();
    await fake.close();
  });

  it('a stuck sandbox whose every reply takes 150 ms: forced once, resumed, and its calls one at a time', async () => {
    const id = await startedSandbox(bed, 'slow-replies');
    fake.control(id, { stuckStoppingMs: 600_000, replyDelayMs: 150 });
    const before = fake.calls.length;
    const { states } = await stopThenResume(bed, id);
    expect(states).toEqual(['completed', 'completed']);
    expect(forced(fake, id)).toHaveLength(1);
    expect(fake.calls.length - before).toBeGreaterThan(5); // the stop's reads while it was stuck, the force, the resume
    expect(fake.http.overlaps()).toEqual([]);
  });
});

describe("the watchdog's decision and what it counts are one step: a force-stop that ended as the watchdog read is not followed by another", () => {
  let bed: TestBed;
  // A provider that can force a stop; the watchdog itself never calls it.
  const forcer: LeaseProvider = { ...createRecordingProvider({ name: 'forcer' }).provider, capabilities: { stop: true, pause: false, forceStop: true } };
  beforeAll(async () => {
    bed = await TestBed.create(); // no worker: the test plays the lane's side
  });
  afterAll(async () => {
    await bed.close();
  });

  /** The watchdog's stuck-stopping observations of this provider, as /metrics counts them. */
  const stuckCount = async () => Number(/^lease_ops_stuck_stopping_seconds_count\{provider="forcer"\} (\d+)$/m.exec(await registry.metrics())?.[1] ?? 0);

  it('the record moves on (the first force-stop saw the sandbox stopped) between the watchdog reading it and queueing: nothing is queued, noted or counted', async () => {
    const identity: LeaseIdentity = { provider: 'forcer', companyId: 'co', environmentId: 'env', leaseId: 'ended-as-read' };
    const laneId = laneIdOf(identity);
    const stopping: SandboxState = { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' };
    // The episode's first force-stop was queued, and its job has ended (it is no more: unknown).
    let moveOn = true;
    class RecordsRacedByTheLane extends LeaseRecords {
      override async get(id: string) {
        const read = await super.get(id);
        // What the first force-stop's end writes, landing just after the watchdog's read.
        if (moveOn) {
          moveOn = false;
          await this.observe(laneId, identity, identity.leaseId, { kind: 'stopped', providerState: 'stopped' });
        }
        return read;
      }
    }
    const records = new RecordsRacedByTheLane(bed.redis, bed.config.LEASE_OPS_PREFIX);
    const { since } = (await records.observe(laneId, identity, identity.leaseId, stopping))!;
    await bed.redis.hset(leaseRecordKey(bed.config.LEASE_OPS_PREFIX, laneId), 'forceStops', '1', 'forceJob', 'a-force-stop-that-ended');
    expect((await new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX).get(laneId))?.since).toBe(since);

    const counted = await stuckCount();
    const watchdog = new Watchdog(bed.ops, records, new ProviderRegistry([forcer]), { stuckAfterMs: 0, maxForceStops: 5 }, createLogger({ level: 'silent' }));
    const report = await watchdog.consider(laneId);

    const history = new LeaseHistory(bed.redis, bed.config.LEASE_OPS_PREFIX);
    expect((await history.read(laneId)).filter((e) => e.kind === 'stuck')).toEqual([]);
    expect((await bed.ops.lanes.view(laneId)).jobs).toEqual([]);
    expect(report.queued).toBe(0);
    expect(await stuckCount()).toBe(counted);
  });
  it('a record that still shows the sandbox stuck: one force-stop queued, one note, one count, however often it is considered', async () => {
    const identity: LeaseIdentity = { provider: 'forcer', companyId: 'co', environmentId: 'env', leaseId: 'still-stuck' };
    const laneId = laneIdOf(identity);
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    await records.observe(laneId, identity, identity.leaseId, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' });
    const counted = await stuckCount();
    const watchdog = new Watchdog(bed.ops, records, new ProviderRegistry([forcer]), { stuckAfterMs: 0, maxForceStops: 5 }, createLogger({ level: 'silent' }));
    // The episode's own check and a scan at once, then again: its force-stop waits in the lane.
    const reports = await Promise.all([watchdog.consider(laneId), watchdog.consider(laneId), watchdog.scan()]);
    await watchdog.consider(laneId);
    expect(reports.reduce((n, r) => n + r.queued, 0)).toBe(1);
    const stuck = (await new LeaseHistory(bed.redis, bed.config.LEASE_OPS_PREFIX).read(laneId)).filter((e) => e.kind === 'stuck');
    expect(stuck.map((e) => e.message)).toEqual([expect.stringMatching(/force-stop 1 of at most 5 queued$/)]);
    const lane = (await bed.ops.lanes.view(laneId)).jobs;
    expect(lane).toEqual([stuck[0]!.jobId]);
    expect(await records.get(laneId)).toMatchObject({ forceStops: 1, forceJob: stuck[0]!.jobId });
    expect(await stuckCount()).toBe(counted + 1);
  });
  /** A watchdog of its own, as another replica would run it, and a gate inside its enqueue. */
  function replica(stuckAfterMs = 0, maxPerLease?: string) {
    const ops = new OperationsQueue(bed.redis, maxPerLease ? { ...bed.config, LEASE_OPS_MAX_QUEUED_PER_LEASE: Number(maxPerLease) } : bed.config);
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    const watchdog = new Watchdog(ops, records, new ProviderRegistry([forcer]), { stuckAfterMs, maxForceStops: 5 }, createLogger({ level: 'silent' }));
    const entered = gate();
    const held = gate();
    let holding = false;
    const add = ops.queue.add.bind(ops.queue);
    /** Holds its next enqueue where the job is stored: after its claim, before its lane. */
    const holdNextAdd = () => {
      holding = true;
    };
    ops.queue.add = (async (...args: Parameters<typeof add>) => {
      if (holding) {
        holding = false;
        entered.open();
        await held.promise;
      }
      return add(...args);
    }) as typeof ops.queue.add;
    return { ops, records, watchdog, entered: entered.promise, release: held.open, holdNextAdd };
  }
  const stuckLease = async (leaseId: string) => {
    const identity: LeaseIdentity = { provider: 'forcer', companyId: 'co', environmentId: 'env', leaseId };
    const laneId = laneIdOf(identity);
    const seen = await new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX).observe(laneId, identity, leaseId, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' });
    return { identity, laneId, since: seen!.since };
  };
  const stuckNotes = async (laneId: string) => (await new LeaseHistory(bed.redis, bed.config.LEASE_OPS_PREFIX).read(laneId)).filter((e) => e.kind === 'stuck');

  it('two replicas: one holds inside its enqueue after its claim, the other finishes that claim; then the first goes on: one job, one note, one count (helper-27)', async () => {
    const { laneId } = await stuckLease('two-replicas');
    const [a, b] = [replica(), replica()];
    const counted = await stuckCount();
    a.holdNextAdd();
    const first = a.watchdog.consider(laneId);
    await a.entered;
    const second = await b.watchdog.consider(laneId);
    a.release();
    const reports = [await first, second];
    expect(reports.map((r) => r.queued)).toEqual([0, 1]);
    const notes = await stuckNotes(laneId);
    expect(notes).toHaveLength(1);
    expect((await bed.ops.lanes.view(laneId)).jobs).toEqual([notes[0]!.jobId]);
    expect(await stuckCount()).toBe(counted + 1);
  });

  it('a claim whose episode ends (stopped, started, stopping again) before its force-stop joins the lane: nothing queued, noted or counted; the new episode gets its own (helper-27)', async () => {
    const { identity, laneId, since } = await stuckLease('episode-ends');
    const [a, b] = [replica(), replica(60_000)];
    const counted = await stuckCount();
    a.holdNextAdd();
    const first = a.watchdog.consider(laneId);
    await a.entered;
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    await records.observe(laneId, identity, identity.leaseId, { kind: 'stopped', providerState: 'stopped' });
    await records.observe(laneId, identity, identity.leaseId, { kind: 'running' });
    const again = (await records.observe(laneId, identity, identity.leaseId, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' }))!.since;
    expect(again).not.toBe(since);
    // The new episode is not stuck yet for a watchdog with a minute's budget: it queues nothing.
    expect((await b.watchdog.consider(laneId)).queued).toBe(0);
    a.release();
    expect((await first).queued).toBe(0);
    expect(await stuckNotes(laneId)).toEqual([]);
    expect((await bed.ops.lanes.view(laneId)).jobs).toEqual([]);
    expect(await stuckCount()).toBe(counted);
    expect(await records.get(laneId)).toMatchObject({ since: again, forceStops: 0, forceJob: null });
    // Once the new episode is stuck, its force-stop is its own.
    expect((await replica().watchdog.consider(laneId)).queued).toBe(1);
    const notes = await stuckNotes(laneId);
    expect(notes).toHaveLength(1);
    const job = await bed.ops.queue.getJob(notes[0]!.jobId!);
    expect(job?.data.params).toEqual({ providerLeaseId: identity.leaseId, ifStoppingSince: again });
  });

  it("a record whose sandbox has a lane of its own: a claim whose episode ends before its force-stop joins the sandbox's lane queues nothing there (helper-28)", async () => {
    // The record of lane "acquired-as" shows sandbox "own-lane-sandbox", which is no name of it.
    const identity: LeaseIdentity = { provider: 'forcer', companyId: 'co', environmentId: 'env', leaseId: 'acquired-as' };
    const laneId = laneIdOf(identity);
    const sandbox = 'own-lane-sandbox';
    const sandboxLane = laneIdOf({ ...identity, leaseId: sandbox });
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    await records.observe(laneId, identity, sandbox, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' });
    const a = replica();
    a.holdNextAdd();
    const first = a.watchdog.consider(laneId);
    await a.entered;
    await records.observe(laneId, identity, sandbox, { kind: 'stopped', providerState: 'stopped' });
    await records.observe(laneId, identity, sandbox, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' });
    a.release();
    expect((await first).queued).toBe(0);
    expect((await bed.ops.lanes.view(sandboxLane)).jobs).toEqual([]);
    expect(await stuckNotes(sandboxLane)).toEqual([]);
    // The new episode's own force-stop joins the sandbox's lane, and the record keeps its job.
    expect((await replica().watchdog.consider(laneId)).queued).toBe(1);
    const [queued] = (await bed.ops.lanes.view(sandboxLane)).jobs;
    expect(await records.get(laneId)).toMatchObject({ forceStops: 1, forceJob: queued });
  });

  it("a force-stop its lane refuses (the lease's limit) is given back and logged, and the scan goes on to the next stuck lease (helper-27)", async () => {
    const full = await stuckLease('full-lane');
    const next = await stuckLease('after-full-lane');
    // An operator's force-stop waits at the front of the first lease's lane: with one operation
    // a lease, there is no room for the watchdog's.
    const limited = replica(0, '1');
    await limited.ops.enqueue({ op: 'force-stop', lease: full.identity, params: { providerLeaseId: full.identity.leaseId } });
    const counted = await stuckCount();
    const report = await limited.watchdog.scan();
    expect(report).toMatchObject({ refused: 1, queued: 1 });
    expect(await limited.records.get(full.laneId)).toMatchObject({ forceStops: 0, forceJob: null });
    expect(await stuckNotes(full.laneId)).toEqual([]);
    expect(await stuckNotes(next.laneId)).toHaveLength(1);
    expect(await limited.records.get(next.laneId)).toMatchObject({ forceStops: 1 });
    expect(await stuckCount()).toBe(counted + 1);
  });

  it('its force-stop removed by an operator before it joined its lane: the next check keeps that job on the record, and once it is gone claims the next (helper-28)', async () => {
    const { laneId } = await stuckLease('removed-before-lane');
    const a = replica();
    const push = a.ops.lanes.push.bind(a.ops.lanes);
    a.ops.lanes.push = (async (...args: Parameters<typeof push>) => {
      a.ops.lanes.push = push;
      await a.ops.queue.remove(args[1]);
      return push(...args);
    }) as typeof push;
    const first = await a.watchdog.consider(laneId);
    expect(first.queued).toBe(0);
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    const removed = (await records.get(laneId))!.forceJob;
    expect(removed).not.toBeNull();
    expect(await bed.ops.queue.getJob(removed!)).toBeUndefined();
    // The next check sees that job gone (ended) and queues force-stop 2.
    expect((await replica().watchdog.consider(laneId)).queued).toBe(1);
    expect((await stuckNotes(laneId)).map((e) => e.message)).toEqual([expect.stringMatching(/force-stop 2 of at most 5 queued$/)]);
    expect(await records.get(laneId)).toMatchObject({ forceStops: 2 });
  });

  it("refuses a caller's idempotency key under lease-ops: (the watchdog's keys), before anything is stored (helper-28)", async () => {
    const { identity, since } = await stuckLease('forged-key');
    const client = new LeaseOpsClient(bed.config);
    try {
      const forged = client.enqueue('force-stop', identity, { providerLeaseId: identity.leaseId, ifStoppingSince: since }, { idempotencyKey: `lease-ops:watchdog:${laneIdOf(identity)}:${since}:1` });
      await expect(forged).rejects.toMatchObject({ name: 'InvalidRequestError', code: 'invalid_request' });
      expect((await bed.ops.lanes.view(laneIdOf(identity))).jobs).toEqual([]);
    } finally {
      await client.close();
    }
  });

  it('a watchdog that failed between storing its force-stop and putting it into its lane: the next one puts that same job in, notes and counts it once (helper-27)', async () => {
    const { laneId } = await stuckLease('stored-not-joined');
    const a = replica();
    const push = a.ops.lanes.push.bind(a.ops.lanes);
    a.ops.lanes.push = (() => Promise.reject(new Error('connection lost'))) as typeof push;
    expect((await a.watchdog.consider(laneId)).refused).toBe(1);
    const stored = (await bed.ops.queue.getJobs(['delayed', 'wait'])).filter((j) => j?.data.lease.leaseId === 'stored-not-joined');
    expect(stored).toHaveLength(1);
    const counted = await stuckCount();
    const report = await replica().watchdog.consider(laneId);
    expect(report.queued).toBe(1);
    const notes = await stuckNotes(laneId);
    expect(notes.map((n) => n.jobId)).toEqual([stored[0]!.id]);
    expect(await stuckCount()).toBe(counted + 1);
  });
});

describe.concurrent('the watchdog killed at each step of queueing a force-stop: the next watchdog queues that same one, noted and forced once', () => {
  it.for(['watchdog-claimed', 'enqueue-after-key', 'watchdog-queued'])('killed at %s', async (point, { onTestFinished }) => {
    const bed = await bedFor(onTestFinished, { LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 20, stop: 20, forceStop: 0, destroy: 10 } });
    onTestFinished(() => fake.close());
    const env = workerEnv(bed, {
      ...QUICK_RECOVERY,
      LEASE_OPS_PROVIDERS: 'daytona',
      DAYTONA_API_URL: await fake.listen(),
      DAYTONA_API_KEY: 'k',
      LEASE_OPS_STUCK_STOPPING_MS: String(STUCK_MS),
      LEASE_OPS_WATCHDOG_INTERVAL_MS: '200',
    });
    const first = workerFor(onTestFinished, { ...env, LEASE_OPS_FAULT_POINTS: `${point}=kill*1` });
    await first.ready;
    const id = await startedSandbox(bed, `killed-at-${point}`);
    fake.control(id, { stuckStoppingMs: 600_000 });
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(id), params: { providerLeaseId: id }, deadlineMs: 60_000 });
    await first.waitForLog(`lease-ops fault point ${point}: kill`);
    await first.exited;
    const second = workerFor(onTestFinished, env);
    expect((await bed.waitForAll([stop.jobId], 30_000)).get(stop.jobId)).toBe('completed');
    await second.ready;
    // The sandbox's id is a second name of the lease's lane (its acquire's).
    const laneId = await bed.ops.names.resolve(laneIdOf(daytonaLease(id)));
    const stuck = (await new LeaseHistory(bed.redis, bed.config.LEASE_OPS_PREFIX).read(laneId)).filter((e) => e.kind === 'stuck');
    expect(stuck.map((e) => e.message)).toEqual([expect.stringMatching(/force-stop 1 of at most \d+ queued$/)]);
    expect(forced(fake, id)).toHaveLength(1);
    expect(fake.stateOf(id)).toBe('stopped');
  });
});
