import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { gate, lease, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

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
