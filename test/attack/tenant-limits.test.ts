// Issue 12, scenario 5: one company's backlog never refuses another's operations. On 42ab3f3
// the only limits were per lease and for the whole queue, so company B's stop got 429
// queue_full behind company A's backlog.
import { afterEach, describe, expect, it } from 'vitest';
import { QueueFullError } from '../../src/errors.ts';
import { createLogger } from '../../src/logger.ts';
import { OperationsQueue } from '../../src/queues/operations-queue.ts';
import { createRedis } from '../../src/queues/redis.ts';
import type { LeaseIdentity } from '../../src/lease.ts';
import type { OperationName } from '../../src/operations.ts';
import { sweepEveryLane } from '../../src/queues/sweep.ts';
import { startTestApi } from '../helpers/api-server.ts';
import { gate, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

const TOKEN = 'adm_0123456789-limits-token';

let bed: TestBed | undefined;
afterEach(async () => {
  await bed?.close();
  bed = undefined;
});

const at = (companyId: string, environmentId: string, leaseId: string): LeaseIdentity => ({ provider: 'recording', companyId, environmentId, leaseId });

function enqueue(op: OperationName, lease: LeaseIdentity) {
  return bed!.ops.enqueue({ op, lease, params: { providerLeaseId: lease.leaseId } } as Parameters<TestBed['ops']['enqueue']>[0]);
}

/** The code it was refused with, or 'accepted'. */
async function outcome(op: OperationName, lease: LeaseIdentity): Promise<string> {
  try {
    await enqueue(op, lease);
    return 'accepted';
  } catch (error) {
    if (error instanceof QueueFullError) return error.code;
    throw error;
  }
}

/** What the counts hold per company and per environment, and whether each lane's record equals its length. */
async function counts() {
  const prefix = bed!.config.LEASE_OPS_PREFIX;
  const byCompany = await bed!.redis.hgetall(`${prefix}:queued:company`);
  const byEnvironment = await bed!.redis.hgetall(`${prefix}:queued:environment`);
  const counted = await bed!.redis.hgetall(`${prefix}:counted`);
  const lanes = await bed!.ops.lanes.allLanes();
  const lengths = Object.fromEntries(await Promise.all(lanes.map(async (laneId) => [laneId, await bed!.redis.llen(bed!.ops.lanes.listKey(laneId))] as const)));
  const recorded = Object.fromEntries(Object.entries(counted).map(([laneId, record]) => [laneId, Number(record.split('\n')[0])]));
  const sums: Record<string, number> = {};
  for (const record of Object.values(counted)) {
    const [n, company] = record.split('\n');
    sums[company!] = (sums[company!] ?? 0) + Number(n);
  }
  const numbers = (hash: Record<string, string>) => Object.fromEntries(Object.entries(hash).map(([k, v]) => [k, Number(v)]));
  return { byCompany: numbers(byCompany), byEnvironment: numbers(byEnvironment), recorded, lengths: Object.fromEntries(Object.entries(lengths).filter(([, n]) => n > 0)), sums };
}

describe('issue 12, scenario 5: limits per company and per environment, and a fair share of the queue', () => {
  it('a company past its own limit is refused (429 company_queue_full, environment_queue_full per override); another company, and force-stops, are not', async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: TOKEN,
      LEASE_OPS_MAX_QUEUED_PER_COMPANY: '10',
      LEASE_OPS_QUEUE_LIMITS: JSON.stringify({ acme: { environments: { staging: 3 } } }),
    });
    // No worker yet: everything accepted stays in its lane.
    for (let i = 0; i < 3; i++) expect(await outcome('stop', at('acme', 'staging', `s${i}`))).toBe('accepted');
    expect(await outcome('stop', at('acme', 'staging', 's3'))).toBe('environment_queue_full');
    for (let i = 0; i < 7; i++) expect(await outcome('stop', at('acme', 'prod', `p${i}`))).toBe('accepted');
    expect(await outcome('stop', at('acme', 'prod', 'p7'))).toBe('company_queue_full');
    // A force-stop has room of its own above its company's limit; another company is untouched.
    expect(await outcome('force-stop', at('acme', 'prod', 'p0'))).toBe('accepted');
    expect(await outcome('stop', at('globex', 'prod', 'g0'))).toBe('accepted');
    expect(await outcome('force-stop', at('globex', 'prod', 'g1'))).toBe('accepted');

    const api = await startTestApi(bed);
    try {
      const refused = await fetch(`${api.base}/v1/leases/recording/acme/prod/p8/operations`, {
        method: 'POST',
        headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
        body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'p8' } }),
      });
      expect(refused.status).toBe(429);
      expect(refused.headers.get('retry-after')).not.toBeNull();
      expect(((await refused.json()) as { error: { code: string; message: string } }).error).toEqual({
        code: 'company_queue_full',
        message: 'the company already has 11 operations queued (LEASE_OPS_MAX_QUEUED_PER_COMPANY)',
      });
    } finally {
      await api.close();
    }

    const held = await counts();
    expect(held.byCompany).toEqual({ acme: 11, globex: 2 });
    expect(held.byEnvironment).toEqual({ 'acme\nstaging': 3, 'acme\nprod': 8, 'globex\nprod': 2 });
    expect(held.recorded).toEqual(held.lengths);

    // Drained, nothing stays counted.
    const jobIds = (await bed.ops.queue.getJobs(['wait', 'delayed', 'active'])).map((job) => job.id!);
    await bed.startWorker(createRecordingProvider().provider);
    await bed.waitForAll(jobIds);
    await sweepEveryLane(bed.ops, createLogger({ level: 'silent' }));
    expect(await counts()).toMatchObject({ byCompany: {}, byEnvironment: {}, recorded: {} });
  });

  it("past the queue's limit a company under its fair share still gets in; a force-stop is refused only for its own company's backlog", async () => {
    bed = await TestBed.create({ LEASE_OPS_MAX_QUEUED: '20', LEASE_OPS_MAX_QUEUED_PER_COMPANY: '0' });
    const results = async (companyId: string, n: number, op: OperationName = 'stop') => {
      const seen: string[] = [];
      for (let i = 0; i < n; i++) seen.push(await outcome(op, at(companyId, 'prod', `${op}-${i}`)));
      return seen;
    };
    // A alone may fill the queue: its share is all of it.
    const a = await results('acme', 25);
    expect(a.filter((r) => r === 'accepted')).toHaveLength(20);
    expect(a.slice(20)).toEqual(Array(5).fill('queue_full'));
    // B's share is 20 / 2 and C's 20 / 3: they get in though the queue is past its limit.
    const b = await results('globex', 12);
    expect(b.filter((r) => r === 'accepted')).toHaveLength(10);
    expect(b.slice(10)).toEqual(['queue_full', 'queue_full']);
    expect((await results('initech', 8)).filter((r) => r === 'accepted')).toHaveLength(6);
    // Force-stops of every company still get in: A's too, within the room above the limit.
    expect(await results('globex', 3, 'force-stop')).toEqual(['accepted', 'accepted', 'accepted']);
    expect(await results('acme', 3, 'force-stop')).toEqual(['accepted', 'accepted', 'accepted']);
    expect((await counts()).byCompany).toEqual({ acme: 23, globex: 13, initech: 6 });
    // Found by the attack: A spending the room above the limit on force-stops (queued 42 ->
    // 120) then refused a company holding nothing. Past the room A's are refused; D gets in.
    const more = await results('acme', 90, 'force-stop');
    expect(more.filter((r) => r === 'queue_full').length).toBeGreaterThan(0);
    expect(await outcome('stop', at('umbrella', 'prod', 'u0'))).toBe('accepted');
    expect(await outcome('stop', at('acme', 'prod', 'one-more'))).toBe('queue_full');
  });

  it('the counts follow the lanes through every way a job leaves: done, failed, retried, removed by an operator, absorbed, dropped by the sweep', { timeout: 60_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_MAX_QUEUED_PER_COMPANY: '1000' });
    const held = gate<void>();
    const { provider } = createRecordingProvider({
      behaviour: async ({ ctx }) => {
        if (ctx.lease.leaseId.startsWith('hold')) await held.promise;
        if (ctx.lease.leaseId.startsWith('fail')) return 'permanent';
        if (ctx.lease.leaseId.startsWith('retry') && ctx.attempt < 3) return 'settling';
        return 'ok';
      },
    });
    // Queued with no worker: the counts are the lanes' lengths.
    const ids: string[] = [];
    for (const company of ['acme', 'globex']) {
      for (const leaseId of ['hold-1', 'fail-1', 'retry-1', 'ok-1']) {
        for (const op of ['stop', 'destroy', 'stop'] as const) ids.push((await enqueue(op, at(company, 'prod', leaseId))).jobId);
      }
      // Goes to the front on its own: the queued stop is behind a destroy, where it keeps its place.
      ids.push((await enqueue('force-stop', at(company, 'prod', 'ok-1'))).jobId);
    }
    let now = await counts();
    expect(now.recorded).toEqual(now.lengths);
    expect(now.byCompany).toEqual(now.sums);
    expect(now.byCompany).toEqual({ acme: 13, globex: 13 });

    // An operator removes two parked jobs in BullMQ: the lane drops them when it reaches them.
    const parked = (await bed.ops.queue.getJobs(['delayed'])).filter((job) => job.data.lease.leaseId === 'ok-1' && job.name === 'destroy');
    expect(parked).toHaveLength(2);
    for (const job of parked) await job.remove();
    await bed.startWorker(provider);
    const settled = ids.filter((id) => !parked.some((job) => job.id === id));
    const holding = settled.filter((id) => ids.indexOf(id) % 13 < 3); // the hold-1 lanes
    await bed.waitForAll(settled.filter((id) => !holding.includes(id)));
    await sweepEveryLane(bed.ops, createLogger({ level: 'silent' }));
    now = await counts();
    expect(now.byCompany).toEqual({ acme: 3, globex: 3 }); // the held lanes
    expect(now.recorded).toEqual(now.lengths);

    // A failed job an operator retries joins its lane again, counted.
    const failed = (await bed.ops.queue.getJobs(['failed'])).find((job) => job.data.lease.companyId === 'acme')!;
    expect(failed).toBeDefined();
    await failed.retry();
    expect((await bed.waitForAll([failed.id!])).get(failed.id!)).toBe('failed');
    held.open();
    await bed.waitForAll(holding);
    await sweepEveryLane(bed.ops, createLogger({ level: 'silent' }));
    expect(await counts()).toMatchObject({ byCompany: {}, byEnvironment: {}, recorded: {} });
  });

  it('retries racing under one idempotency key at a full environment: all refused, or all answered with one job that exists in its lane; the limit holds', { timeout: 60_000 }, async () => {
    // Found by the attack on this change: a retry finishing the enqueue (adopting its job)
    // pushed it past the limits while the first request, refused, removed the job: 202s for
    // operations that did not exist, and the environment's count at three times its limit.
    bed = await TestBed.create({ LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT: '5' });
    const producers = Array.from({ length: 8 }, () => new OperationsQueue(createRedis(bed!.config.REDIS_URL), bed!.config));
    try {
      for (let i = 0; i < 5; i++) await enqueue('stop', at('acme', 'prod', `fill-${i}`));
      for (let round = 0; round < 30; round++) {
        const lease = at('acme', 'prod', `race-${round}`);
        const answers = await Promise.all(
          producers.map((ops) =>
            ops.enqueue({ op: 'destroy', lease, params: { providerLeaseId: lease.leaseId }, idempotencyKey: `race-${round}` }).then(
              (r) => r.jobId,
              (e: unknown) => (e instanceof QueueFullError ? e.code : Promise.reject(e)),
            ),
          ),
        );
        // All refused, and for what is full (the second attack saw queue_full, count 0).
        expect({ round, answers }).toEqual({ round, answers: answers.map(() => 'environment_queue_full') });
      }
      // And nothing of theirs stayed behind: the second attack found jobs stored again by a
      // request after another had taken them back, in no lane, parked for 24 h.
      expect((await bed.ops.queue.getJobs(['wait', 'delayed'])).map((job) => job.data.lease.leaseId).sort()).toEqual(['fill-0', 'fill-1', 'fill-2', 'fill-3', 'fill-4']);
      const held = await counts();
      expect(held.byEnvironment).toEqual({ 'acme\nprod': 5 });
      expect(held.recorded).toEqual(held.lengths);
      // Room again: the three retries get one job, which exists and is in its lane.
      const jobIds = (await bed.ops.queue.getJobs(['wait', 'delayed'])).map((job) => job.id!);
      await bed.startWorker(createRecordingProvider().provider);
      await bed.waitForAll(jobIds);
      const lease = at('acme', 'prod', 'after');
      const answers = await Promise.all(producers.map((ops) => ops.enqueue({ op: 'destroy', lease, params: { providerLeaseId: 'after' }, idempotencyKey: 'after' })));
      expect(new Set(answers.map((a) => a.jobId)).size).toBe(1);
      expect(await bed.ops.queue.getJob(answers[0]!.jobId)).toBeDefined();
      expect((await bed.waitForAll([answers[0]!.jobId])).get(answers[0]!.jobId)).toBe('completed');
    } finally {
      await Promise.all(producers.map(async (ops) => (await ops.close(), ops.connection.disconnect())));
    }
  });

  it('a waiting job an operator removes in Bull Board stops counting at once (second attack: the quota came back only when the head ended)', { timeout: 30_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_MAX_QUEUED_PER_LEASE: '3', LEASE_OPS_BOARD_READ_ONLY: 'false' });
    const lease = at('acme', 'prod', 'k3');
    const jobs = [];
    for (const op of ['stop', 'resume', 'destroy'] as const) jobs.push((await bed.ops.enqueue({ op, lease, params: { providerLeaseId: 'k3' } } as Parameters<TestBed['ops']['enqueue']>[0])).jobId);
    expect(await outcome('stop', lease)).toBe('lease_queue_full');
    const api = await startTestApi(bed);
    try {
      for (const jobId of jobs.slice(1)) {
        const res = await fetch(`${api.base}/board/api/queues/${bed.config.LEASE_OPS_QUEUE}/${jobId}/clean`, {
          method: 'PUT',
          headers: { authorization: `Basic ${Buffer.from(`op:${TOKEN}`).toString('base64')}`, origin: api.base },
        });
        expect(res.status).toBe(204);
      }
      // The repair runs once the board has answered.
      for (let i = 0; i < 100 && (await counts()).byCompany.acme !== 1; i++) await new Promise((r) => setTimeout(r, 20));
      const now = await counts();
      expect(now.byCompany).toEqual({ acme: 1 });
      expect(now.lengths).toEqual(now.recorded);
      expect(await outcome('stop', lease)).toBe('accepted');
    } finally {
      await api.close();
    }
  });
});
