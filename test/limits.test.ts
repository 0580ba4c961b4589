import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type LeaseOpsClient, QueueFullError } from '../src/index.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { gate, lease, scanKeys, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

const TOKEN = 'limits-token-0123456789';

describe('queue limits', () => {
  let bed: TestBed;
  let client: LeaseOpsClient;
  let api: TestApi;
  let base: string;
  const hold = gate<void>();

  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_MAX_QUEUED_PER_LEASE: '3', LEASE_OPS_MAX_QUEUED: '6' });
    const { provider } = createRecordingProvider({
      behaviour: async () => {
        await hold.promise;
        return 'ok' as const;
      },
    });
    await bed.startWorker(provider);
    api = await startTestApi(bed);
    client = api.client;
    base = api.base;
  });

  afterAll(async () => {
    hold.open();
    await api?.close();
    await bed?.close();
  });

  const enqueue = (leaseId: string, op: string, params: unknown, headers: Record<string, string> = {}) =>
    fetch(`${base}/v1/leases/recording/co/env/${leaseId}/operations`, {
      method: 'POST',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', ...headers },
      body: JSON.stringify({ op, params }),
    });
  const jobCount = async () => Object.values(await bed.ops.queue.getJobCounts()).reduce((a, b) => a + b, 0);

  it('answers 429 with Retry-After when a lease or the queue is full, writes nothing, and accepts again once drained', async () => {
    // One lease: three operations fit (one executing, held), the fourth does not.
    for (let i = 0; i < 3; i++) expect((await enqueue('a', 'destroy', { providerLeaseId: 'a' })).status).toBe(202);
    const before = await jobCount();
    const full = await enqueue('a', 'destroy', { providerLeaseId: 'a' }, { 'idempotency-key': 'refused-once' });
    expect(full.status).toBe(429);
    expect(full.headers.get('retry-after')).toBe('5');
    expect(((await full.json()) as { error: { code: string } }).error.code).toBe('lease_queue_full');
    expect(await jobCount()).toBe(before);
    // Its key holds the refusal for a second (concurrent retries get the same answer), then goes.
    const keys = await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}:idem:*`);
    expect(keys).toHaveLength(1);
    expect(JSON.parse((await bed.redis.get(keys[0]!))!)).toMatchObject({ state: 'refused', limit: 'lease' });
    expect(await bed.redis.pttl(keys[0]!)).toBeLessThanOrEqual(1_000);
    expect((await enqueue('a', 'destroy', { providerLeaseId: 'a' }, { 'idempotency-key': 'refused-once' })).status).toBe(429);
    expect((await client.getLease(lease('a'))).queuedTotal).toBe(2);

    // A force-stop is never refused by the lease limit.
    expect((await enqueue('a', 'force-stop', { providerLeaseId: 'a' })).status).toBe(202);

    // The queue: at most 6 operations waiting (parked, ready or backing off); executing
    // ones do not count. Lease a has 3 waiting now; b and c add their second and third.
    const started = async (jobId: string) => {
      const active = new Promise<void>((resolve) => {
        const on = ({ jobId: id }: { jobId: string }) => id === jobId && (bed.events.off('active', on), resolve());
        bed.events.on('active', on);
      });
      if ((await bed.ops.queue.getJobState(jobId)) !== 'active') await active;
    };
    for (const id of ['b', 'c']) {
      const head = (await (await enqueue(id, 'destroy', { providerLeaseId: id })).json()) as { jobId: string };
      await started(head.jobId);
    }
    expect((await enqueue('b', 'destroy', { providerLeaseId: 'b' })).status).toBe(202);
    expect((await enqueue('b', 'destroy', { providerLeaseId: 'b' })).status).toBe(202);
    expect((await enqueue('c', 'destroy', { providerLeaseId: 'c' })).status).toBe(202);
    const counts = await bed.ops.queue.getJobCounts('wait', 'delayed');
    expect((counts.wait ?? 0) + (counts.delayed ?? 0)).toBe(6);
    const overflow = await client.enqueue('destroy', lease('c'), { providerLeaseId: 'c' }).catch((e: unknown) => e);
    expect(overflow).toBeInstanceOf(QueueFullError);
    expect((overflow as QueueFullError).code).toBe('queue_full');
    const viaApi = await enqueue('d', 'destroy', { providerLeaseId: 'd' });
    expect([viaApi.status, ((await viaApi.json()) as { error: { code: string } }).error.code]).toEqual([429, 'queue_full']);
    expect((await client.getLease(lease('d'))).queuedTotal).toBe(0);

    // Issue 12, scenario 5: another tenant's backlog never keeps a force-stop out; only
    // force-stops of its own lease count against it (lease a has one waiting already).
    expect((await enqueue('d', 'force-stop', { providerLeaseId: 'd' })).status).toBe(202);
    expect((await enqueue('a', 'force-stop', { providerLeaseId: 'a' })).status).toBe(202);
    expect((await enqueue('a', 'force-stop', { providerLeaseId: 'a' })).status).toBe(202);
    const fourth = await enqueue('a', 'force-stop', { providerLeaseId: 'a' });
    expect([fourth.status, ((await fourth.json()) as { error: { code: string } }).error.code]).toEqual([429, 'lease_queue_full']);

    // Drained, the same idempotency key is a fresh request, accepted.
    hold.open();
    const all = (await bed.ops.queue.getJobs(['wait', 'delayed', 'active', 'prioritized'])).map((j) => j.id!);
    await bed.waitForAll(all, 20_000);
    // (after the refusal the key held for a second has gone)
    for (let i = 0; i < 40 && (await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}:idem:*`)).length > 0; i++) await new Promise((r) => setTimeout(r, 50));
    const again = await enqueue('a', 'destroy', { providerLeaseId: 'a' }, { 'idempotency-key': 'refused-once' });
    expect(again.status).toBe(202);
    const body = (await again.json()) as { deduplicated?: string };
    expect(body.deduplicated).toBeUndefined();
  });
});
