import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { gate, lease, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

describe('scenario 9: a worker that releases a lane while it closes wakes another for the next job', () => {
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create();
  });
  afterAll(() => bed.close());

  it('the next job of the lane starts within a second of the release, not when an idle worker next looks', async () => {
    const held = gate();
    const w1 = await bed.startWorker(createRecordingProvider({ behaviour: async ({ op }) => (op === 'stop' ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
    const running = new Promise<void>((resolve) => {
      const on = () => (bed.events.off('active', on), resolve());
      bed.events.on('active', on);
    });
    const first = await bed.ops.enqueue({ op: 'stop', lease: lease('closing'), params: { providerLeaseId: 'closing' } });
    await running;
    // Queued behind it: parked, with a timer at its deadline, which idle workers then wait for.
    const next = await bed.ops.enqueue({ op: 'resume', lease: lease('closing'), params: { providerLeaseId: 'closing' } });
    await bed.startWorker(createRecordingProvider().provider);
    const closed = w1.close(); // a rolling deploy: SIGTERM while the stop runs
    const times = new Map<string, number>();
    const seen = new Promise<void>((resolve) => {
      const on = ({ jobId }: { jobId: string }) => {
        if (jobId === first.jobId && !times.has('completed')) times.set('completed', Date.now());
        if (jobId === next.jobId) {
          times.set('next-active', Date.now());
          bed.events.off('completed', on);
          bed.events.off('active', on);
          resolve();
        }
      };
      bed.events.on('completed', on);
      bed.events.on('active', on);
    });
    held.open();
    await closed;
    await seen;
    expect(times.get('next-active')! - times.get('completed')!).toBeLessThan(1_000);
    expect((await bed.waitForAll([next.jobId])).get(next.jobId)).toBe('completed');
  });
});

describe('a head stored again under the id of a job that ended is not taken for one backing off', () => {
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create();
  });
  afterAll(() => bed.close());

  it('delayed, neither parked nor backing off, and not executing: the sweep hands it off', async () => {
    // What two replicas queueing the same clean-up can leave: the first ran and was removed,
    // the second stored the job again (delayed until its deadline) while the lane still named it.
    const first = await bed.ops.enqueue({ op: 'destroy', lease: lease('again'), params: { providerLeaseId: 'again' } });
    const job = (await bed.ops.queue.getJob(first.jobId))!;
    await job.remove();
    await bed.redis.del(`${bed.config.LEASE_OPS_PREFIX}:lane:${first.laneId}:x`); // its run ended
    await bed.ops.queue.add(job.name, job.data, { ...job.opts, jobId: first.jobId, delay: 600_000 });
    expect((await bed.ops.lanes.view(first.laneId)).jobs).toEqual([first.jobId]);
    await bed.startWorker(createRecordingProvider().provider);
    expect((await bed.waitForAll([first.jobId], 5_000)).get(first.jobId)).toBe('completed');
  });
});
