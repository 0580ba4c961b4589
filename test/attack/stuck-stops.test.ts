import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { gate, lease, TestBed } from '../helpers/env.ts';
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
