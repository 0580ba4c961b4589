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
