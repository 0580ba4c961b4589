import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { gate, lease, readUntil, TestBed } from '../helpers/env.ts';
import { createRecordingProvider, type CallRecord } from '../helpers/recording-provider.ts';

/**
 * An enqueue stores its job in BullMQ first and puts it in its lane in a second step. An
 * operator who removes the job in between (Bull Board, `queue.remove`) must not leave its id
 * in the lane: a lane naming a job that does not exist waits on it, and the lease's later
 * operations with it.
 */
describe('a job removed between its BullMQ add and its lane push', () => {
  let bed: TestBed;
  const held = gate();
  let removeNextAdd: (jobId: string) => boolean = () => false;
  beforeAll(async () => {
    bed = await TestBed.create();
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ op }) => (op === 'stop' ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
    // The operator's removal lands exactly in the window: right after BullMQ stored the job.
    const add = bed.ops.queue.add.bind(bed.ops.queue);
    bed.ops.queue.add = (async (...args: Parameters<typeof add>) => {
      const job = await add(...args);
      if (job.id && removeNextAdd(job.id)) {
        removeNextAdd = () => false;
        expect(await bed.ops.queue.remove(job.id)).toBe(1);
      }
      return job;
    }) as typeof add;
  });
  afterAll(async () => {
    held.open();
    await bed.close();
  });

  const jobHashExists = (jobId: string) => bed.redis.exists(`${bed.config.LEASE_OPS_PREFIX}:${bed.config.LEASE_OPS_QUEUE}:${jobId}`);

  it('behind a running operation: the lane never names it, and the operation after it runs when the head ends', async () => {
    const running = new Promise<void>((resolve) => bed.events.once('active', () => resolve()));
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('behind'), params: { providerLeaseId: 'behind' } });
    await running;
    removeNextAdd = () => true;
    const removed = await bed.ops.enqueue({ op: 'resume', lease: lease('behind'), params: { providerLeaseId: 'behind' } });
    expect(await jobHashExists(removed.jobId)).toBe(0);
    expect((await bed.ops.lanes.view(head.laneId)).jobs).toEqual([head.jobId]);
    const after = await bed.ops.enqueue({ op: 'destroy', lease: lease('behind'), params: { providerLeaseId: 'behind' } });
    held.open();
    expect(Object.fromEntries(await bed.waitForAll([head.jobId, after.jobId], 10_000))).toEqual({ [head.jobId]: 'completed', [after.jobId]: 'completed' });
    expect(await jobHashExists(removed.jobId)).toBe(0);
    const history = await bed.ops.history.read(head.laneId);
    expect(history.filter((e) => e.jobId === removed.jobId).map((e) => e.kind)).toEqual(['removed']);
  });

  it('on an empty lane: nothing is handed to the workers, and the next operation runs at once', async () => {
    removeNextAdd = () => true;
    const removed = await bed.ops.enqueue({ op: 'resume', lease: lease('empty'), params: { providerLeaseId: 'empty' } });
    expect(await jobHashExists(removed.jobId)).toBe(0);
    expect((await bed.ops.lanes.view(removed.laneId)).jobs).toEqual([]);
    const next = await bed.ops.enqueue({ op: 'destroy', lease: lease('empty'), params: { providerLeaseId: 'empty' } });
    expect((await bed.waitForAll([next.jobId], 5_000)).get(next.jobId)).toBe('completed');
    expect(await jobHashExists(removed.jobId)).toBe(0);
  });

  it('with an idempotency key: a retry of the request answers with the removed job and stores nothing again', async () => {
    removeNextAdd = () => true;
    const request = { op: 'resume' as const, lease: lease('keyed'), params: { providerLeaseId: 'keyed' }, idempotencyKey: 'k-removed' };
    const removed = await bed.ops.enqueue(request);
    const retried = await bed.ops.enqueue(request);
    expect(retried).toEqual({ jobId: removed.jobId, laneId: removed.laneId, deduplicated: 'idempotency-key' });
    expect(await jobHashExists(removed.jobId)).toBe(0);
    expect((await bed.ops.lanes.view(removed.laneId)).jobs).toEqual([]);
  });
});

/**
 * Jobs removed through BullMQ's own API (`queue.remove`, a clean), which tells lease-ops
 * nothing (Bull Board's removal goes through lease-ops and repairs the lane at once). An
 * operation accepted afterwards must neither be answered with the removed job nor wait for
 * it; found by an attack on the change above.
 */
describe('operations accepted after a job of their lease was removed behind lease-ops\' back', () => {
  let bed: TestBed;
  const held = gate();
  const forceHeld = gate();
  let calls: CallRecord[];
  beforeAll(async () => {
    // Resumes of `backing-*` leases settle (and back off 15 s); resumes of `held-*` hold.
    bed = await TestBed.create({ LEASE_OPS_BACKOFF_BASE_MS: '15000', LEASE_OPS_BACKOFF_CAP_MS: '15000', LEASE_OPS_CONCURRENCY: '2' });
    const recording = createRecordingProvider({
      behaviour: async ({ ctx, op }) => {
        if (op === 'resume' && ctx.lease.leaseId.startsWith('backing-')) return 'settling';
        if (op === 'resume' && ctx.lease.leaseId.startsWith('held-')) await held.promise;
        if (op === 'force-stop' && ctx.lease.leaseId.endsWith('-held')) await forceHeld.promise;
        return 'ok';
      },
    });
    calls = recording.calls;
    await bed.startWorker(recording.provider);
  });
  afterAll(async () => {
    held.open();
    forceHeld.open();
    await bed.close();
  });

  const started = (jobId: string) => readUntil(async () => calls.find((c) => c.jobId === jobId), 10_000, `${jobId} calling its provider`);
  // Listed as backing off by its lane, and moved to BullMQ's delayed set (lock released: removable).
  const backingOff = async (jobId: string) => (await bed.redis.zscore(bed.ops.lanes.backingOffKey, jobId)) !== null && (await bed.ops.queue.getJobState(jobId)) === 'delayed';

  it('an identical stop is not absorbed by a queued stop that was removed: it joins the lane and runs', async () => {
    const head = await bed.ops.enqueue({ op: 'resume', lease: lease('held-coalesce'), params: { providerLeaseId: 'held-coalesce' } });
    await started(head.jobId);
    const removed = await bed.ops.enqueue({ op: 'stop', lease: lease('held-coalesce'), params: { providerLeaseId: 'held-coalesce' } });
    expect(await bed.ops.queue.remove(removed.jobId)).toBe(1);
    const again = await bed.ops.enqueue({ op: 'stop', lease: lease('held-coalesce'), params: { providerLeaseId: 'held-coalesce' }, idempotencyKey: 'stop-again' });
    expect(again).toEqual({ jobId: expect.not.stringMatching(removed.jobId), laneId: head.laneId });
    held.open();
    expect(Object.fromEntries(await bed.waitForAll([head.jobId, again.jobId], 10_000))).toEqual({ [head.jobId]: 'completed', [again.jobId]: 'completed' });
    expect(calls.filter((c) => c.leaseId === 'held-coalesce' && c.end).map((c) => c.op)).toEqual(['resume', 'stop']);
  });

  it('a force-stop goes ahead of a backing-off head that was removed, at once, not at its retry time', async () => {
    const head = await bed.ops.enqueue({ op: 'resume', lease: lease('backing-removed'), params: { providerLeaseId: 'backing-removed' } });
    await readUntil(() => backingOff(head.jobId), 10_000, 'the resume backing off');
    expect(await bed.ops.queue.remove(head.jobId)).toBe(1);
    const acceptedAt = Date.now();
    const force = await bed.ops.enqueue({ op: 'force-stop', lease: lease('backing-removed'), params: { providerLeaseId: 'backing-removed' } });
    expect((await bed.waitForAll([force.jobId], 5_000)).get(force.jobId)).toBe('completed');
    expect(Date.now() - acceptedAt).toBeLessThan(2_000);
  });

  it('a stop queued behind a backing-off head that was removed runs at once, while a live backing-off head keeps its place', async () => {
    const removedHead = await bed.ops.enqueue({ op: 'resume', lease: lease('backing-tail'), params: { providerLeaseId: 'backing-tail' } });
    const liveHead = await bed.ops.enqueue({ op: 'resume', lease: lease('backing-live'), params: { providerLeaseId: 'backing-live' } });
    await readUntil(async () => (await Promise.all([removedHead, liveHead].map((h) => backingOff(h.jobId)))).every(Boolean), 10_000, 'both resumes backing off');
    expect(await bed.ops.queue.remove(removedHead.jobId)).toBe(1);
    const acceptedAt = Date.now();
    const stop = await bed.ops.enqueue({ op: 'stop', lease: lease('backing-tail'), params: { providerLeaseId: 'backing-tail' } });
    const behindLive = await bed.ops.enqueue({ op: 'stop', lease: lease('backing-live'), params: { providerLeaseId: 'backing-live' } });
    expect((await bed.waitForAll([stop.jobId], 5_000)).get(stop.jobId)).toBe('completed');
    expect(Date.now() - acceptedAt).toBeLessThan(2_000);
    // The live one still waits out its backoff, with the stop behind it.
    expect(await bed.ops.queue.getJobState(behindLive.jobId)).toBe('delayed');
    expect((await bed.ops.lanes.view(liveHead.laneId)).jobs).toEqual([liveHead.jobId, behindLive.jobId]);
  });

  it('a backing-off head removed while a force-stop runs ahead of it is no longer listed as backing off once the lane moves past it', async () => {
    const head = await bed.ops.enqueue({ op: 'resume', lease: lease('backing-passed-held'), params: { providerLeaseId: 'backing-passed-held' } });
    await readUntil(() => backingOff(head.jobId), 10_000, 'the resume backing off');
    // Held at its provider call, so the removal lands while it runs ahead of the resume.
    const force = await bed.ops.enqueue({ op: 'force-stop', lease: lease('backing-passed-held'), params: { providerLeaseId: 'backing-passed-held' } });
    await started(force.jobId);
    expect(await bed.ops.queue.remove(head.jobId)).toBe(1);
    forceHeld.open();
    expect((await bed.waitForAll([force.jobId], 5_000)).get(force.jobId)).toBe('completed');
    expect((await bed.ops.lanes.view(head.laneId)).jobs).toEqual([]);
    expect(await bed.redis.zscore(bed.ops.lanes.backingOffKey, head.jobId)).toBeNull();
  });

  /** A resume backing off 15 s at the head, with a stop queued behind it; then the resume is removed. */
  const stopBehindRemovedBackoff = async (leaseId: string) => {
    const head = await bed.ops.enqueue({ op: 'resume', lease: lease(leaseId), params: { providerLeaseId: leaseId } });
    await readUntil(() => backingOff(head.jobId), 10_000, 'the resume backing off');
    const stop = await bed.ops.enqueue({ op: 'stop', lease: lease(leaseId), params: { providerLeaseId: leaseId } });
    expect(await bed.ops.queue.remove(head.jobId)).toBe(1);
    return stop;
  };

  /** `request` (to the same lease) is absorbed by that stop, which then runs at once; returns the stop's job id. */
  const absorbedAndRunAtOnce = async (leaseId: string, op: 'stop' | 'force-stop', deduplicated: string) => {
    const stop = await stopBehindRemovedBackoff(leaseId);
    const acceptedAt = Date.now();
    expect(await bed.ops.enqueue({ op, lease: lease(leaseId), params: { providerLeaseId: leaseId } })).toEqual({ jobId: stop.jobId, laneId: stop.laneId, deduplicated });
    expect((await bed.waitForAll([stop.jobId], 5_000)).get(stop.jobId)).toBe('completed');
    expect(Date.now() - acceptedAt).toBeLessThan(2_000);
    return stop.jobId;
  };

  it('an identical stop absorbed by the stop behind the removed head: that stop runs at once', async () => {
    await absorbedAndRunAtOnce('backing-absorbed', 'stop', 'coalesced');
  });

  it('a force-stop that absorbs the stop behind the removed head runs at once', async () => {
    const stopJobId = await absorbedAndRunAtOnce('backing-upgraded', 'force-stop', 'absorbed-stop');
    expect(calls.filter((c) => c.jobId === stopJobId && c.end).map((c) => c.op)).toEqual(['force-stop']);
  });
});

describe('a clean-up stored again under its id after its handed-off job was removed', () => {
  let bed: TestBed;
  const busy = gate();
  beforeAll(async () => {
    // One slot, held by another lease's resume: the clean-up waits in BullMQ's wait list.
    bed = await TestBed.create({ LEASE_OPS_CONCURRENCY: '1' });
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ ctx }) => (ctx.lease.leaseId === 'busy' ? (await busy.promise, 'ok' as const) : ('ok' as const)) }).provider);
  });
  afterAll(async () => {
    busy.open();
    await bed.close();
  });

  it('does not hold its lane: the sweep hands it off again, and the next operation runs within the sweep bound', async () => {
    const blocker = await bed.ops.enqueue({ op: 'resume', lease: lease('busy'), params: { providerLeaseId: 'busy' } });
    await readUntil(async () => (await bed.ops.queue.getJobState(blocker.jobId)) === 'active', 10_000, 'the slot taken');
    const first = await bed.ops.enqueueAbandon(lease('abandoned'), 'acquire-1', null);
    expect(await bed.ops.queue.getJobState(first.jobId)).toBe('waiting');
    expect(await bed.ops.queue.remove(first.jobId)).toBe(1);
    // A repeat (after a crash, or from a second replica's sweep): the same id, stored again.
    const again = await bed.ops.enqueueAbandon(lease('abandoned'), 'acquire-1', null);
    expect(again.jobId).toBe(first.jobId);
    const next = await bed.ops.enqueue({ op: 'resume', lease: lease('abandoned'), params: { providerLeaseId: 'abandoned' } });
    busy.open();
    const acceptedAt = Date.now();
    expect(Object.fromEntries(await bed.waitForAll([again.jobId, next.jobId], 10_000))).toEqual({ [again.jobId]: 'completed', [next.jobId]: 'completed' });
    // Sweep interval and quiet time (300 + 300 ms in tests), twice at most, and the runs.
    expect(Date.now() - acceptedAt).toBeLessThan(2_500);
  });
});

describe('the tenant counts after an enqueue dropped a removed head (no worker: handed-off jobs stay waiting)', () => {
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_MAX_QUEUED_PER_COMPANY: '2' });
  });
  afterAll(() => bed.close());

  it('count what the lanes hold before the limits are checked: the company at its limit only by a removed job is not refused', async () => {
    const head = await bed.ops.enqueue({ op: 'resume', lease: lease('counted'), params: { providerLeaseId: 'counted' } });
    const parked = await bed.ops.enqueue({ op: 'stop', lease: lease('counted'), params: { providerLeaseId: 'counted' } });
    expect(await bed.ops.queue.getJobState(head.jobId)).toBe('waiting');
    expect(await bed.ops.queue.remove(head.jobId)).toBe(1);
    const next = await bed.ops.enqueue({ op: 'destroy', lease: lease('counted'), params: { providerLeaseId: 'counted' } });
    expect((await bed.ops.lanes.view(head.laneId)).jobs).toEqual([parked.jobId, next.jobId]);
    expect(await bed.redis.hget(bed.ops.lanes.byCompanyKey, 'co')).toBe('2');
    // The stop the drop exposed is handed to the workers; the destroy waits behind it.
    expect(await bed.ops.queue.getJobState(parked.jobId)).toBe('waiting');
    expect(await bed.ops.queue.getJobState(next.jobId)).toBe('delayed');
  });

  it('dates the lane now for the sweep, not at the removed head\'s retry', async () => {
    const dated = lease('dated', 'co-dated');
    const head = await bed.ops.enqueue({ op: 'resume', lease: dated, params: { providerLeaseId: 'dated' } });
    const parked = await bed.ops.enqueue({ op: 'stop', lease: dated, params: { providerLeaseId: 'dated' } });
    // As lane-yield leaves a lane whose head backs off: dated when its retry comes due.
    await bed.redis.zadd(bed.ops.lanes.lanesKey, 'XX', Date.now() + 60_000, head.laneId);
    expect(await bed.ops.queue.remove(head.jobId)).toBe(1);
    await bed.ops.enqueue({ op: 'destroy', lease: dated, params: { providerLeaseId: 'dated' } });
    expect((await bed.ops.lanes.view(head.laneId)).jobs[0]).toBe(parked.jobId);
    expect(Number(await bed.redis.zscore(bed.ops.lanes.lanesKey, head.laneId))).toBeLessThanOrEqual(Date.now());
  });
});

describe('a failed acquire retried through BullMQ\'s own API (job.retry), not lease-ops\' rerun', () => {
  let bed: TestBed;
  let calls: CallRecord[];
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    const recording = createRecordingProvider({ behaviour: ({ op }) => (op === 'acquire' ? 'permanent' : 'ok') });
    calls = recording.calls;
    await bed.startWorker(recording.provider);
  });
  afterAll(() => bed.close());

  it('fails again with operation_not_rerunnable and creates nothing: its clean-up already ran and would not run twice', async () => {
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: lease('raw-retry'), params: { runId: 'r1' } });
    expect((await bed.waitForAll([acquire.jobId], 10_000)).get(acquire.jobId)).toBe('failed');
    // Its clean-up ran (it is kept: LEASE_OPS_KEEP_COMPLETED_S).
    await readUntil(async () => (await bed.ops.queue.getCompleted()).find((j) => j.name === 'abandon-acquire'), 10_000, 'the clean-up completed');
    const job = (await bed.ops.queue.getJob(acquire.jobId))!;
    const ended = new Promise<{ failedReason?: string; returnvalue?: string }>((resolve) => {
      const on = (e: { jobId: string; failedReason?: string; returnvalue?: string }) => {
        if (e.jobId !== acquire.jobId) return;
        bed.events.off('failed', on);
        bed.events.off('completed', on);
        resolve(e);
      };
      bed.events.on('failed', on);
      bed.events.on('completed', on);
    });
    await job.retry('failed');
    expect((await ended).failedReason).toMatch(/^operation_not_rerunnable: /);
    expect(calls.filter((c) => c.op === 'acquire' && !c.end)).toHaveLength(1);
    // The lease goes on.
    const next = await bed.ops.enqueue({ op: 'destroy', lease: lease('raw-retry'), params: { providerLeaseId: 'raw-retry' } });
    expect((await bed.waitForAll([next.jobId], 5_000)).get(next.jobId)).toBe('completed');
  });
});
