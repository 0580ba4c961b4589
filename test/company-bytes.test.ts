import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { LeaseWorker } from '../src/queues/worker.ts';
import { ACCEPTED_ALLOWANCE_BYTES, ENDED_ALLOWANCE_BYTES, companyBytesKeys } from '../src/queues/company-bytes.ts';
import { laneIdOf } from '../src/lease.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// Issue 27 item 4: one company filled Redis with failed operations carrying 16 KiB of
// metadata each (23.7 KB kept per operation, for a week). Each company's operations are now
// counted against a bytes budget; at it, its own oldest ended records go, then it is refused.

const A = 'bytes-a-token-0123456789abcdef';
const B = 'bytes-b-token-0123456789abcdef';
const METADATA = { blob: 'm'.repeat(15_000) };
const lease = (company: string, leaseId: string) => ({ provider: 'recording', companyId: company, environmentId: 'env', leaseId });

describe("a company's Redis bytes (issue 27 item 4)", () => {
  let bed: TestBed;
  let api: TestApi;
  let worker: LeaseWorker | undefined;
  /** What one resume with METADATA is counted as (measured from the first one). */
  let charge = 0;
  const BUDGET_IN_CHARGES = 10;

  beforeAll(async () => {
    // The budget is set after the first operation tells what one is counted as; until then, none.
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }]), LEASE_OPS_KEEP_FAILED_S: '3600' });
    // Three settling attempts, then a failure for good: a failed record with its history.
    const { provider } = createRecordingProvider({ behaviour: ({ ctx }) => (ctx.attempt < 4 ? 'settling' : 'permanent') });
    worker = await bed.startWorker(provider);
  });

  afterAll(async () => {
    await worker?.close();
    await api?.close();
    await bed?.close();
  });

  async function failedResume(company: string, leaseId: string): Promise<string> {
    const { jobId } = await bed.ops.enqueue({ op: 'resume', lease: lease(company, leaseId), params: { providerLeaseId: leaseId, leaseMetadata: METADATA } });
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('failed');
    return jobId;
  }

  /** Bytes Redis holds in the job's hash and every key that names its lane (history, record, indexes of it). */
  async function bytesNaming(laneId: string, jobId: string): Promise<number> {
    const keys = new Set([bed.ops.queue.toKey(jobId), `${bed.config.LEASE_OPS_PREFIX}:history:${laneId}`]);
    let cursor = '0';
    do {
      const [next, found] = await bed.redis.scan(cursor, 'MATCH', `${bed.config.LEASE_OPS_PREFIX}*${laneId}*`, 'COUNT', 1000);
      cursor = next;
      for (const key of found) keys.add(key);
    } while (cursor !== '0');
    let total = 0;
    for (const key of keys) total += Number(await bed.redis.call('MEMORY', 'USAGE', key, 'SAMPLES', '0'));
    return total;
  }

  it('counts an operation as at least what Redis holds for it: its data plus an allowance for its job and history', async () => {
    const before = await bed.ops.bytes.heldOf('a');
    const jobId = await failedResume('a', 'measured');
    charge = (await bed.ops.bytes.heldOf('a')) - before;
    const held = await bytesNaming(laneIdOf(lease('a', 'measured')), jobId);
    console.log(`one failed resume with ${JSON.stringify(METADATA).length} B of metadata and 4 attempts: Redis holds ${held} B in keys naming its lane; counted ${charge} B (allowances ${ACCEPTED_ALLOWANCE_BYTES} accepted, ${ENDED_ALLOWANCE_BYTES} ended)`);
    expect(held).toBeGreaterThan(15_000);
    expect(charge).toBeGreaterThanOrEqual(held);
    expect(await bed.ops.queue.getJob(jobId)).toBeTruthy();
  }, 30_000);

  it("at its budget, a company's oldest ended records go first; its newest and other companies' stay", async () => {
    await worker!.close();
    worker = undefined;
    // A bed of the same deployment with a budget of ten operations for A.
    const limited = await TestBed.create({
      LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX,
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }]),
      LEASE_OPS_QUEUE_LIMITS: JSON.stringify({ a: { maxBytes: BUDGET_IN_CHARGES * charge } }),
      LEASE_OPS_KEEP_FAILED_S: '3600',
    });
    await bed.close();
    bed = limited;
    const { provider } = createRecordingProvider({ behaviour: () => 'permanent' });
    worker = await bed.startWorker(provider);
    const bJob = await failedResume('b', 'b-0');
    const aJobs: string[] = [];
    for (let i = 0; i < 2 * BUDGET_IN_CHARGES; i++) aJobs.push(await failedResume('a', `a-${i}`));
    expect(await bed.ops.bytes.heldOf('a')).toBeLessThanOrEqual(BUDGET_IN_CHARGES * charge);
    const kept = await Promise.all(aJobs.map(async (id) => Boolean(await bed.ops.queue.getJob(id))));
    // The oldest went, the newest stayed, in that order (no hole among the kept).
    expect(kept[0]).toBe(false);
    expect(kept.at(-1)).toBe(true);
    expect(kept.indexOf(true)).toBeGreaterThan(0);
    expect(kept.slice(kept.indexOf(true)).every(Boolean)).toBe(true);
    expect(await bed.ops.queue.getJob(bJob)).toBeTruthy();
    // What A's operations hold in Redis now, their leases' histories included (a removed
    // record's events stay there), is within what A is counted as holding.
    let aHolds = 0;
    for (const [i, id] of aJobs.entries()) aHolds += await bytesNaming(laneIdOf(lease('a', `a-${i}`)), id);
    aHolds += await bytesNaming(laneIdOf(lease('a', 'measured')), 'none');
    console.log(`A at its budget of ${BUDGET_IN_CHARGES * charge} B: its keys hold ${aHolds} B, counted ${await bed.ops.bytes.heldOf('a')} B`);
    expect(aHolds).toBeLessThanOrEqual(await bed.ops.bytes.heldOf('a'));
    // What went is all gone: no key names it, no BullMQ set lists it (lease-ops adds no parents, children or logs).
    const gone = aJobs[0]!;
    expect(await bed.redis.zscore(bed.ops.queue.toKey('failed'), gone)).toBeNull();
    expect((await bed.redis.keys(`${bed.config.LEASE_OPS_PREFIX}*${gone}*`)).length).toBe(0);
  }, 120_000);

  it("refuses a company whose live operations alone fill its budget (429 company_bytes_full), never another's, and never removes a live one or a rerun", async () => {
    await worker!.close();
    worker = undefined;
    api = await startTestApi(bed);
    const oldestKept = (await bed.ops.queue.getFailed(0, -1)).filter((j) => j.data.lease.companyId === 'a').sort((x, y) => x.timestamp - y.timestamp)[0]!;
    // Run again, with no worker: it is live now, and must outlast whatever room is made.
    const rerun = await fetch(`${api.base}/v1/operations/${encodeURIComponent(oldestKept.id!)}/rerun`, { method: 'POST', headers: { authorization: `Bearer ${A}` } });
    expect(rerun.status).toBe(202);
    const post = (token: string, company: string, leaseId: string) =>
      fetch(`${api.base}/v1/leases/recording/${company}/env/${leaseId}/operations`, {
        method: 'POST',
        headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
        body: JSON.stringify({ op: 'resume', params: { providerLeaseId: leaseId, leaseMetadata: METADATA } }),
      });
    const accepted: string[] = [];
    let refused: Response | undefined;
    for (let i = 0; i < 3 * BUDGET_IN_CHARGES && !refused; i++) {
      const res = await post(A, 'a', `live-${i}`);
      if (res.status === 202) accepted.push(((await res.json()) as { jobId: string }).jobId);
      else refused = res;
    }
    expect(refused?.status).toBe(429);
    expect(refused!.headers.get('retry-after')).toBe('5');
    expect(((await refused!.json()) as { error: { code: string } }).error.code).toBe('company_bytes_full');
    // Every ended record of A went before the refusal; the live ones and the rerun stayed.
    expect(accepted.length).toBeGreaterThanOrEqual(BUDGET_IN_CHARGES - 2);
    for (const id of [...accepted, oldestKept.id!]) expect(await bed.ops.queue.getJob(id)).toBeTruthy();
    expect(await bed.ops.queue.getJobState(oldestKept.id!)).toBe('waiting');
    // B is not A.
    expect((await post(B, 'b', 'b-live')).status).toBe(202);
    // Counted where an operator looks.
    const metrics = await (await fetch(`${api.base}/metrics`)).text();
    const shown = Number(/^lease_ops_company_bytes\{company="a"\} (\d+)$/m.exec(metrics)?.[1]);
    expect(shown).toBe(await bed.ops.bytes.heldOf('a'));
    expect(shown).toBeLessThanOrEqual(BUDGET_IN_CHARGES * charge);
  }, 60_000);
});

describe("a company's Redis bytes: what the attack on the change found", () => {
  let bed: TestBed;
  let worker: LeaseWorker | undefined;

  afterAll(async () => {
    await worker?.close();
    await bed?.close();
  });

  it('metadata is bounded in UTF-8 bytes, not characters (16,000 characters of U+0800 are 48 KB)', async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_FAILED_S: '3600' });
    const wide = { blob: '\u0800'.repeat(16_000) };
    await expect(bed.ops.enqueue({ op: 'resume', lease: lease('a', 'wide'), params: { providerLeaseId: 'wide', leaseMetadata: wide } })).rejects.toThrow(/at most 16 KiB of UTF-8/);
    expect(await bed.ops.bytes.heldOf('a')).toBe(0);
  });

  it("counts a completed operation's result twice more (BullMQ's return value and the lane's record), and keeps the event stream short", async () => {
    // A resume's result repeats its metadata: the job holds it three times once it completes.
    const { provider } = createRecordingProvider();
    worker = await bed.startWorker(provider);
    const { jobId } = await bed.ops.enqueue({ op: 'resume', lease: lease('c', 'echo'), params: { providerLeaseId: 'echo', leaseMetadata: METADATA } });
    const accepted = await bed.ops.bytes.heldOf('c');
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('completed');
    const counted = await bed.ops.bytes.heldOf('c');
    const jobBytes = Number(await bed.redis.call('MEMORY', 'USAGE', bed.ops.queue.toKey(jobId), 'SAMPLES', '0'));
    console.log(`a completed resume with ${JSON.stringify(METADATA).length} B of metadata: its job hash holds ${jobBytes} B; counted ${accepted} B at enqueue, ${counted} B once it ended`);
    expect(counted).toBeGreaterThan(accepted);
    expect(counted).toBeGreaterThanOrEqual(jobBytes);
    // Each completion's result goes into BullMQ's event stream too: kept to 2,000 events, not 10,000.
    expect(await bed.redis.hget(bed.ops.queue.toKey('meta'), 'opts.maxLenEvents')).toBe('2000');
  }, 30_000);

  it('concurrent enqueues of a company at its budget make room from its ended records: none is refused while some are left', async () => {
    const limited = await TestBed.create({ LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_QUEUE_LIMITS: JSON.stringify({ d: { maxBytes: 400_000 } }), LEASE_OPS_KEEP_FAILED_S: '3600' });
    await worker!.close();
    await bed.close();
    bed = limited;
    const { provider } = createRecordingProvider({ behaviour: () => 'permanent' });
    worker = await bed.startWorker(provider);
    // Forty ended records of D (about 24 KB each: 960 KB, over twice its budget, so many went).
    for (let round = 0; round < 4; round++) {
      const ids = await Promise.all(Array.from({ length: 10 }, async (_, i) => (await bed.ops.enqueue({ op: 'resume', lease: lease('d', `r${round}-${i}`), params: { providerLeaseId: `r${round}-${i}`, leaseMetadata: METADATA } })).jobId));
      await bed.waitForAll(ids, 20_000);
    }
    await worker.close();
    worker = undefined;
    // Now twelve at once, with no worker: each must find room by removing ended records.
    const results = await Promise.allSettled(Array.from({ length: 12 }, (_, i) => bed.ops.enqueue({ op: 'resume', lease: lease('d', `burst-${i}`), params: { providerLeaseId: `burst-${i}`, leaseMetadata: METADATA } })));
    expect(results.filter((r) => r.status === 'rejected').map((r) => String((r as PromiseRejectedResult).reason))).toEqual([]);
    expect(await bed.ops.bytes.heldOf('d')).toBeLessThanOrEqual(400_000 + 12 * 30_000);
  }, 60_000);
});

describe("a company's Redis bytes: making room forgets before it removes (helper-31)", () => {
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create();
  });
  afterAll(async () => {
    await bed?.close();
  });

  /** Counts `entries` (id, bytes, whether its record exists) for company `company`, oldest first, as held. */
  async function counted(company: string, entries: [string, number, boolean][]): Promise<void> {
    const [heldKey, entriesKey, orderKey] = companyBytesKeys(bed.config.LEASE_OPS_PREFIX, company);
    for (const [i, [id, bytes, exists]] of entries.entries()) {
      if (exists) await bed.redis.hset(bed.ops.queue.toKey(id), 'finishedOn', '1');
      await bed.redis.hset(entriesKey, id, bytes);
      await bed.redis.zadd(orderKey, i, id);
    }
    await bed.redis.hset(heldKey, company, entries.reduce((sum, [, bytes]) => sum + bytes, 0));
  }

  it('forgets every gone job among those it reviews before it removes a record (helper-31: a failed record in its retention went)', async () => {
    // The oldest is a failed record still kept; behind it, 8 jobs already gone (removed after their retention).
    await counted('g', [['kept-failed', 10_000, true], ...Array.from({ length: 8 }, (_, i) => [`gone-${i}`, 10_000, false] as [string, number, boolean])]);
    await bed.ops.bytes.admit('g', 'g-new', 20_000, 100_000);
    expect(await bed.redis.exists(bed.ops.queue.toKey('kept-failed'))).toBe(1);
    expect(await bed.ops.bytes.heldOf('g')).toBe(10_000 + 20_000);
  });
});
