import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Cluster } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import type { Config } from '../src/config.ts';
import { laneIdOf, laneIdOfJobId } from '../src/lease.ts';
import { createLogger } from '../src/logger.ts';
import { partitionOfLane, partitionPrefixes } from '../src/partitions.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { LeaseRecords } from '../src/queues/lease-records.ts';
import { LeaseWorkers } from '../src/queues/partitioned-worker.ts';
import { LeaseWorker } from '../src/queues/worker.ts';
import { IdempotencyKeyReusedError, QueueFullError } from '../src/errors.ts';
import { layoutKey, PartitionLayoutError, UnrecordedLayoutError } from '../src/queues/layout.ts';
import { createRedis, deleteKeysUnder, type RedisClient } from '../src/queues/redis.ts';
import { lease, QUICK_RECOVERY, REDIS_URL, scanKeys, TestBed, testConfig } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';
import { enqueueInOrder, findOrderViolations, findOverlaps, readCallFile, type MixedOperation } from './helpers/invariants.ts';
import { cli } from './helpers/cli.ts';
import { startApiServer } from '../src/api/server.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));
const LEASES = 30;
const PER_LEASE = 20;
const MIX: MixedOperation[] = [
  { op: 'stop', params: (id) => ({ providerLeaseId: id }) },
  { op: 'resume', params: (id) => ({ providerLeaseId: id, leaseMetadata: {} }) },
  { op: 'destroy', params: (id) => ({ providerLeaseId: id }) },
];

// On one Redis: three partitions. In the cluster project: six, spread over its three masters.
const ON_CLUSTER = REDIS_URL.startsWith('redis+cluster://');
const N = ON_CLUSTER ? 6 : 3;
const SOME = ON_CLUSTER ? ['0-2', '3-5'] : ['0-1', '2'];

describe(`${N} partitions${ON_CLUSTER ? ' on a 3-master cluster' : ' on one Redis'}, served by workers that each serve all or some of them, one killed mid-run`, () => {
  let config: Config;
  let client: LeaseOpsClient;
  let redis: RedisClient;
  let dir: string;
  const workers: WorkerProcess[] = [];
  beforeAll(() => {
    config = testConfig({ LEASE_OPS_PARTITIONS: String(N), LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    client = new LeaseOpsClient(config);
    redis = createRedis(config.REDIS_URL);
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-partitions-'));
  });
  afterAll(async () => {
    const stopped = await Promise.allSettled(workers.map((w) => w.terminate()));
    await client.close();
    for (const prefix of [config.LEASE_OPS_PREFIX, ...partitionPrefixes(config.LEASE_OPS_PREFIX, N)]) await deleteKeysUnder(redis, prefix);
    redis.disconnect();
    rmSync(dir, { recursive: true, force: true });
    // A worker that does not stop within 20 s of SIGTERM is killed, and fails the suite. The
    // worker signalled right after it logged "worker started" sometimes did not stop; every sign
    // fits a signal that came while its early listeners were swapped for the graceful stop,
    // which Node drops (reproduced by test/signals.test.ts; exitEarlyOnSignals now hands over
    // in the order that keeps it).
    for (const s of stopped) if (s.status === 'rejected') throw s.reason;
  }, 60_000);

  it('keeps every lease\'s guarantees: no overlap, accepted order, nothing lost; each partition does its share', { timeout: 120_000 }, async () => {
    const callFile = join(dir, 'calls.jsonl');
    const env = (served: string) => ({
      REDIS_URL: config.REDIS_URL,
      LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX,
      LEASE_OPS_PARTITIONS: String(N),
      LEASE_OPS_WORKER_PARTITIONS: served,
      LEASE_OPS_PROVIDERS: PROVIDER,
      ...QUICK_RECOVERY,
      LEASE_OPS_CONCURRENCY: '10',
      RECORDING_FILE: callFile,
      RECORDING_SEED: '7',
      RECORDING_MAX_MS: '5',
      RECORDING_SETTLE_P: '0.1',
    });
    workers.push(new WorkerProcess(env('all')), ...SOME.map((served) => new WorkerProcess(env(served))));
    await Promise.all(workers.map((w) => w.ready));

    const { accepted, ids } = await enqueueInOrder(
      (op, leaseId, params) => client.enqueue(op, lease(leaseId), params),
      Array.from({ length: LEASES }, (_, l) => `p-${l}`),
      PER_LEASE,
      MIX,
    );
    // A crash mid-run: the worker serving a subset is killed once a third has ended, and
    // another takes its place.
    const killedAt = new Map<number, bigint>();
    const killing = (async () => {
      // Counted on the client's connection, up since the enqueues: overview() would open its walk
      // connection here, mid-load, and give it LEASE_OPS_REDIS_TIMEOUT_MS (2 s) to come up.
      const completed = async () => (await Promise.all(client.partitions.map((p) => p.ops.queue.getJobCounts('completed')))).reduce((n, c) => n + c.completed!, 0);
      while ((await completed()) < ids.length / 3) await new Promise((r) => setTimeout(r, 20));
      const victim = workers[1]!;
      killedAt.set(victim.pid, await victim.kill());
      workers[1] = new WorkerProcess(env(SOME[0]!));
      await workers[1].ready;
    })();
    // 600 waits start the partitions' event streams while operations end: a missed end would
    // hold its wait the whole 90 s (seen before each stream read from where it stood at creation).
    const waitsBegan = Date.now();
    const results = await Promise.all(ids.map((id) => client.waitForResult(id, 90_000)));
    expect(Date.now() - waitsBegan).toBeLessThan(45_000);
    await killing;
    expect(results.filter((r) => r.state !== 'completed')).toEqual([]);

    const calls = readCallFile(callFile);
    expect(new Set(calls.map((c) => c.jobId)).size).toBe(ids.length);
    expect(findOverlaps(calls, killedAt)).toEqual([]);
    for (const [pid, at] of killedAt) expect(calls.filter((c) => c.pid === pid && BigInt(c.start) > at)).toEqual([]);
    expect(findOrderViolations(calls, accepted)).toEqual([]);

    // Each lease's operations all went to its own partition, and every partition had some.
    const byPartition = await Promise.all(client.partitions.map((p) => p.ops.queue.getJobCounts('completed')));
    expect(byPartition.map((c) => c.completed! > 0)).toEqual(new Array(N).fill(true));
    expect(byPartition.reduce((n, c) => n + c.completed!, 0)).toBe(ids.length);
    for (const [leaseId, jobs] of accepted) {
      const home = client.partitionOf(lease(leaseId));
      for (const jobId of jobs) expect((await home.ops.queue.getJobState(jobId))).toBe('completed');
    }
    // Seen as one deployment: the overview adds the partitions up; no lane is left open.
    const overview = await client.overview();
    expect(overview.counts.completed).toBe(ids.length);
    expect(overview.openLanes).toBe(0);
    // Nothing of a lease is kept under the configured prefix itself: only the layout.
    expect(await scan(redis, `${config.LEASE_OPS_PREFIX}*`)).toEqual([`${config.LEASE_OPS_PREFIX}:partitions`]);
    if (redis instanceof Cluster) {
      // Every master holds some partitions' keys, each partition's all in one slot.
      const prefixes = partitionPrefixes(config.LEASE_OPS_PREFIX, N);
      const perMaster = await Promise.all(redis.nodes('master').map((node) => scan(node, `${config.LEASE_OPS_PREFIX.slice(0, -1)}:p*`)));
      expect(perMaster.map((keys) => keys.length > 0)).toEqual([true, true, true]);
      for (const prefix of prefixes) {
        const keys = await scan(redis, `${prefix}*`);
        expect(new Set(await Promise.all(keys.map((k) => redis.cluster('KEYSLOT', k)))).size).toBe(1);
      }
    }
  });

  it('refuses an idempotency key used again with another lease, whichever partitions the two leases are in', async () => {
    const [a, b] = ['idem-a', 'idem-b'].map((id) => lease(id));
    const other = [...Array(50).keys()].map((i) => lease(`idem-${i}`)).find((l) => client.partitionOf(l).index !== client.partitionOf(a!).index)!;
    const first = await client.enqueue('stop', a!, { providerLeaseId: 'idem-a' }, { idempotencyKey: 'same-key' });
    expect((await client.enqueue('stop', a!, { providerLeaseId: 'idem-a' }, { idempotencyKey: 'same-key' })).jobId).toBe(first.jobId);
    await expect(client.enqueue('stop', other, { providerLeaseId: other.leaseId }, { idempotencyKey: 'same-key' })).rejects.toBeInstanceOf(IdempotencyKeyReusedError);
    await expect(client.enqueue('stop', b!, { providerLeaseId: 'idem-b' }, { idempotencyKey: 'same-key' })).rejects.toBeInstanceOf(IdempotencyKeyReusedError);
    expect((await client.waitForResult(first.jobId, 30_000)).state).toBe('completed');
  });

  it('holds each partition to its share of the queue limits above one lane', () => {
    const limited = new LeaseOpsClient({ ...config, LEASE_OPS_MAX_QUEUED: 1_000, LEASE_OPS_MAX_QUEUED_PER_COMPANY: 100, LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT: 0, LEASE_OPS_MAX_QUEUED_PER_LEASE: 50 });
    try {
      const share = (n: number) => Math.ceil(n / N);
      for (const p of limited.partitions) expect(p.ops.limitsFor(lease('any'))).toEqual({ perLane: 50, perEnvironment: 0, perCompany: share(100), queued: share(1_000) });
    } finally {
      void limited.close();
    }
  });

  it('refuses a process configured with another partition count, naming both and the way to change it', async () => {
    const other = new LeaseOpsClient({ ...config, LEASE_OPS_PARTITIONS: 2 });
    try {
      const refused = other.enqueue('stop', lease('x'), { providerLeaseId: 'x' });
      await expect(refused).rejects.toBeInstanceOf(PartitionLayoutError);
      await expect(refused).rejects.toThrow(new RegExp(`holds a deployment of ${N} partition\\(s\\).*LEASE_OPS_PARTITIONS=2.*docs/scaling\\.md`));
    } finally {
      await other.close();
    }
    // The API listens, and answers /v1, the pages and the board with 503 and the code; the
    // detail (both counts, what to do) goes to its log, not to callers. (An enqueue's own
    // refusal in the lane script is covered above, through the client.)
    const token = 'layout-admin-token-0123456789';
    const api = await startApiServer(testConfig({ LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX, LEASE_OPS_PARTITIONS: '2', LEASE_OPS_API_TOKENS: token, LEASE_OPS_API_PORT: '0' }), createLogger({ level: 'silent' }));
    try {
      const bearer = { authorization: `Bearer ${token}` };
      const basic = { authorization: `Basic ${Buffer.from(`x:${token}`).toString('base64')}` };
      const answers = await Promise.all([
        fetch(`${api.url}/v1/leases/recording/co/env/x`, { headers: bearer }),
        fetch(`${api.url}/v1/attention`, { headers: bearer }),
        fetch(`${api.url}/ui/attention`, { headers: basic }),
        fetch(`${api.url}/board/api/queues`, { headers: basic }),
      ]);
      expect(answers.map((r) => r.status)).toEqual([503, 503, 503, 503]);
      for (const r of answers) expect(await r.json()).toEqual({ error: { code: 'partition_layout_mismatch', message: expect.not.stringContaining('LEASE_OPS_PARTITIONS') } });
    } finally {
      await api.close();
    }
    const worker = new WorkerProcess({ REDIS_URL: config.REDIS_URL, LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX, LEASE_OPS_PARTITIONS: '2' });
    expect(await worker.exited).toBe(2);
    expect(worker.logs.join('\n')).toMatch(/LEASE_OPS_PARTITIONS=2/);
    expect(worker.logs.join('\n')).not.toMatch(/^\s+at /m);
  });

  it('changes the count only once no partition has a worker, an open lane or a job to run', { timeout: 60_000 }, async () => {
    const env = { REDIS_URL: config.REDIS_URL, LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX };
    const shown = await cli(['partitions', '--json'], env);
    expect(shown.code).toBe(0);
    const layout = JSON.parse(shown.stdout) as { partitions: number; byPartition: { workers: number }[] };
    expect(layout.partitions).toBe(N);
    expect(layout.byPartition.map((p) => p.workers > 0)).toEqual(new Array(N).fill(true));
    const refused = await cli(['partitions', '--set', '2'], env);
    expect(refused.code).toBe(1);
    expect(refused.stderr).toContain(`not changed: ${[...Array(N).keys()].map((i) => `partition ${i}`).join(', ')} still have workers`);
    // A job queued while no worker runs holds the change back too.
    expect(await Promise.all(workers.splice(0).map((w) => w.terminate()))).toEqual([0, 0, 0]);
    const queued = await client.enqueue('stop', lease('late'), { providerLeaseId: 'late' });
    const held = await cli(['partitions', '--set', '2'], env);
    expect(held.code).toBe(1);
    expect(held.stderr).toContain(`not changed: partition ${client.partitionOf(queued.jobId).index} still has`);
    const drainer = new WorkerProcess({ ...env, LEASE_OPS_PARTITIONS: String(N), LEASE_OPS_PROVIDERS: PROVIDER, RECORDING_FILE: join(dir, 'drain.jsonl') });
    await drainer.ready;
    expect((await client.waitForResult(queued.jobId, 30_000)).state).toBe('completed');
    expect(await drainer.terminate()).toBe(0);
    const changed = await cli(['partitions', '--set', '2'], env);
    expect(changed.stderr).toBe('');
    expect(changed.code).toBe(0);
    expect(changed.stdout).toMatch(/\d -> 2\. Start every worker, API and client with LEASE_OPS_PARTITIONS=2/);
    // A producer that still maps leases the old way is refused by every partition, and leaves nothing.
    const stale = await client.enqueue('stop', lease('stale'), { providerLeaseId: 'stale' }).catch((e: unknown) => e);
    expect(stale).toBeInstanceOf(PartitionLayoutError);
    expect(await client.partitionOf(lease('stale')).ops.queue.getJobCounts('wait', 'delayed', 'active')).toEqual({ wait: 0, delayed: 0, active: 0 });
    expect((await cli(['partitions', '--set', '0x10'], env)).code).toBe(2);
    // Now the old count is refused, the new one starts.
    const old = new WorkerProcess({ ...env, LEASE_OPS_PARTITIONS: String(N) });
    expect(await old.exited).toBe(2);
    const fresh = new WorkerProcess({ ...env, LEASE_OPS_PARTITIONS: '2' });
    workers.push(fresh);
    await fresh.ready;
  });
});

const scan = async (redis: RedisClient, pattern: string) => (await scanKeys(redis, pattern)).sort();

describe('a deployment with operations of one partition and no recorded count', () => {
  it('is not given a count above one until they drain', { timeout: 30_000 }, async () => {
    const one = testConfig();
    const redis = createRedis(one.REDIS_URL);
    const client = new LeaseOpsClient(one);
    try {
      await client.enqueue('stop', lease('old'), { providerLeaseId: 'old' });
      await redis.del(layoutKey(one.LEASE_OPS_PREFIX)); // as before partitions existed, or after a loss
      const three = new LeaseOpsClient({ ...one, LEASE_OPS_PARTITIONS: 3 });
      await expect(three.enqueue('stop', lease('new'), { providerLeaseId: 'new' })).rejects.toBeInstanceOf(UnrecordedLayoutError);
      await three.close();
      const worker = new WorkerProcess({ REDIS_URL: one.REDIS_URL, LEASE_OPS_PREFIX: one.LEASE_OPS_PREFIX, LEASE_OPS_PARTITIONS: '3' });
      expect(await worker.exited).toBe(2);
      expect(worker.logs.join('\n')).toMatch(/holds operations of one partition there/);
      // Nor by a change of the count: the one-partition layout's work holds it back.
      const set = await cli(['partitions', '--set', '3'], { REDIS_URL: one.REDIS_URL, LEASE_OPS_PREFIX: one.LEASE_OPS_PREFIX, LEASE_OPS_PARTITIONS: '3' });
      expect(set.code).toBe(1);
      expect(set.stderr).toContain(`not changed: the one-partition layout under ${one.LEASE_OPS_PREFIX} still has workers, open lanes or jobs to run`);
    } finally {
      await client.close();
      for (const prefix of [one.LEASE_OPS_PREFIX, ...partitionPrefixes(one.LEASE_OPS_PREFIX, 3)]) await deleteKeysUnder(redis, prefix);
      redis.disconnect();
    }
  });
});

describe('a change of the partition count cut short (its process killed between its two steps)', () => {
  it('leaves old producers refused and new processes not admitted, and completes when run again', { timeout: 60_000 }, async () => {
    const config = testConfig({ LEASE_OPS_PARTITIONS: '3' });
    const redis = createRedis(config.REDIS_URL);
    const old = new LeaseOpsClient(config);
    const env = { REDIS_URL: config.REDIS_URL, LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX };
    try {
      await old.layoutChecked(); // records 3
      const cut = await cli(['partitions', '--set', '2'], { ...env, LEASE_OPS_FAULT_POINTS: 'partitions-after-copies=kill' });
      expect(cut.stderr).toContain('lease-ops fault point partitions-after-copies: kill');
      expect(cut.code).not.toBe(0);
      // The old count's producers are refused already; nothing of their request stays.
      await expect(old.enqueue('stop', lease('cut'), { providerLeaseId: 'cut' })).rejects.toBeInstanceOf(PartitionLayoutError);
      expect((await old.overview()).counts).toMatchObject({ queued: 0, ready: 0, running: 0 });
      // The new count is not admitted until the change completes.
      const early = new WorkerProcess({ ...env, LEASE_OPS_PARTITIONS: '2' });
      expect(await early.exited).toBe(2);
      const again = await cli(['partitions', '--set', '2'], env);
      expect(again.code).toBe(0);
      const two = new LeaseOpsClient({ ...config, LEASE_OPS_PARTITIONS: 2 });
      try {
        const { jobId } = await two.enqueue('stop', lease('after'), { providerLeaseId: 'after' });
        expect((await two.getOperation(jobId))?.state).toBe('ready');
      } finally {
        await two.close();
      }
    } finally {
      await old.close();
      for (const prefix of [config.LEASE_OPS_PREFIX, ...partitionPrefixes(config.LEASE_OPS_PREFIX, 3), ...partitionPrefixes(config.LEASE_OPS_PREFIX, 2)]) await deleteKeysUnder(redis, prefix);
      redis.disconnect();
    }
  });
});

describe('a worker given an operation whose lease belongs to another partition (one run again after the count changed)', () => {
  it('fails it with wrong_partition and never calls the provider', { timeout: 30_000 }, async () => {
    const bed = await TestBed.create();
    const recording = createRecordingProvider();
    const worker = new LeaseWorker(bed.config, new ProviderRegistry([recording.provider]), createLogger({ level: 'silent' }), { index: 0, count: 2 });
    try {
      await worker.start();
      const elsewhere = [...Array(50).keys()].map((i) => lease(`w-${i}`)).find((l) => partitionOfLane(laneIdOf(l), 2) === 1)!;
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: elsewhere, params: { providerLeaseId: elsewhere.leaseId } });
      expect((await bed.waitForAll([jobId], 10_000)).get(jobId)).toBe('failed');
      expect((await bed.ops.queue.getJob(jobId))?.failedReason).toMatch(/^wrong_partition: /);
      expect(recording.calls).toEqual([]);
    } finally {
      await worker.close();
      await bed.close();
    }
  });
});

describe('changes of the count to and from one partition, and from none recorded', () => {
  it('say what they did, and the count is what they said', { timeout: 30_000 }, async () => {
    const config = testConfig();
    const redis = createRedis(config.REDIS_URL);
    const env = { REDIS_URL: config.REDIS_URL, LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX };
    try {
      const first = await cli(['partitions', '--set', '2'], env);
      expect([first.code, first.stdout.split('\n')[0], first.stderr]).toEqual([0, 'partitions: none -> 2. Start every worker, API and client with LEASE_OPS_PARTITIONS=2.', '']);
      const back = await cli(['partitions', '--set', '1'], { ...env, LEASE_OPS_PARTITIONS: '2' });
      expect([back.code, back.stdout.split('\n')[0], back.stderr]).toEqual([0, 'partitions: 2 -> 1. Start every worker, API and client with LEASE_OPS_PARTITIONS=1.', '']);
      expect(await redis.get(layoutKey(config.LEASE_OPS_PREFIX))).toBe('1');
      // A producer of two is refused in both of its partitions now.
      const two = new LeaseOpsClient({ ...config, LEASE_OPS_PARTITIONS: 2 });
      const ones = [...Array(40).keys()].map((i) => lease(`c-${i}`));
      for (const index of [0, 1]) {
        const l = ones.find((x) => two.partitionOf(x).index === index)!;
        await expect(two.partitions[index]!.ops.enqueue({ op: 'stop', lease: l, params: { providerLeaseId: l.leaseId } })).rejects.toBeInstanceOf(PartitionLayoutError);
      }
      await two.close();
    } finally {
      for (const prefix of [config.LEASE_OPS_PREFIX, ...partitionPrefixes(config.LEASE_OPS_PREFIX, 2)]) await deleteKeysUnder(redis, prefix);
      redis.disconnect();
    }
  });
});

describe('an idempotency key whose request was refused, with two partitions', () => {
  it('is free again after a moment, as with one partition', { timeout: 30_000 }, async () => {
    const config = testConfig({ LEASE_OPS_PARTITIONS: '2', LEASE_OPS_MAX_QUEUED_PER_LEASE: '1' });
    const redis = createRedis(config.REDIS_URL);
    const client = new LeaseOpsClient(config);
    try {
      await client.enqueue('resume', lease('full'), { providerLeaseId: 'full', leaseMetadata: {} });
      await expect(client.enqueue('stop', lease('full'), { providerLeaseId: 'full' }, { idempotencyKey: 'k' })).rejects.toBeInstanceOf(QueueFullError);
      await expect(client.enqueue('stop', lease('other'), { providerLeaseId: 'other' }, { idempotencyKey: 'k' })).rejects.toBeInstanceOf(IdempotencyKeyReusedError);
      await new Promise((r) => setTimeout(r, 1_200)); // the refusal is kept a second
      const later = await client.enqueue('stop', lease('other'), { providerLeaseId: 'other' }, { idempotencyKey: 'k' });
      expect(later.deduplicated).toBeUndefined();
    } finally {
      await client.close();
      for (const prefix of [config.LEASE_OPS_PREFIX, ...partitionPrefixes(config.LEASE_OPS_PREFIX, 2)]) await deleteKeysUnder(redis, prefix);
      redis.disconnect();
    }
  });
});

describe('the watchdog, when a stuck sandbox has its lane in another partition than the record that saw it', () => {
  it('queues the force-stop in the sandbox\'s partition, where it runs', { timeout: 30_000 }, async () => {
    const config = testConfig({ LEASE_OPS_PARTITIONS: '2', LEASE_OPS_STUCK_STOPPING_MS: '300', LEASE_OPS_WATCHDOG_INTERVAL_MS: '200' });
    const redis = createRedis(config.REDIS_URL);
    const prefixes = partitionPrefixes(config.LEASE_OPS_PREFIX, 2);
    const recording = createRecordingProvider();
    const workers = new LeaseWorkers(config, new ProviderRegistry([recording.provider]), createLogger({ level: 'silent' }));
    try {
      // An acquire's lane (partition a) saw sandbox s (its own lane in partition b) stopping.
      const leases = [...Array(60).keys()].map((i) => lease(`wd-${i}`));
      const acquire = leases.find((l) => partitionOfLane(laneIdOf(l), 2) === 0)!;
      const sandbox = leases.find((l) => partitionOfLane(laneIdOf(l), 2) === 1)!;
      await new LeaseRecords(redis, prefixes[0]!).observe(laneIdOf(acquire), acquire, sandbox.leaseId, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' });
      await workers.start();
      // The force-stop runs in the sandbox's lane (it reads the sandbox first: this provider
      // says running, so it forces nothing), and nothing of it lands in the record's partition.
      const reader = new LeaseOpsClient(config);
      try {
        const forceStops = async (index: number) => (await reader.partitions[index]!.ops.queue.getJobs(['completed', 'failed'])).filter((j) => j.name === 'force-stop');
        await expect.poll(async () => (await forceStops(1)).map((j) => [laneIdOfJobId(j.id!), j.returnvalue?.forced]), { timeout: 10_000 }).toContainEqual([laneIdOf(sandbox), false]);
        expect(await forceStops(0)).toEqual([]);
      } finally {
        await reader.close();
      }
    } finally {
      await workers.close();
      for (const prefix of [config.LEASE_OPS_PREFIX, ...prefixes]) await deleteKeysUnder(redis, prefix);
      redis.disconnect();
    }
  });
});
