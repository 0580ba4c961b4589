// A fourth independent attack, on removals repaired from Bull Board's routes, the lanes
// index's dates, force-stops past the queue limit, and foreign sandboxes (the last is in
// test/providers.contract.test.ts). Each case failed on the code it attacked.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startTestApi, type TestApi } from '../helpers/api-server.ts';
import { gate, lease, readUntil, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

const target = (id: string) => ({ providerLeaseId: id });

describe('a head handed off early by a force-stop is no longer backing off', () => {
  let bed: TestBed;
  const forceGate = gate();
  const blockerGate = gate();
  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_SWEEP_INTERVAL_MS: '1000',
      LEASE_OPS_SWEEP_STALE_MS: '1000',
      LEASE_OPS_BACKOFF_BASE_MS: '30000',
      LEASE_OPS_BACKOFF_CAP_MS: '30000',
      LEASE_OPS_CONCURRENCY: '1',
    });
    await bed.startWorker(
      createRecordingProvider({
        behaviour: async ({ ctx, op }) => {
          if (op === 'stop') return ctx.attempt === 1 ? 'settling' : 'ok';
          if (op === 'force-stop') return (await forceGate.promise, 'ok' as const);
          if (ctx.lease.leaseId === 'blocker') return (await blockerGate.promise, 'ok' as const);
          return 'ok';
        },
      }).provider,
    );
  });
  afterAll(async () => {
    forceGate.open();
    blockerGate.open();
    await bed.close();
  });

  it('so the sweep does not date its lane at the old retry, and its loss is repaired within the bound (was 33.4 s)', { timeout: 60_000 }, async () => {
    const L = lease('victim');
    const stop = await bed.ops.enqueue({ op: 'stop', lease: L, params: target('victim') });
    await readUntil(async () => (await bed.redis.zscore(bed.ops.lanes.backingOffKey, stop.jobId)) !== null, 10_000, 'the stop backing off');
    const force = await bed.ops.enqueue({ op: 'force-stop', lease: L, params: target('victim') });
    await readUntil(async () => (await bed.ops.queue.getJobState(force.jobId)) === 'active', 10_000, 'the force-stop running');
    const blocker = await bed.ops.enqueue({ op: 'destroy', lease: lease('blocker'), params: target('blocker') });
    const next = await bed.ops.enqueue({ op: 'destroy', lease: L, params: target('victim') });
    forceGate.open(); // the force-stop ends: its release hands the stop off now, 30 s early
    await readUntil(async () => (await bed.ops.queue.getJobState(blocker.jobId)) === 'active', 10_000, 'the blocker running');
    expect(await bed.ops.queue.getJobState(stop.jobId)).toBe('waiting');
    expect(await bed.redis.zscore(bed.ops.lanes.backingOffKey, stop.jobId)).toBeNull();
    // Let the sweep look at the quiet lane, then lose its head through BullMQ's own API.
    const quietUntil = Date.now() + 2_500;
    await readUntil(async () => Date.now() > quietUntil, 5_000, 'the sweep looking');
    expect(Number(await bed.redis.zscore(bed.ops.lanes.lanesKey, stop.laneId))).toBeLessThanOrEqual(Date.now());
    await bed.ops.queue.remove(stop.jobId);
    const removedAt = Date.now();
    blockerGate.open();
    await readUntil(async () => (await bed.ops.queue.getJobState(next.jobId)) === 'completed', 50_000, 'the next operation');
    expect(Date.now() - removedAt).toBeLessThan(4_000);
  });
});

describe('removals in Bull Board through any route form it serves', () => {
  const ADMIN = 'board-admin-token-0123456789';
  let bed: TestBed;
  let api: TestApi;
  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: ADMIN,
      LEASE_OPS_BOARD_READ_ONLY: 'false',
      LEASE_OPS_SWEEP_INTERVAL_MS: '60000',
      LEASE_OPS_SWEEP_STALE_MS: '60000',
      LEASE_OPS_BACKOFF_BASE_MS: '30000',
      LEASE_OPS_BACKOFF_CAP_MS: '30000',
    });
    await bed.startWorker(createRecordingProvider({ behaviour: ({ op }) => (op === 'stop' ? 'settling' : 'ok') }).provider);
    api = await startTestApi(bed);
  });
  afterAll(async () => {
    await api.close();
    await bed.close();
  });

  const put = async (path: string) => {
    const res = await fetch(`${api.base}${path}`, {
      method: 'PUT',
      headers: { authorization: `Basic ${Buffer.from(`op:${ADMIN}`).toString('base64')}`, origin: api.base, 'sec-fetch-site': 'same-origin' },
    });
    await res.arrayBuffer();
    return res.status;
  };
  const variants: [string, (q: string, id: string) => string][] = [
    ['a trailing slash', (q, id) => `/board/api/queues/${q}/${id}/clean/`],
    ['an upper-case path', (q, id) => `/board/API/QUEUES/${q}/${id}/CLEAN`],
  ];
  it.each(variants)('%s: the operation behind the removed head goes on at once (was 33 s)', { timeout: 30_000 }, async (name, path) => {
    const l = lease(`rv-${name.replace(/\W/g, '')}`);
    const head = await bed.ops.enqueue({ op: 'stop', lease: l, params: target(l.leaseId) });
    const next = await bed.ops.enqueue({ op: 'destroy', lease: l, params: target(l.leaseId) });
    await readUntil(async () => (await bed.redis.zscore(bed.ops.lanes.backingOffKey, head.jobId)) !== null, 10_000, 'the head backing off');
    expect(await put(path(bed.config.LEASE_OPS_QUEUE, head.jobId))).toBe(204);
    const removedAt = Date.now();
    expect(await bed.ops.queue.getJob(head.jobId)).toBeUndefined();
    expect((await bed.waitForAll([next.jobId], 10_000)).get(next.jobId)).toBe('completed');
    expect(Date.now() - removedAt).toBeLessThan(1_000);
  });
});

describe('force-stops past LEASE_OPS_MAX_QUEUED', () => {
  const EVIL = 'evil-token-0123456789abcdef';
  let bed: TestBed;
  let api: TestApi;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: EVIL, companyId: 'evil' }]), LEASE_OPS_MAX_QUEUED: '20', LEASE_OPS_MAX_QUEUED_PER_LEASE: '5' });
    await bed.ops.announceProviders([{ name: 'simulated', capabilities: { stop: true, pause: false, forceStop: true } }]);
    api = await startTestApi(bed); // no worker: what is queued stays queued
  });
  afterAll(async () => {
    await api.close();
    await bed.close();
  });

  it('have room of their own above the limit (a tenth, at least 100), and no more (200 across 40 leases were all taken)', async () => {
    const post = (leaseId: string) =>
      fetch(`${api.base}/v1/leases/simulated/evil/prod/${leaseId}/operations`, {
        method: 'POST',
        headers: { authorization: `Bearer ${EVIL}`, 'content-type': 'application/json' },
        body: JSON.stringify({ op: 'force-stop', params: { providerLeaseId: leaseId } }),
      }).then(async (r) => ({ status: r.status, code: r.status === 202 ? null : ((await r.json()) as { error: { code: string } }).error.code }));
    const results = [];
    for (let l = 0; l < 40; l++) for (let i = 0; i < 5; i++) results.push(await post(`junk-${l}`));
    expect(results.filter((r) => r.status === 202)).toHaveLength(20 + 100);
    expect(new Set(results.filter((r) => r.status !== 202).map((r) => `${r.status} ${r.code}`))).toEqual(new Set(['429 queue_full']));
    const counts = await bed.ops.queue.getJobCounts('wait', 'delayed');
    expect((counts.wait ?? 0) + (counts.delayed ?? 0)).toBe(120);
  });
});
