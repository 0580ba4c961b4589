import { Queue } from 'bullmq';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../../src/providers/daytona/index.ts';
import { createRedis, type RedisClient } from '../../src/queues/redis.ts';
import type { LeaseWorker } from '../../src/queues/worker.ts';
import { LeaseOpsClient } from '../../src/client.ts';
import { board, startTestApi, type TestApi } from '../helpers/api-server.ts';
import { gate, lease, readUntil, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';
import { RedisProcess } from '../helpers/redis-process.ts';

const target = (id: string) => ({ providerLeaseId: id });

/** Delayed and not parked: its retry's backoff. */
async function backingOff(bed: TestBed, jobId: string): Promise<boolean> {
  return (await bed.ops.queue.getJobState(jobId)) === 'delayed' && !(await bed.redis.hexists(bed.ops.queue.toKey(jobId), 'lo:parked'));
}

/**
 * Enqueues a lane of two operations whose head then backs off for long; then the head's job
 * vanishes without BullMQ's `removed` event (deleted by hand) and its retry is overdue (the
 * lane's progress set to long ago), so only the sweep can set the lane going.
 */
async function laneWithRemovedHead(bed: TestBed, leaseId: string): Promise<{ next: string; removedAt: number }> {
  const head = await bed.ops.enqueue({ op: 'stop', lease: lease(leaseId), params: target(leaseId) });
  const next = await bed.ops.enqueue({ op: 'destroy', lease: lease(leaseId), params: target(leaseId) });
  await readUntil(() => backingOff(bed, head.jobId), 10_000, 'the head backing off');
  await bed.redis
    .multi()
    .del(bed.ops.queue.toKey(head.jobId))
    .zrem(bed.ops.queue.toKey('delayed'), head.jobId)
    .zadd(bed.ops.lanes.lanesKey, 'XX', 0, head.laneId)
    .exec();
  return { next: next.jobId, removedAt: Date.now() };
}

/** A provider whose stops back off (settling) and everything else succeeds. */
const stopsBackOff = () => createRecordingProvider({ behaviour: ({ op }) => (op === 'stop' ? 'settling' : 'ok') }).provider;

describe('scenario 7: one sweep pass covers every quiet lane', () => {
  const INTERVAL = 2_000;
  let bed: TestBed;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_SWEEP_INTERVAL_MS: String(INTERVAL), LEASE_OPS_SWEEP_STALE_MS: '200' });
  });
  afterAll(() => bed.close());

  it('a lane whose head was removed, behind 2,100 quiet healthy lanes, goes on within one sweep interval', async () => {
    // Healthy quiet lanes: each one's head is ready, in a paused queue, so it stays there.
    await bed.ops.queue.pause();
    await bed.startWorker(createRecordingProvider().provider);
    const fillers = Array.from({ length: 2_100 }, (_, i) => `quiet-${i}`);
    for (let i = 0; i < fillers.length; i += 100) {
      await Promise.all(fillers.slice(i, i + 100).map((id) => bed.ops.enqueue({ op: 'destroy', lease: lease(id), params: target(id) })));
    }
    // Last, so its lane is the newest of all: a sweep reading the oldest 500 per pass reaches it on its fifth.
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('blocked'), params: target('blocked') });
    const next = await bed.ops.enqueue({ op: 'destroy', lease: lease('blocked'), params: target('blocked') });
    // Gone without BullMQ's `removed` event (deleted by hand): only the sweep can notice.
    await bed.redis.multi().del(bed.ops.queue.toKey(head.jobId)).zrem(bed.ops.queue.toKey('delayed'), head.jobId).exec();
    const removedAt = Date.now();
    await readUntil(async () => (await bed.ops.queue.getJobState(next.jobId)) === 'waiting', 20_000, 'the next operation handed off');
    const waited = Date.now() - removedAt;
    // The next pass starts within one interval; the pass itself reads 2,101 lanes.
    expect(waited).toBeLessThan(INTERVAL + 1_500);
    expect((await bed.ops.lanes.view(next.laneId)).jobs).toEqual([next.jobId]);
  });
});

describe('scenario 7: a lane whose head an operator removes in Bull Board goes on at once, however many lanes are open', () => {
  const ADMIN = 'board-admin-token-0123456789';
  let bed: TestBed;
  let api: TestApi;
  beforeAll(async () => {
    // A sweep far away, and stops that back off for a minute: only the removal itself can
    // set a lane going.
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: ADMIN,
      LEASE_OPS_BOARD_READ_ONLY: 'false',
      LEASE_OPS_SWEEP_INTERVAL_MS: '60000',
      LEASE_OPS_SWEEP_STALE_MS: '60000',
      LEASE_OPS_BACKOFF_BASE_MS: '60000',
      LEASE_OPS_BACKOFF_CAP_MS: '60000',
    });
    await bed.startWorker(stopsBackOff());
    api = await startTestApi(bed);
  });
  afterAll(async () => {
    await api.close();
    await bed.close();
  });

  it('a backing-off head removed behind 2,100 open lanes: its next operation runs within a second', async () => {
    for (let i = 0; i < 2_100; i += 100) {
      await Promise.all(Array.from({ length: 100 }, (_, j) => bed.ops.enqueue({ op: 'stop', lease: lease(`open-${i + j}`), params: target(`open-${i + j}`) })));
    }
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('removed-head'), params: target('removed-head') });
    const next = await bed.ops.enqueue({ op: 'destroy', lease: lease('removed-head'), params: target('removed-head') });
    await readUntil(() => backingOff(bed, head.jobId), 20_000, 'the head backing off');
    const removedAt = Date.now();
    expect(await board.remove(api, ADMIN, bed.config.LEASE_OPS_QUEUE, head.jobId)).toBe(204);
    expect((await bed.waitForAll([next.jobId], 5_000)).get(next.jobId)).toBe('completed');
    // At once, not at the sweep (60 s here): 3 s is room for a loaded machine (a CI run took 1,001 ms).
    expect(Date.now() - removedAt).toBeLessThan(3_000);
    // The removal is on the lease's timeline (appended without waiting: read until it lands).
    const removal = await readUntil(async () => (await bed.ops.history.read(head.laneId)).find((e) => e.kind === 'removed'), 5_000, 'the removal recorded');
    expect(removal).toMatchObject({ jobId: head.jobId, message: 'removed by an operator in Bull Board' });
  });

  it('delayed jobs cleaned in bulk (a backing-off head and the one parked behind it): a new operation of that lease runs within a second', async () => {
    const startedAt = Date.now();
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('cleaned'), params: target('cleaned') });
    await bed.ops.enqueue({ op: 'destroy', lease: lease('cleaned'), params: target('cleaned') });
    await readUntil(() => backingOff(bed, head.jobId), 10_000, 'the head backing off');
    // Bull Board cleans only jobs older than 5 s.
    await readUntil(async () => Date.now() > startedAt + 5_200, 10_000, 'the jobs 5 s old');
    expect(await board.clean(api, ADMIN, bed.config.LEASE_OPS_QUEUE, 'delayed')).toBe(200);
    await readUntil(async () => (await bed.ops.lanes.view(head.laneId)).jobs.length === 0, 5_000, 'the lane emptied');
    // Timed from its enqueue: what is bounded is the new operation's wait, not the board's request.
    const enqueuedAt = Date.now();
    const after = await bed.ops.enqueue({ op: 'destroy', lease: lease('cleaned'), params: target('cleaned') });
    expect((await bed.waitForAll([after.jobId], 5_000)).get(after.jobId)).toBe('completed');
    expect(Date.now() - enqueuedAt).toBeLessThan(2_000);
  });
});

describe('scenario 7: attention names blocked lanes, and only those', () => {
  let bed: TestBed;
  let client: LeaseOpsClient;
  const held = gate();
  const stopSent = gate();
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_SWEEP_INTERVAL_MS: '200', LEASE_OPS_SWEEP_STALE_MS: '200', LEASE_OPS_BACKOFF_BASE_MS: '60000', LEASE_OPS_BACKOFF_CAP_MS: '60000' });
    client = new LeaseOpsClient(bed.config);
    // Stops hang (a provider call that ignores its deadline); destroys back off for long.
    const behaviour = async ({ op }: { op: string }) => (op === 'stop' ? (stopSent.open(), await held.promise, 'ok' as const) : 'settling' as const);
    await bed.startWorker(createRecordingProvider({ behaviour }).provider);
  });
  afterAll(async () => {
    held.open();
    await client.close();
    await bed.close();
  });

  it('a head running past its deadline is listed as blocked; 300 lanes quietly backing off are not', { timeout: 120_000 }, async () => {
    // The stop goes first and is waited for at its provider call: a stop picked up after its
    // deadline fails at once instead of running past it (a loaded machine took > 300 ms). The
    // waits below (every destroy backing off, then 2 s) take it past its deadline.
    const overdue = await bed.ops.enqueue({ op: 'stop', lease: lease('overdue'), params: target('overdue'), deadlineMs: 2_000 });
    await stopSent.promise;
    const quiet = await Promise.all(Array.from({ length: 300 }, (_, i) => bed.ops.enqueue({ op: 'destroy', lease: lease(`backing-off-${i}`), params: target(`backing-off-${i}`), deadlineMs: 600_000 })));
    // Each destroy, once backing off, stays so for its 60 s backoff: each round asks only the
    // ones not yet seen backing off, and pauses, so the reads do not starve the worker that
    // shares this process (a whole-set read in a tight loop missed 10 s on a loaded machine).
    let pending = quiet.map((q) => q.jobId);
    await readUntil(async () => {
      const seen = await Promise.all(pending.map((id) => backingOff(bed, id)));
      pending = pending.filter((_, i) => !seen[i]);
      if (pending.length) await new Promise((r) => setTimeout(r, 50));
      return pending.length === 0;
    // 3-5 s here, alone or beside three busy loops; a CI run on a slow day (2026-12-07, 524 s)
    // missed 30 s, and a full run beside two busy loops 90 s (not explained: alone beside them it
    // passes in seconds). Where the ones left stand is said when it fails.
    }, 90_000, 'every destroy backing off').catch(async (err: Error) => {
      const where: Record<string, number> = {};
      for (const id of pending) {
        const state = `${await bed.ops.queue.getJobState(id)}${(await bed.redis.hexists(bed.ops.queue.toKey(id), 'lo:parked')) ? ' (parked)' : ''}`;
        where[state] = (where[state] ?? 0) + 1;
      }
      const lane = pending[0] ? await bed.ops.lanes.view(quiet.find((q) => q.jobId === pending[0])!.laneId) : null;
      throw new Error(`${err.message}: ${pending.length} not, by state ${JSON.stringify(where)}; the first one's lane ${JSON.stringify(lane)}`);
    });
    // Long past twice the sweep bound (2 × (stale + interval) = 800 ms), every lane here is
    // quiet: the backing-off ones are healthy, and the sweep keeps marking them seen.
    const quietSince = Date.now();
    await readUntil(async () => Date.now() > quietSince + 2_000, 5_000, 'time passing');
    const items = await readUntil(async () => {
      const all = await client.leasesNeedingAttention();
      return all.some((item) => item.reason === 'blocked') && all;
    }, 10_000, 'the overdue stop listed');
    expect(items.filter((item) => item.reason === 'blocked').map((item) => [item.laneId, item.detail])).toEqual([
      [overdue.laneId, `stop ${overdue.jobId} is still running past its deadline`],
    ]);
  });
});

describe('scenario 8: the sweep never waits behind the watchdog, and the watchdog never waits on a sandbox', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_STUCK_STOPPING_MS: '300', LEASE_OPS_WATCHDOG_INTERVAL_MS: '100', LEASE_OPS_BACKOFF_BASE_MS: '3000', LEASE_OPS_BACKOFF_CAP_MS: '3000' });
    fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 10, stop: 10, forceStop: 0, destroy: 10 } });
    const daytona = createDaytonaProvider({ apiUrl: await fake.listen(), apiKey: 'k', rateLimits: { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null } });
    await bed.startWorker(daytona, stopsBackOff());
  });
  afterAll(async () => {
    await fake.close(); // first: its slow replies would hold the workers' close
    await bed.close();
  });

  it('with two stuck sandboxes that answer after 10 s, a lane whose head was removed goes on within the sweep bound', async () => {
    for (const name of ['slow-1', 'slow-2']) {
      const daytonaLease = { provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId: name };
      const acquired = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease, params: { runId: name } });
      await bed.waitForAll([acquired.jobId]);
      const id = ((await bed.ops.queue.getJob(acquired.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
      fake.control(id, { stuckStoppingMs: 600_000 });
      const stop = await bed.ops.enqueue({ op: 'stop', lease: { ...daytonaLease, leaseId: id }, params: target(id) });
      // Seen stopping (recorded), then slow for everyone from here on.
      await readUntil(() => backingOff(bed, stop.jobId), 10_000, 'the stop backing off');
      fake.control(id, { replyDelayMs: 10_000 });
    }
    // The watchdog has both to look at, and each force-stop it queues takes 10 s in its own lane.
    const { next, removedAt } = await laneWithRemovedHead(bed, 'behind-removed');
    await readUntil(async () => (await bed.ops.queue.getJobState(next)) === 'completed', 10_000, 'the next operation completed');
    // Sweep interval + quiet time (300 + 300 ms in tests) + the operation's own run.
    expect(Date.now() - removedAt).toBeLessThan(1_500);
    expect(fake.http.overlaps()).toEqual([]);
  });
});

describe('scenario 10: after Redis loses its data, the maintenance schedules come back and readiness says so meanwhile', () => {
  let redis: RedisProcess;
  let admin: RedisClient;
  let bed: TestBed;
  let worker: LeaseWorker;
  let maintenance: Queue;
  beforeAll(async () => {
    redis = await RedisProcess.start();
    admin = createRedis(redis.url);
    bed = await TestBed.create({ REDIS_URL: redis.url, LEASE_OPS_BACKOFF_BASE_MS: '60000', LEASE_OPS_BACKOFF_CAP_MS: '60000' });
    worker = await bed.startWorker(stopsBackOff());
    maintenance = new Queue(`${bed.config.LEASE_OPS_QUEUE}-maintenance`, { connection: createRedis(redis.url), prefix: bed.config.LEASE_OPS_PREFIX });
  });
  afterAll(async () => {
    await admin.config('SET', 'min-replicas-to-write', '0').catch(() => undefined);
    await maintenance.close();
    await bed.close();
    admin.disconnect();
    await redis.stop();
  });

  const schedules = async () => (await maintenance.getJobSchedulers()).map((s) => s.key).sort();

  it('re-creates the sweep and watchdog schedules, is not ready while it cannot, and the sweep repairs lanes again', async () => {
    expect(await schedules()).toEqual(['lane-sweep', 'stuck-stop-watchdog']);
    expect(await worker.ready()).toBe(true);

    // The data goes (a restart without persistence), and for a while Redis takes no writes.
    await admin.multi().flushall().config('SET', 'min-replicas-to-write', '1').exec();
    await readUntil(async () => !(await worker.ready()), 10_000, 'the worker reporting not ready');
    expect(await schedules()).toEqual([]);

    await admin.config('SET', 'min-replicas-to-write', '0');
    await readUntil(async () => (await schedules()).length === 2 && (await worker.ready()), 10_000, 'the schedules back and the worker ready');
    expect(await schedules()).toEqual(['lane-sweep', 'stuck-stop-watchdog']);

    // And they run: a lane whose head an operator removed goes on.
    const { next } = await laneWithRemovedHead(bed, 'after-loss');
    expect((await bed.waitForAll([next], 10_000)).get(next)).toBe('completed');
  });
});
