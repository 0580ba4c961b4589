import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

describe('a provider some replicas do not serve yet (a rolling change of LEASE_OPS_PROVIDERS)', () => {
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create();
    await bed.startWorker(createRecordingProvider({ name: 'recording' }).provider);
  });
  afterAll(() => bed.close());
  const identity = (provider: string, leaseId: string) => ({ provider, companyId: 'co', environmentId: 'env', leaseId });

  it('waits for a replica that serves it, within its deadline', async () => {
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: identity('late', 'l1'), params: { providerLeaseId: 'l1' }, deadlineMs: 20_000 });
    // It met a worker without the provider and backs off instead of failing.
    await new Promise<void>((resolve) => {
      const on = ({ jobId: id }: { jobId: string }) => id === jobId && (bed.events.off('delayed', on), resolve());
      bed.events.on('delayed', on);
    });
    // Not failed: backing off, or already on its next try (the first backoff is a quarter second).
    expect(['delayed', 'waiting', 'active']).toContain(await bed.ops.queue.getJobState(jobId));
    const late = createRecordingProvider({ name: 'late' });
    await bed.startWorker(late.provider);
    expect((await bed.waitForAll([jobId], 15_000)).get(jobId)).toBe('completed');
    expect(late.calls.some((c) => c.jobId === jobId)).toBe(true);
  });

  it('fails with unknown_provider at its deadline when no replica ever serves it', async () => {
    const started = Date.now();
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: identity('never', 'n1'), params: { providerLeaseId: 'n1' }, deadlineMs: 1_500 });
    expect((await bed.waitForAll([jobId], 10_000)).get(jobId)).toBe('failed');
    expect(Date.now() - started).toBeGreaterThanOrEqual(1_000);
    expect((await bed.ops.queue.getJob(jobId))!.failedReason).toMatch(/^unknown_provider: /);
  });
});
