// A third independent attack, on the lane's recovery paths (an operator's removal repaired at
// once, backing-off lanes dated when their retry comes due, providers announced by workers).
// Each case failed on the code it attacked.
import { Job } from 'bullmq';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { board, startTestApi, type TestApi } from '../helpers/api-server.ts';
import { gate, lease, readUntil, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

const target = (id: string) => ({ providerLeaseId: id });

describe('a bulk clean in Bull Board with more than a page (500) of other open lanes', () => {
  const ADMIN = 'board-admin-token-0123456789';
  let bed: TestBed;
  let api: TestApi;
  const held = gate();
  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: ADMIN,
      LEASE_OPS_BOARD_READ_ONLY: 'false',
      LEASE_OPS_SWEEP_INTERVAL_MS: '1000',
      LEASE_OPS_SWEEP_STALE_MS: '1000',
      LEASE_OPS_BACKOFF_BASE_MS: '20000',
      LEASE_OPS_BACKOFF_CAP_MS: '20000',
      LEASE_OPS_CONCURRENCY: '5',
    });
    // Stops back off for 20 s; destroys hang until the end (busy, healthy lanes).
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ op }) => (op === 'stop' ? 'settling' : (await held.promise, 'ok' as const)) }).provider);
    api = await startTestApi(bed);
    // The API's repair after a clean, watched: how many of its lane steps are in flight, what
    // each lane step is asked, and a hook a test may set. A repair runs after the clean's
    // reply, and a test waits for the one before it to end (nothing in flight) before its own.
    const lanes = api.client.partitions[0]!.ops.lanes;
    const [forget, repairMany, allLanes] = [lanes.forgetRemoved.bind(lanes), lanes.repairMany.bind(lanes), lanes.allLanes.bind(lanes)];
    const watched = <A extends unknown[], R>(call: (...args: A) => Promise<R>, seen?: (...args: A) => void) => async (...args: A): Promise<R> => {
      repair.busy++;
      seen?.(...args);
      try {
        return await call(...args);
      } finally {
        repair.busy--;
      }
    };
    lanes.forgetRemoved = watched(async (laneId: string, jobId?: string) => {
      repair.forgetsInFlight++;
      repair.most = Math.max(repair.most, repair.forgetsInFlight);
      try {
        if (repair.failLane === laneId) throw new Error('Command timed out');
        return await forget(laneId, jobId);
      } finally {
        repair.forgetsInFlight--;
        repair.forgotten.add(laneId);
      }
    });
    lanes.repairMany = watched(repairMany, (laneIds) => (repair.repaired += laneIds.length));
    lanes.allLanes = watched(allLanes);
  });
  const repair = { busy: 0, forgetsInFlight: 0, most: 0, forgotten: new Set<string>(), repaired: 0, failLane: '' };
  /** Waits for the API's repairs to end, then counts afresh. */
  const nextRepair = async () => {
    await readUntil(async () => repair.busy === 0, 30_000, 'the repair before to end');
    Object.assign(repair, { most: 0, forgotten: new Set<string>(), repaired: 0, failLane: '' });
  };
  afterAll(async () => {
    held.open();
    await api.close();
    await bed.close();
  });

  it('reaches the lanes whose backing-off heads it cleaned: a new operation there goes on at once (was 18.7 s)', { timeout: 60_000 }, async () => {
    const startedAt = Date.now();
    await Promise.all(Array.from({ length: 5 }, (_, i) => bed.ops.enqueue({ op: 'stop', lease: lease(`bo-${i}`), params: target(`bo-${i}`), deadlineMs: 110_000 })));
    await readUntil(async () => (await bed.redis.zcard(bed.ops.lanes.backingOffKey)) === 5, 10_000, 'the heads backing off');
    for (let i = 0; i < 520; i += 100) {
      await Promise.all(Array.from({ length: Math.min(100, 520 - i) }, (_, j) => bed.ops.enqueue({ op: 'destroy', lease: lease(`busy-${i + j}`), params: target(`busy-${i + j}`) })));
    }
    // Bull Board cleans only jobs older than 5 s.
    await readUntil(async () => Date.now() > startedAt + 5_200, 10_000, 'the jobs 5 s old');
    const cleanedAt = Date.now();
    expect(await board.clean(api, ADMIN, bed.config.LEASE_OPS_QUEUE, 'delayed')).toBe(200);
    const after = await bed.ops.enqueue({ op: 'stop', lease: lease('bo-0'), params: target('bo-0') });
    await readUntil(async () => !['delayed', 'unknown'].includes(await bed.ops.queue.getJobState(after.jobId)), 20_000, 'the new operation handed off');
    expect(Date.now() - cleanedAt).toBeLessThan(3_000);
  });

  it('forgets the removed jobs of its lanes several lanes at a time, not one round trip after another (beside four busy loops, the test above saw no hand-off within 20 s)', { timeout: 60_000 }, async () => {
    await nextRepair();
    expect(await board.clean(api, ADMIN, bed.config.LEASE_OPS_QUEUE, 'delayed')).toBe(200);
    await readUntil(async () => repair.busy === 0, 30_000, 'the repair to end');
    expect(repair.forgotten.size).toBeGreaterThan(500);
    expect(repair.repaired).toBeGreaterThan(500);
    // Several at once; a few, not hundreds: Redis runs them back to back on the API's own connection.
    expect(repair.most).toBeGreaterThanOrEqual(10);
    expect(repair.most).toBeLessThanOrEqual(40);
  });

  it('a lane that fails to forget its removed jobs stops neither the other lanes nor the repair after them (helper-42: a timeout abandoned them all)', { timeout: 60_000 }, async () => {
    await nextRepair();
    const all = await api.client.partitions[0]!.ops.lanes.allLanes();
    repair.failLane = all[0]!;
    expect(await board.clean(api, ADMIN, bed.config.LEASE_OPS_QUEUE, 'delayed')).toBe(200);
    await readUntil(async () => repair.busy === 0, 30_000, 'the repair to end');
    // Every lane asked (the failing one first), and every lane repaired after.
    expect(all.filter((laneId) => !repair.forgotten.has(laneId))).toEqual([]);
    expect(repair.repaired).toBeGreaterThanOrEqual(all.length - 5);
  });
});

describe('a lane dated when its retry comes due, and a force-stop gone ahead of it', () => {
  let bed: TestBed;
  const provider = () => createRecordingProvider({ behaviour: ({ op }) => (op === 'stop' ? 'settling' : 'ok') }).provider;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_SWEEP_INTERVAL_MS: '1000', LEASE_OPS_SWEEP_STALE_MS: '1000', LEASE_OPS_BACKOFF_BASE_MS: '30000', LEASE_OPS_BACKOFF_CAP_MS: '30000' });
  });
  afterAll(() => bed.close());

  it('that force-stop lost unannounced (removed while no worker listened): the next runs within the sweep bound (was 29 s)', { timeout: 60_000 }, async () => {
    const first = await bed.startWorker(provider());
    const head = await bed.ops.enqueue({ op: 'stop', lease: lease('L'), params: target('L'), deadlineMs: 110_000 });
    await readUntil(async () => (await bed.redis.zscore(bed.ops.lanes.backingOffKey, head.jobId)) !== null, 10_000, 'the head backing off');
    await first.close(); // a deploy: no worker, so nobody hears the removal below
    const f1 = await bed.ops.enqueue({ op: 'force-stop', lease: lease('L'), params: target('L') });
    const f2 = await bed.ops.enqueue({ op: 'force-stop', lease: lease('L'), params: target('L') });
    expect(f2.jobId).not.toBe(f1.jobId);
    await (await Job.fromId(bed.ops.queue, f1.jobId))!.remove();
    const lostAt = Date.now();
    await bed.startWorker(provider());
    expect((await bed.waitForAll([f2.jobId], 20_000)).get(f2.jobId)).toBe('completed');
    expect(Date.now() - lostAt).toBeLessThan(1_000 + 1_000 + 1_500);
  });
});

describe('unknown_provider refuses no legitimate request', () => {
  const TOKEN = 'adm_0123456789-secret-token';
  let bed: TestBed;
  let api: TestApi;
  const post = (provider: string, key?: string) =>
    fetch(`${api.base}/v1/leases/${provider}/co/env/l/operations`, {
      method: 'POST',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', ...(key ? { 'idempotency-key': key } : {}) },
      body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'l' } }),
    });
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_SWEEP_INTERVAL_MS: '5000', LEASE_OPS_SWEEP_STALE_MS: '10000' });
    api = await startTestApi(bed);
  });
  afterAll(async () => {
    await api.close();
    await bed.close();
  });

  it('before any worker said what it serves, a request is taken', async () => {
    expect((await post('recording')).status).toBe(202);
  });

  it('after Redis lost what the workers said: taken again at once, and a request accepted under its key gets its receipt', { timeout: 20_000 }, async () => {
    await bed.startWorker(createRecordingProvider({ name: 'recording' }).provider);
    const first = await post('recording', 'key-1');
    expect(first.status).toBe(202);
    const { jobId } = (await first.json()) as { jobId: string };
    await bed.redis.del(bed.ops.providersKey); // what a restart without persistence leaves
    const retry = await post('recording', 'key-1');
    expect(retry.status).toBe(202);
    expect(((await retry.json()) as { jobId: string }).jobId).toBe(jobId);
    expect((await post('recording')).status).toBe(202);
    // Once the workers said it again, a typo is refused; a repeat under its key still is not.
    await readUntil(async () => (await bed.ops.announcedProviders()).length > 0, 10_000, 'the worker saying it again');
    expect((await post('recordin')).status).toBe(422);
    expect((await post('recording', 'key-1')).status).toBe(202);
  });
});
