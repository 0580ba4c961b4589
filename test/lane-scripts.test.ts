import { afterEach, describe, expect, it } from 'vitest';
import { laneIdOf } from '../src/lease.ts';
import { lease, TestBed } from './helpers/env.ts';

// The lane scripts on their own (no worker), against real Redis and a real BullMQ queue.
let bed: TestBed | undefined;
afterEach(async () => {
  await bed?.close();
  bed = undefined;
});

async function enqueueParked(b: TestBed, leaseId: string) {
  // Destroys: never coalesced, so two of them are two operations even before a worker takes the first.
  return b.ops.enqueue({ op: 'destroy', lease: lease(leaseId), params: { providerLeaseId: leaseId } });
}

describe('lane scripts', () => {
  it('hands the head to BullMQ with a fencing token in its progress, and keeps the rest parked', async () => {
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'x');
    const b = await enqueueParked(bed, 'x');
    expect(await bed.ops.queue.getJobState(a.jobId)).toBe('waiting');
    expect(await bed.ops.queue.getJobState(b.jobId)).toBe('delayed');
    const job = await bed.ops.queue.getJob(a.jobId);
    const view = await bed.ops.lanes.view(a.laneId);
    expect(view.jobs).toEqual([a.jobId, b.jobId]);
    expect(job?.progress).toEqual({ lane: 'handed-off', fence: view.holder?.token });
  });

  it('refuses a stale attempt: an older token can neither release nor yield the lane', async () => {
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'x');
    await enqueueParked(bed, 'x');
    const first = (await bed.ops.lanes.view(a.laneId)).holder!.token;
    const again = await bed.laneAcquire(a.laneId, a.jobId); // a newer attempt of the same job
    expect(again.kind).toBe('run');
    const second = again.kind === 'run' ? again.token : '';
    expect(BigInt(second)).toBeGreaterThan(BigInt(first));
    expect(await bed.ops.lanes.yield(a.laneId, a.jobId, first, Date.now() + 1_000)).toBe(false);
    expect(await bed.ops.lanes.release(a.laneId, a.jobId, first, { status: 'completed', result: 1 })).toEqual({ kind: 'stale' });
    expect((await bed.ops.lanes.view(a.laneId)).jobs[0]).toBe(a.jobId);
    // A start that no longer holds the job's lock (its worker froze past it, and another took
    // the job) gets no token: the current attempt keeps the lane.
    await bed.redis.set(`${bed.ops.queue.toKey(a.jobId)}:lock`, 'the-next-worker');
    expect(await bed.ops.lanes.acquire(a.laneId, a.jobId, 'test-lock')).toEqual({ kind: 'stale' });
    expect((await bed.ops.lanes.view(a.laneId)).holder).toEqual({ job: a.jobId, token: second });
  });

  it('parks a head whose lane another job still holds: its start gets no token, and the holder keeps its own', async () => {
    // The lane's head is not its holder when the holder left the list while it ran (an operator
    // removed it; the sweep's repair dropped it): that attempt may still be running, so the new
    // head waits for its release or the sweep. A start given a token here would run beside it,
    // kept from the provider only by the fence (helper-65's surviving mutant of lane-acquire).
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'h');
    const b = await enqueueParked(bed, 'h');
    const holder = (await bed.ops.lanes.view(a.laneId)).holder!;
    await bed.redis.lrem(bed.ops.lanes.listKey(a.laneId), 0, a.jobId);
    expect((await bed.ops.lanes.view(a.laneId)).jobs).toEqual([b.jobId]);
    // What parking does besides answering, made visible: b as if it had last backed off (the
    // push marked it parked already; helper-66: a bare 'park' answer passed without this).
    await bed.redis.hdel(bed.ops.queue.toKey(b.jobId), 'lo:parked');
    await bed.redis.zadd(bed.ops.lanes.backingOffKey, Date.now(), b.jobId);
    expect(await bed.laneAcquire(a.laneId, b.jobId)).toEqual({ kind: 'park' });
    expect((await bed.ops.lanes.view(a.laneId)).holder).toEqual(holder);
    expect(await bed.redis.hget(bed.ops.queue.toKey(b.jobId), 'lo:parked')).toBe('1');
    expect(await bed.redis.zscore(bed.ops.lanes.backingOffKey, b.jobId)).toBeNull();
  });

  it('refuses the drop of a parked job past its deadline by an attempt that lost the job\'s lock, and changes nothing', async () => {
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'y');
    const b = await enqueueParked(bed, 'y');
    const before = await bed.ops.lanes.view(a.laneId);
    await bed.redis.set(`${bed.ops.queue.toKey(b.jobId)}:lock`, 'the-next-worker');
    const outcome = { status: 'failed' as const, code: 'deadline_exceeded', error: 'deadline_exceeded: the deadline passed while it waited in its lane' };
    expect(await bed.ops.lanes.drop(a.laneId, b.jobId, outcome, false, 'frozen-worker')).toEqual({ kind: 'stale' });
    expect(await bed.ops.lanes.view(a.laneId)).toEqual(before);
    expect(await bed.redis.hget(bed.ops.queue.toKey(b.jobId), 'lo:outcome')).toBeNull();
    // The attempt that holds the lock drops it.
    expect(await bed.ops.lanes.drop(a.laneId, b.jobId, outcome, false, 'the-next-worker')).toEqual({ kind: 'dropped', next: null });
    expect((await bed.ops.lanes.view(a.laneId)).jobs).toEqual([a.jobId]);
  });

  it('replays the recorded outcome for a re-run after release, and calls a job outside any lane an orphan', async () => {
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'x');
    const b = await enqueueParked(bed, 'x');
    const token = (await bed.ops.lanes.view(a.laneId)).holder!.token;
    const released = await bed.ops.lanes.release(a.laneId, a.jobId, token, { status: 'completed', result: { ok: 1 } });
    expect(released).toEqual({ kind: 'next', handOff: { jobId: b.jobId, result: 'promoted' } });
    expect(await bed.laneAcquire(a.laneId, a.jobId)).toEqual({ kind: 'done', outcome: { status: 'completed', result: { ok: 1 } } });

    await bed.ops.queue.add('stop', {}, { jobId: `${a.laneId}.stray`, delay: 60_000 });
    expect(await bed.laneAcquire(a.laneId, `${a.laneId}.stray`)).toEqual({ kind: 'orphan' });
    expect(await bed.laneAcquire(a.laneId, b.jobId)).toMatchObject({ kind: 'run' });
  });

  it('repairs: drops a removed head and hands off the next; hands off a head left parked; leaves a healthy lane be', async () => {
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'x');
    const b = await enqueueParked(bed, 'x');
    const c = await enqueueParked(bed, 'x');
    const laneId = laneIdOf(lease('x'));
    expect(await bed.ops.lanes.repair(laneId)).toEqual({ kind: 'healthy' });

    await (await bed.ops.queue.getJob(a.jobId))!.remove();
    expect(await bed.ops.lanes.repair(laneId)).toEqual({ kind: 'dropped', jobId: a.jobId, next: { jobId: b.jobId, result: 'promoted' } });
    expect(await bed.ops.queue.getJobState(b.jobId)).toBe('waiting');

    // Remove b too, and c while parked: a release then skips the missing c.
    const tokenB = (await bed.ops.lanes.view(laneId)).holder!.token;
    await (await bed.ops.queue.getJob(c.jobId))!.remove();
    expect(await bed.ops.lanes.release(laneId, b.jobId, tokenB, { status: 'completed', result: null })).toEqual({ kind: 'idle' });
    expect(await bed.laneKeys()).toEqual([]);
  });

  it('repairs a parked head that nobody handed off (the process that should have died first)', async () => {
    bed = await TestBed.create();
    const a = await enqueueParked(bed, 'y');
    const b = await enqueueParked(bed, 'y');
    const laneId = a.laneId;
    // Simulate a crash between BullMQ finishing `a` and the lane hearing of it.
    await bed.redis.hset(bed.ops.queue.toKey(a.jobId), 'finishedOn', Date.now());
    const r = await bed.ops.lanes.repair(laneId);
    expect(r).toEqual({ kind: 'dropped', jobId: a.jobId, next: { jobId: b.jobId, result: 'promoted' } });
    // And a head left parked with no holder (its hand-off found it active while it parked
    // itself) is handed off.
    const other = laneIdOf(lease('z'));
    const parked = `${other}.parked`;
    await bed.ops.queue.add('stop', {}, { jobId: parked, delay: 24 * 3_600_000 });
    await bed.redis.hset(bed.ops.queue.toKey(parked), 'lo:parked', '1'); // as lane-push leaves a job that waits
    await bed.redis.rpush(bed.ops.lanes.listKey(other), parked);
    expect(await bed.ops.lanes.repair(other)).toEqual({ kind: 'handed', jobId: parked, result: 'promoted' });
    expect(await bed.ops.queue.getJobState(parked)).toBe('waiting');
  });
});
