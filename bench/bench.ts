import { fork, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { loadConfig, type Config } from '../src/config.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { buildJobData, OperationsQueue } from '../src/queues/operations-queue.ts';
import { createRedis, deleteKeysUnder } from '../src/queues/redis.ts';
import { REAL_TIMING, scenario } from '../src/demo.ts';

const WORKERS = 2;
const CONCURRENCY = 50;
const out = (line: string) => process.stderr.write(`${line}\n`);

interface Figures {
  lanes_ops_per_s: number;
  plain_bullmq_jobs_per_s: number;
  ratio_vs_plain: number;
  hot_lease_ops_per_s: number;
  hot_lease_one_worker_ops_per_s: number;
  handoff_one_worker_p50_ms: number;
  handoff_p50_ms: number;
  handoff_p99_ms: number;
  many_leases_ops_per_s: number;
  redis_memory_before_bytes: number;
  redis_memory_after_bytes: number;
  redis_keys_before: number;
  redis_keys_after: number;
  stuck_stop_recovery_s: number;
  lane_keys_left: number;
  loads: Record<string, number>;
}

function benchConfig(prefix: string): Config {
  return loadConfig({
    ...process.env,
    LEASE_OPS_PREFIX: prefix,
    LEASE_OPS_CONCURRENCY: String(CONCURRENCY),
    LEASE_OPS_KEEP_COMPLETED_S: '0',
    LEASE_OPS_LOG_LEVEL: 'warn',
    // One hot lease holds 2,000 queued operations; (d) puts 100,000 in the queue.
    LEASE_OPS_MAX_QUEUED_PER_LEASE: '0',
    LEASE_OPS_MAX_QUEUED: '0',
  });
}

async function startWorkers(mode: 'plain' | 'lanes', config: Config, count = WORKERS): Promise<ChildProcess[]> {
  const env = {
    ...process.env,
    REDIS_URL: config.REDIS_URL,
    LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX,
    LEASE_OPS_CONCURRENCY: String(CONCURRENCY),
    LEASE_OPS_KEEP_COMPLETED_S: '0',
  };
  const children = Array.from({ length: count }, () =>
    fork(new URL('./worker-child.ts', import.meta.url).pathname, [mode], { env, execArgv: ['--import', 'tsx'] }),
  );
  await Promise.all(children.map((c) => once(c, 'message')));
  return children;
}

async function stopWorkers(children: ChildProcess[]): Promise<void> {
  await Promise.all(
    children.map(async (c) => {
      c.send('stop');
      await once(c, 'exit');
    }),
  );
}

async function collectTimings(children: ChildProcess[]): Promise<[bigint, bigint][]> {
  const all: [bigint, bigint][] = [];
  for (const c of children) {
    c.send('report');
    const [msg] = (await once(c, 'message')) as [{ timings: [string, string][] }];
    for (const [s, e] of msg.timings) all.push([BigInt(s), BigInt(e)]);
  }
  return all.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
}

/** Waits until the queue holds no waiting, active or delayed job and no lane is open. */
async function drained(queue: Queue, redis: Redis, lanesKey: string | null): Promise<void> {
  for (;;) {
    const counts = await queue.getJobCounts('wait', 'active', 'delayed', 'prioritized');
    const open = lanesKey ? await redis.zcard(lanesKey) : 0;
    if (Object.values(counts).every((n) => n === 0) && open === 0) return;
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function pool<T>(items: T[], width: number, fn: (item: T) => Promise<unknown>): Promise<void> {
  let i = 0;
  await Promise.all(
    Array.from({ length: width }, async () => {
      while (i < items.length) await fn(items[i++]!);
    }),
  );
}

async function countKeys(redis: Redis, pattern: string): Promise<number> {
  let cursor = '0';
  let n = 0;
  do {
    const [next, keys] = await redis.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
    cursor = next;
    n += keys.length;
  } while (cursor !== '0');
  return n;
}

/** The benchmark measures one Redis server (memory, keys); a cluster would spread both. */
function singleRedis(url: string): Redis {
  const redis = createRedis(url);
  if (!(redis instanceof Redis)) throw new Error('npm run bench measures a single Redis server; REDIS_URL names a cluster');
  return redis;
}

const usedMemory = async (redis: Redis) => Number(/used_memory:(\d+)/.exec(await redis.info('memory'))?.[1] ?? 0);

const leaseOf = (i: number): LeaseIdentity => ({ provider: 'noop', companyId: 'bench', environmentId: 'env', leaseId: `lease-${i}` });

/**
 * Plain BullMQ: the same jobs (the same operation data as the lanes run), no lanes. Jobs are
 * added first, then timed to drain.
 */
async function plainRun(jobs: number, leases: number): Promise<number> {
  const config = benchConfig('{lease-ops-bench-plain}');
  const redis = singleRedis(config.REDIS_URL);
  await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX);
  const queue = new Queue(config.LEASE_OPS_QUEUE, { connection: redis, prefix: config.LEASE_OPS_PREFIX });
  const batch = 1_000;
  for (let i = 0; i < jobs; i += batch) {
    await queue.addBulk(
      Array.from({ length: Math.min(batch, jobs - i) }, (_, k) => ({
        name: 'acquire',
        data: buildJobData({ op: 'acquire', lease: leaseOf((i + k) % leases), params: { runId: `r${i + k}` } }),
        opts: { removeOnComplete: true },
      })),
    );
  }
  const children = await startWorkers('plain', config);
  const t0 = performance.now();
  for (const c of children) c.send('go');
  await drained(queue, redis, null);
  const seconds = (performance.now() - t0) / 1000;
  await stopWorkers(children);
  await queue.close();
  await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX);
  redis.disconnect();
  return jobs / seconds;
}

interface LanesRun {
  opsPerS: number;
  timings: [bigint, bigint][];
  memBefore: number;
  memAfter: number;
  laneKeysLeft: number;
  /** Keys under the prefix before the load and after it drained. */
  keysBefore: number;
  keysAfter: number;
}

/** lease-ops lanes: `jobs` operations round-robin over `leases` leases, added first, then timed. */
async function lanesRun(jobs: number, leases: number, recordTimings = false, workers = WORKERS): Promise<LanesRun> {
  const config = benchConfig('{lease-ops-bench-lanes}');
  const redis = singleRedis(config.REDIS_URL);
  await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX);
  const ops = new OperationsQueue(redis, config);
  const children = await startWorkers('lanes', config, workers);
  // Warm up, enough to fill BullMQ's event stream to its cap (10,000 events), so the memory
  // baseline already holds what BullMQ keeps at any load and the comparison shows lanes alone.
  await pool([...Array(3_000).keys()], 100, (i) => ops.enqueue({ op: 'acquire', lease: leaseOf(i), params: { runId: 'w' } }));
  for (const c of children) c.send('go');
  await drained(ops.queue, redis, ops.lanes.lanesKey);
  for (const c of children) c.send('reset');
  if (recordTimings) for (const c of children) c.send('record');
  const memBefore = await usedMemory(redis);
  const keysBefore = await countKeys(redis, `${config.LEASE_OPS_PREFIX}*`);

  // Paused, so the load is all in place before the clock starts, as for plain BullMQ.
  await ops.queue.pause();
  await pool([...Array(jobs).keys()], 200, (i) =>
    ops.enqueue({ op: 'acquire', lease: leaseOf(i % leases), params: { runId: `r${i}` } }),
  );
  const t0 = performance.now();
  await ops.queue.resume();
  await drained(ops.queue, redis, ops.lanes.lanesKey);
  const seconds = (performance.now() - t0) / 1000;
  const timings = await collectTimings(children);
  const memAfter = await usedMemory(redis);
  const keysAfter = await countKeys(redis, `${config.LEASE_OPS_PREFIX}*`);
  const laneKeysLeft = await countKeys(redis, `${config.LEASE_OPS_PREFIX}:lane:*`);
  await stopWorkers(children);
  await ops.close();
  await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX);
  redis.disconnect();
  return { opsPerS: jobs / seconds, timings, memBefore, memAfter, laneKeysLeft, keysBefore, keysAfter };
}

const ROUNDS = 5;

function median(values: number[]): number {
  return [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!;
}

/** End of one operation to start of the next, in ms, sorted. */
function handoffTimes(timings: [bigint, bigint][]): number[] {
  return timings
    .slice(1)
    .map((t, i) => Number(t[0] - timings[i]![1]) / 1e6)
    .sort((a, b) => a - b);
}

function percentile(sorted: number[], p: number): number {
  if (!sorted.length) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!;
}

export async function runBench(opts: { json: boolean; quick: boolean }): Promise<Figures> {
  const scale = opts.quick ? 0.1 : 1;
  const loads = {
    jobs: Math.round(20_000 * scale),
    leases: Math.round(1_000 * scale),
    hot_ops: Math.round(2_000 * scale),
    many_leases: Math.round(100_000 * scale),
  };
  out(`bench: ${WORKERS} worker processes x concurrency ${CONCURRENCY}, Redis ${loadConfig().REDIS_URL}`);
  // (a) and (b) alternate over several rounds and report medians: on a small shared machine
  // one round's figure drifts, the ratio of medians measured side by side much less.
  const plainRounds: number[] = [];
  const lanesRounds: LanesRun[] = [];
  for (let round = 1; round <= ROUNDS; round++) {
    out(`(b) plain BullMQ, the same ${loads.jobs} jobs, round ${round}/${ROUNDS} ...`);
    plainRounds.push(await plainRun(loads.jobs, loads.leases));
    out(`(a) lanes, ${loads.jobs} operations over ${loads.leases} leases, round ${round}/${ROUNDS} ...`);
    lanesRounds.push(await lanesRun(loads.jobs, loads.leases));
  }
  const plain = median(plainRounds);
  const lanes = lanesRounds.sort((x, y) => x.opsPerS - y.opsPerS)[Math.floor(ROUNDS / 2)]!;
  out(`(c) one hot lease, ${loads.hot_ops} operations ...`);
  const hot = await lanesRun(loads.hot_ops, 1, true);
  const handoffs = handoffTimes(hot.timings);
  // The same lease with one worker process: with two, every hand-off also wakes the idle
  // process (BullMQ marks the queue after each fetch), which costs a wasted fetch per op.
  out(`(c) one hot lease, ${loads.hot_ops} operations, one worker process ...`);
  const hotOne = await lanesRun(loads.hot_ops, 1, true, 1);
  const handoffsOne = handoffTimes(hotOne.timings);
  out(`(d) ${loads.many_leases} leases, one operation each ...`);
  const many = await lanesRun(loads.many_leases, loads.many_leases);
  // (e) The incident, default settings: a stop that ignores SIGTERM, a resume behind it.
  out('(e) stuck stop: resume queued behind a stop that ignores SIGTERM, default settings (about 35 s) ...');
  const stuck = await scenario(loadConfig({ ...process.env, LEASE_OPS_LOG_LEVEL: 'silent' }), REAL_TIMING, true, false);

  const figures: Figures = {
    lanes_ops_per_s: Math.round(lanes.opsPerS),
    plain_bullmq_jobs_per_s: Math.round(plain),
    ratio_vs_plain: Number((lanes.opsPerS / plain).toFixed(3)),
    hot_lease_ops_per_s: Math.round(hot.opsPerS),
    hot_lease_one_worker_ops_per_s: Math.round(hotOne.opsPerS),
    handoff_one_worker_p50_ms: Number(percentile(handoffsOne, 50).toFixed(3)),
    handoff_p50_ms: Number(percentile(handoffs, 50).toFixed(3)),
    handoff_p99_ms: Number(percentile(handoffs, 99).toFixed(3)),
    many_leases_ops_per_s: Math.round(many.opsPerS),
    redis_memory_before_bytes: many.memBefore,
    redis_memory_after_bytes: many.memAfter,
    redis_keys_before: many.keysBefore,
    redis_keys_after: many.keysAfter,
    stuck_stop_recovery_s: Number(stuck.seconds.toFixed(1)),
    lane_keys_left: lanesRounds.reduce((n, r) => n + r.laneKeysLeft, 0) + hot.laneKeysLeft + hotOne.laneKeysLeft + many.laneKeysLeft,
    loads,
  };
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(figures)}\n`);
  } else {
    const rows: [string, string][] = [
      [`(a) lanes: ${loads.jobs} ops over ${loads.leases} leases (median of ${ROUNDS})`, `${figures.lanes_ops_per_s} ops/s`],
      [`(b) plain BullMQ: the same jobs and data, no lanes (median of ${ROUNDS})`, `${figures.plain_bullmq_jobs_per_s} jobs/s`],
      [`    ratio (a)/(b)`, `${figures.ratio_vs_plain}`],
      [`(c) one hot lease: ${loads.hot_ops} ops`, `${figures.hot_lease_ops_per_s} ops/s`],
      [`    hand-off p50 / p99`, `${figures.handoff_p50_ms} / ${figures.handoff_p99_ms} ms`],
      [`    same, one worker process`, `${figures.hot_lease_one_worker_ops_per_s} ops/s, hand-off p50 ${figures.handoff_one_worker_p50_ms} ms`],
      [`(d) ${loads.many_leases} leases, one op each`, `${figures.many_leases_ops_per_s} ops/s (${(many.opsPerS / lanes.opsPerS).toFixed(2)} of (a))`],
      [`    Redis memory before / after`, `${figures.redis_memory_before_bytes} / ${figures.redis_memory_after_bytes} bytes`],
      [`    keys under the prefix before / after`, `${figures.redis_keys_before} / ${figures.redis_keys_after}`],
      [`    lane keys left in Redis`, `${figures.lane_keys_left}`],
      [`(e) stuck stop: resume enqueued to completed (watchdog, 30 s budget)`, `${figures.stuck_stop_recovery_s} s`],
    ];
    const w = Math.max(...rows.map((r) => r[0].length));
    process.stdout.write(`${rows.map(([k, v]) => `${k.padEnd(w)}  ${v}`).join('\n')}\n`);
  }
  return figures;
}
