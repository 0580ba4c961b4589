import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createLogger } from '../../src/logger.ts';
import { Attempt, Fencing, StaleAttemptError } from '../../src/queues/fencing.ts';
import { TestBed } from '../helpers/env.ts';

describe('scenario 5: the fence is bound to the attempt\'s own lock', () => {
  let bed: TestBed;
  let fencing: Fencing;
  beforeAll(async () => {
    bed = await TestBed.create();
    fencing = new Fencing(bed.redis, (laneId) => bed.ops.lanes.execKey(laneId), (jobId) => `${bed.ops.queue.toKey(jobId)}:lock`, createLogger({ level: 'silent' }), 60_000);
  });
  afterAll(() => bed.close());

  // The step: a stall handed the job to a successor, whose BullMQ lock (fresh, ~30 s) is on
  // the job, and which has not yet taken the lane (the lane still names the old token).
  const atTheStep = async (laneId: string, jobId: string, token: string, lockHolder: string) => {
    await bed.redis.hset(bed.ops.lanes.execKey(laneId), 'job', jobId, 'token', token);
    await bed.redis.set(`${bed.ops.queue.toKey(jobId)}:lock`, lockHolder, 'PX', 30_000);
  };

  it('an old attempt whose lock now holds a successor\'s token is stale, not fresh for the successor\'s lock time', async () => {
    await atTheStep('lane-a', 'lane-a.job', '7', 'worker-2:successor-token');
    const old = new Attempt('lane-a.job', 'lane-a', '7', 'worker-1:old-token');
    await expect(fencing.check(old)).rejects.toBeInstanceOf(StaleAttemptError);
    expect(old.fresh()).toBe(false);
  });

  it('an attempt whose lock is gone is stale', async () => {
    await bed.redis.hset(bed.ops.lanes.execKey('lane-b'), 'job', 'lane-b.job', 'token', '9');
    const attempt = new Attempt('lane-b.job', 'lane-b', '9', 'worker-1:token');
    await expect(fencing.check(attempt)).rejects.toBeInstanceOf(StaleAttemptError);
  });

  it('an attempt holding its own lock is fresh for (most of) the lock\'s time left', async () => {
    await atTheStep('lane-c', 'lane-c.job', '11', 'worker-1:token');
    const attempt = new Attempt('lane-c.job', 'lane-c', '11', 'worker-1:token');
    await fencing.check(attempt);
    expect(attempt.fresh()).toBe(true);
  });
});

describe('scenario 6: force-stops queued behind an executing head keep their order, and go ahead of it together when it backs off', () => {
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create();
  });
  afterAll(() => bed.close());

  it('two force-stops behind an executing head: in the order they came, both before the backing-off head', async () => {
    const { lease } = await import('../helpers/env.ts');
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('fs'), params: { providerLeaseId: 'fs' } });
    const queued = await bed.ops.enqueue({ op: 'resume', lease: lease('fs'), params: { providerLeaseId: 'fs' } });
    const first = await bed.ops.enqueue({ op: 'force-stop', lease: lease('fs'), params: { providerLeaseId: 'fs' } });
    // The head was handed off (it executes): the force-stops wait right behind it, in order.
    const second = await bed.ops.enqueue({ op: 'force-stop', lease: lease('fs'), params: { providerLeaseId: 'fs' }, idempotencyKey: 'second' });
    expect((await bed.ops.lanes.view(head.laneId)).jobs).toEqual([head.jobId, first.jobId, second.jobId, queued.jobId]);
    // The head backs off for a retry: the force-stops go ahead of it, the first one runs next.
    const token = (await bed.ops.lanes.view(head.laneId)).holder!.token;
    expect(await bed.ops.lanes.yield(head.laneId, head.jobId, token, Date.now() + 1_000)).toBe(true);
    expect((await bed.ops.lanes.view(head.laneId)).jobs).toEqual([first.jobId, second.jobId, head.jobId, queued.jobId]);
    expect(await bed.ops.queue.getJobState(first.jobId)).toBe('waiting');
    expect(await bed.ops.queue.getJobState(second.jobId)).toBe('delayed');
  });
});
