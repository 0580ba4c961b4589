import { fork, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { barChartSvg, histogramSvg, stackSvg } from '../src/charts.ts';
import { loadConfig, type Config } from '../src/config.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { buildJobData, OperationsQueue } from '../src/queues/operations-queue.ts';
import { createRedis, deleteKeysUnder } from '../src/queues/redis.ts';
import { REAL_TIMING, runningScenarioPrefixes, scenario } from '../src/demo.ts';
import { exitEarlyOnSignals } from '../src/runtime.ts';
import { maskUrl } from '../src/secrets.ts';
import { activityCost } from './activities.ts';
import { hookOverhead } from './hooks.ts';
import { settleLag } from './settle-lag.ts';
import { instanceCost, type InstanceFigures } from './instances.ts';
import { measureRedis, perOperation, type RedisCost } from './redis-cost.ts';

const WORKERS = 2;
const CONCURRENCY = 50;
const out = (line: string) => process.stderr.write(`${line}\n`);

export interface Figures {
  lanes_ops_per_s: number;
  plain_bullmq_jobs_per_s: number;
  ratio_vs_plain: number;
  groupmq_jobs_per_s: number;
  ratio_vs_groupmq: number;
  hot_lease_ops_per_s: number;
  hot_lease_one_worker_ops_per_s: number;
  groupmq_hot_group_jobs_per_s: number;
  hot_ratio_vs_groupmq: number;
  /** (c) and (c'): what one operation of the hot lease, and one job of groupmq's hot group, costs Redis and the workers (medians of the rounds). */
  hot_redis_cpu_us_per_op: number;
  hot_worker_cpu_us_per_op: number;
  groupmq_hot_redis_cpu_us_per_job: number;
  groupmq_hot_worker_cpu_us_per_job: number;
  hot_redis_commands_per_op: number;
  groupmq_hot_redis_commands_per_job: number;
  handoff_one_worker_p50_ms: number;
  handoff_p50_ms: number;
  handoff_p99_ms: number;
  many_leases_ops_per_s: number;
  redis_memory_before_bytes: number;
  redis_memory_after_bytes: number;
  redis_keys_before: number;
  redis_keys_after: number;
  stuck_stop_recovery_s: number;
  hook_overhead_p50_ms: number;
  hook_overhead_p99_ms: number;
  /** (i) From a sandbox reaching the state an operation waits for (1-5 s transitions) to the operation's end. */
  /** (a) and (b): CPU per operation, Redis' and the worker processes' (µs, medians of the rounds). */
  lanes_redis_cpu_us_per_op: number;
  plain_redis_cpu_us_per_op: number;
  lanes_worker_cpu_us_per_op: number;
  plain_worker_cpu_us_per_op: number;
  /** Redis commands run per operation (inside scripts or not; perOperation in redis-cost.ts), (a) and (b), medians of the rounds. */
  lanes_redis_commands_per_op: number;
  plain_redis_commands_per_op: number;
  settle_lag_p50_ms: number;
  settle_lag_p99_ms: number;
  settle_lag_operations_waited: number;
  settle_provider_requests_per_op: number;
  /** The same without Daytona's pushes (each transition waited out by lane backoff, as before them). */
  settle_lag_backoff_p50_ms: number;
  settle_lag_backoff_p99_ms: number;
  settle_backoff_provider_requests_per_op: number;
  activity_redis_cpu_us_per_call: number;
  activity_script_us_per_call: number;
  /** (h) The provider registry: 10,000 instances of one company. */
  instances: InstanceFigures;
  lane_keys_left: number;
  loads: Record<string, number>;
}

export function benchConfig(prefix: string, overrides: Record<string, string> = {}): Config {
  return loadConfig({
    ...process.env,
    ...overrides,
    LEASE_OPS_PREFIX: prefix,
    LEASE_OPS_CONCURRENCY: String(CONCURRENCY),
    LEASE_OPS_KEEP_COMPLETED_S: '0',
    LEASE_OPS_LOG_LEVEL: 'warn',
    // One hot lease holds 2,000 queued operations; (d) puts 100,000 in the queue.
    LEASE_OPS_MAX_QUEUED_PER_LEASE: '0',
    LEASE_OPS_MAX_QUEUED: '0',
  });
}

const PLAIN_PREFIX = '{lease-ops-bench-plain}';
export const LANES_PREFIX = '{lease-ops-bench-lanes}';
/** groupmq's namespace; its keys are `groupmq:<namespace>:...`. */
const GROUPMQ_NAMESPACE = '{lease-ops-bench-groupmq}';
const liveWorkers = new Set<ChildProcess>();

/**
 * Ctrl-C or SIGTERM mid-run (exitEarlyOnSignals exits 130 or 143 after it): the worker
 * processes are killed and every key the bench wrote (its two prefixes and a running
 * scenario's) deleted.
 */
async function cleanUpAfterSignal(signal: NodeJS.Signals): Promise<void> {
  process.stderr.write(`bench: ${signal}: stopping the workers and deleting the bench's keys\n`);
  for (const child of liveWorkers) child.kill('SIGKILL');
  const redis = createRedis(loadConfig().REDIS_URL);
  try {
    await Promise.all([PLAIN_PREFIX, LANES_PREFIX, `groupmq:${GROUPMQ_NAMESPACE}`, ...runningScenarioPrefixes].map((prefix) => deleteKeysUnder(redis, prefix)));
  } finally {
    redis.disconnect();
  }
}

export async function startWorkers(mode: 'plain' | 'groupmq' | 'lanes', config: Config, count = WORKERS): Promise<ChildProcess[]> {
  const env = {
    ...process.env,
    REDIS_URL: config.REDIS_URL,
    LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX,
    LEASE_OPS_PARTITIONS: String(config.LEASE_OPS_PARTITIONS),
    LEASE_OPS_CONCURRENCY: String(CONCURRENCY),
    LEASE_OPS_KEEP_COMPLETED_S: '0',
  };
  // BENCH_CPU_PROF=<dir>: each worker process writes a V8 CPU profile there as it exits.
  const children = Array.from({ length: count }, () =>
    fork(new URL('./worker-child.ts', import.meta.url).pathname, [mode], { env, execArgv: ['--import', 'tsx', ...(process.env.BENCH_CPU_PROF ? ['--cpu-prof', '--cpu-prof-dir=' + process.env.BENCH_CPU_PROF] : [])] }),
  );
  for (const child of children) {
    liveWorkers.add(child);
    child.once('exit', () => liveWorkers.delete(child));
  }
  await Promise.all(children.map((c) => once(c, 'message')));
  return children;
}

export async function stopWorkers(children: ChildProcess[]): Promise<void> {
  await Promise.all(
    children.map(async (c) => {
      c.send('stop');
      await once(c, 'exit');
    }),
  );
}

/** The worker processes' CPU time so far (user + system, µs), summed. */
export async function workersCpuUs(children: ChildProcess[]): Promise<number> {
  let total = 0;
  for (const c of children) {
    c.send('cpu');
    const [msg] = (await once(c, 'message')) as [{ cpu: NodeJS.CpuUsage }];
    total += msg.cpu.user + msg.cpu.system;
  }
  return total;
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

export async function pool<T>(items: T[], width: number, fn: (item: T) => Promise<unknown>): Promise<void> {
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
export function singleRedis(url: string): Redis {
  const redis = createRedis(url);
  if (!(redis instanceof Redis)) throw new Error('npm run bench measures a single Redis server; REDIS_URL names a cluster');
  return redis;
}

const usedMemory = async (redis: Redis) => Number(/used_memory:(\d+)/.exec(await redis.info('memory'))?.[1] ?? 0);

export const leaseOf = (i: number): LeaseIdentity => ({ provider: 'noop', companyId: 'bench', environmentId: 'env', leaseId: `lease-${i}` });

/**
 * Plain BullMQ: the same jobs (the same operation data as the lanes run), no lanes. Jobs are
 * added first, then timed to drain.
 */
export async function plainRun(jobs: number, leases: number): Promise<{ jobsPerS: number; cost: RedisCost; workerCpuUs: number }> {
  const config = benchConfig(PLAIN_PREFIX);
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
  const measured = await measureRedis([redis]);
  const cpuBefore = await workersCpuUs(children);
  const t0 = performance.now();
  for (const c of children) c.send('go');
  await drained(queue, redis, null);
  const seconds = (performance.now() - t0) / 1000;
  const cost = await measured();
  const workerCpuUs = (await workersCpuUs(children)) - cpuBefore;
  await stopWorkers(children);
  await queue.close();
  await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX);
  redis.disconnect();
  return { jobsPerS: jobs / seconds, cost, workerCpuUs };
}

/**
 * groupmq (a per-group FIFO queue on Redis: one job per group at a time, in order): the same
 * jobs, each lease a group. Jobs are added first, then timed to drain.
 */
export async function groupmqRun(jobs: number, leases: number): Promise<{ jobsPerS: number; cost: RedisCost; workerCpuUs: number }> {
  const { Queue: GroupQueue } = await import('groupmq');
  const config = benchConfig(GROUPMQ_NAMESPACE);
  const redis = singleRedis(config.REDIS_URL);
  const keys = `groupmq:${GROUPMQ_NAMESPACE}`;
  await deleteKeysUnder(redis, keys);
  // A groupmq queue quits its connection when it closes: it gets one of its own.
  const queue = new GroupQueue({ redis: singleRedis(config.REDIS_URL), namespace: GROUPMQ_NAMESPACE, keepCompleted: 0 });
  await pool([...Array(jobs).keys()], 200, (i) =>
    queue.add({ groupId: leaseOf(i % leases).leaseId, data: buildJobData({ op: 'acquire', lease: leaseOf(i % leases), params: { runId: `r${i}` } }) }),
  );
  const children = await startWorkers('groupmq', config);
  const measured = await measureRedis([redis]);
  const cpuBefore = await workersCpuUs(children);
  const t0 = performance.now();
  for (const c of children) c.send('go');
  for (;;) {
    const counts = await queue.getJobCounts();
    if (counts.waiting + counts.active + counts.delayed === 0) break;
    await new Promise((r) => setTimeout(r, 5));
  }
  const seconds = (performance.now() - t0) / 1000;
  const cost = await measured();
  const workerCpuUs = (await workersCpuUs(children)) - cpuBefore;
  await stopWorkers(children);
  await queue.close();
  await deleteKeysUnder(redis, keys);
  redis.disconnect();
  return { jobsPerS: jobs / seconds, cost, workerCpuUs };
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
  /** What Redis spent while the operations ran (not their enqueue). */
  cost: RedisCost;
  /** CPU time the worker processes spent meanwhile (µs). */
  workerCpuUs: number;
}

/** lease-ops lanes: `jobs` operations round-robin over `leases` leases, added first, then timed. */
export async function lanesRun(jobs: number, leases: number, recordTimings = false, workers = WORKERS): Promise<LanesRun> {
  const config = benchConfig(LANES_PREFIX);
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
  const measured = await measureRedis([redis]);
  const cpuBefore = await workersCpuUs(children);
  const t0 = performance.now();
  await ops.queue.resume();
  await drained(ops.queue, redis, ops.lanes.lanesKey);
  const seconds = (performance.now() - t0) / 1000;
  const cost = await measured();
  const workerCpuUs = (await workersCpuUs(children)) - cpuBefore;
  const timings = await collectTimings(children);
  const memAfter = await usedMemory(redis);
  const keysAfter = await countKeys(redis, `${config.LEASE_OPS_PREFIX}*`);
  const laneKeysLeft = await countKeys(redis, `${config.LEASE_OPS_PREFIX}:lane:*`);
  await stopWorkers(children);
  await ops.close();
  await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX);
  redis.disconnect();
  return { opsPerS: jobs / seconds, timings, memBefore, memAfter, laneKeysLeft, keysBefore, keysAfter, cost, workerCpuUs };
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

/** What the charts draw: each round's figure, and every hand-off of the hot lease (its median round). */
export interface BenchSamples {
  lanesRounds: number[];
  plainRounds: number[];
  groupmqRounds: number[];
  /** (c) and (c'), each round (older result files have none). */
  hotRounds?: number[];
  groupmqHotRounds?: number[];
  handoffsMs: number[];
  /** (i) Each waiting operation's settle lag (ms). */
  settleLagsMs?: number[];
}

/**
 * Writes the figures as JSON and, next to it, an SVG of throughput per scenario (lanes and
 * plain BullMQ with each round as a dot) over the hand-off latency distribution and, when
 * measured, the settle lag's. Returns both paths.
 */
export function writeBenchFiles(figures: Figures, samples: BenchSamples, dir: string, stamp = new Date().toISOString().replace(/[:.]/g, '-')): { json: string; svg: string } {
  mkdirSync(dir, { recursive: true });
  const json = join(dir, `bench-${stamp}.json`);
  const svg = join(dir, `bench-${stamp}.svg`);
  writeFileSync(json, `${JSON.stringify({ ...figures, samples }, null, 2)}\n`);
  const bars = barChartSvg('Throughput (operations or jobs per second)', '/s', [
    { label: `lanes, ${figures.loads.leases} leases (median)`, value: figures.lanes_ops_per_s, samples: samples.lanesRounds },
    { label: 'plain BullMQ, same jobs (median)', value: figures.plain_bullmq_jobs_per_s, samples: samples.plainRounds, colour: '#8a94a3' },
    { label: 'groupmq, same jobs (median)', value: figures.groupmq_jobs_per_s, samples: samples.groupmqRounds, colour: '#b0a27a' },
    { label: 'one hot lease (median)', value: figures.hot_lease_ops_per_s, samples: samples.hotRounds },
    { label: 'one hot lease, one worker process', value: figures.hot_lease_one_worker_ops_per_s },
    { label: 'groupmq, one hot group (median)', value: figures.groupmq_hot_group_jobs_per_s, samples: samples.groupmqHotRounds, colour: '#b0a27a' },
    { label: `${figures.loads.many_leases} leases, one op each`, value: figures.many_leases_ops_per_s },
  ]);
  const histogram = histogramSvg('Hand-off latency, one hot lease (end of one operation to start of the next)', samples.handoffsMs);
  const settle = samples.settleLagsMs?.length
    ? [histogramSvg('Settle lag with Daytona pushes, 1-5 s transitions (the sandbox reaching its state to the operation ending)', samples.settleLagsMs, 760, 'operations that waited')]
    : [];
  writeFileSync(svg, stackSvg([bars, histogram, ...settle]));
  return { json, svg };
}

export async function runBench(opts: { json: boolean; quick: boolean; out?: string }): Promise<Figures> {
  const scale = opts.quick ? 0.1 : 1;
  const loads = {
    jobs: Math.round(20_000 * scale),
    leases: Math.round(1_000 * scale),
    hot_ops: Math.round(2_000 * scale),
    many_leases: Math.round(100_000 * scale),
    hooks: Math.round(200 * scale),
    activity_cycles: Math.round(10_000 * scale),
    instances: Math.round(10_000 * scale),
    settle_leases: opts.quick ? 20 : 100,
  };
  out(`bench: ${WORKERS} worker processes x concurrency ${CONCURRENCY}, Redis ${maskUrl(loadConfig().REDIS_URL)}`);
  const stopCleaningUp = exitEarlyOnSignals(cleanUpAfterSignal);
  // (a) and (b) alternate over several rounds and report medians: on a small shared machine
  // one round's figure drifts, the ratio of medians measured side by side much less.
  const plainRounds: number[] = [];
  const plainRuns: Awaited<ReturnType<typeof plainRun>>[] = [];
  const groupmqRounds: number[] = [];
  const lanesRounds: LanesRun[] = [];
  for (let round = 1; round <= ROUNDS; round++) {
    out(`(b) plain BullMQ, the same ${loads.jobs} jobs, round ${round}/${ROUNDS} ...`);
    plainRuns.push(await plainRun(loads.jobs, loads.leases));
    plainRounds.push(plainRuns.at(-1)!.jobsPerS);
    out(`(b') groupmq, the same ${loads.jobs} jobs over ${loads.leases} groups, round ${round}/${ROUNDS} ...`);
    groupmqRounds.push((await groupmqRun(loads.jobs, loads.leases)).jobsPerS);
    out(`(a) lanes, ${loads.jobs} operations over ${loads.leases} leases, round ${round}/${ROUNDS} ...`);
    lanesRounds.push(await lanesRun(loads.jobs, loads.leases));
  }
  const plain = median(plainRounds);
  const groupmq = median(groupmqRounds);
  const lanes = lanesRounds.sort((x, y) => x.opsPerS - y.opsPerS)[Math.floor(ROUNDS / 2)]!;
  // (c) and (c') alternate over the rounds too (one round of either moves by a fifth from
  // run to run here): the peer's figure is one group holding all the jobs, the same two processes.
  const hotRounds: LanesRun[] = [];
  const groupmqHotRuns: Awaited<ReturnType<typeof groupmqRun>>[] = [];
  for (let round = 1; round <= ROUNDS; round++) {
    out(`(c) one hot lease, ${loads.hot_ops} operations, round ${round}/${ROUNDS} ...`);
    hotRounds.push(await lanesRun(loads.hot_ops, 1, true));
    out(`(c') groupmq, one hot group, ${loads.hot_ops} jobs, round ${round}/${ROUNDS} ...`);
    groupmqHotRuns.push(await groupmqRun(loads.hot_ops, 1));
  }
  const groupmqHotRounds = groupmqHotRuns.map((r) => r.jobsPerS);
  const hot = hotRounds.sort((x, y) => x.opsPerS - y.opsPerS)[Math.floor(ROUNDS / 2)]!;
  const groupmqHot = median(groupmqHotRounds);
  const handoffs = handoffTimes(hot.timings);
  // The same lease with one worker process: what the second process adds or costs.
  out(`(c) one hot lease, ${loads.hot_ops} operations, one worker process ...`);
  const hotOne = await lanesRun(loads.hot_ops, 1, true, 1);
  const handoffsOne = handoffTimes(hotOne.timings);
  out(`(d) ${loads.many_leases} leases, one operation each ...`);
  const many = await lanesRun(loads.many_leases, loads.many_leases);
  // (e) The incident, default settings: a stop that ignores SIGTERM, a resume behind it.
  out('(e) stuck stop: resume queued behind a stop that ignores SIGTERM, default settings (about 35 s) ...');
  const stuck = await scenario(loadConfig({ ...process.env, LEASE_OPS_LOG_LEVEL: 'silent' }), REAL_TIMING, true, false);
  out(`(f) paperclip plugin: ${loads.hooks} resume hooks on a quiet lease, over the HTTP API ...`);
  const hooks = await hookOverhead(loads.hooks);
  out(`(g) activity gates: ${loads.activity_cycles} begin, heartbeat and end cycles ...`);
  const activities = await activityCost(loads.activity_cycles);
  out(`(h) provider registry: ${loads.instances} instances of one company, listed and built ...`);
  const instances = await instanceCost(loads.instances, Math.min(1_000, loads.instances));
  out(`(i) settle lag: ${loads.settle_leases} leases acquired, stopped and resumed on Daytona with 1-5 s transitions, with its pushes and without ...`);
  const settle = await settleLag(loads.settle_leases, { push: true });
  const settleBackoff = await settleLag(loads.settle_leases, { push: false });

  // What one operation costs Redis and the workers, lanes beside plain BullMQ (medians of the rounds).
  const perOp = (runs: { cost: RedisCost; workerCpuUs: number }[], ops = loads.jobs) => ({
    redis: median(runs.map((r) => perOperation(r.cost, ops).cpu_us)),
    commands: median(runs.map((r) => perOperation(r.cost, ops).commands)),
    worker: Number(median(runs.map((r) => r.workerCpuUs / ops)).toFixed(1)),
  });
  const lanesCost = perOp(lanesRounds);
  const plainCost = perOp(plainRuns);
  // The hot lease runs one operation at a time, so what each costs is most of its rate.
  const hotCost = perOp(hotRounds, loads.hot_ops);
  const groupmqHotCost = perOp(groupmqHotRuns, loads.hot_ops);
  const figures: Figures = {
    lanes_redis_cpu_us_per_op: lanesCost.redis,
    plain_redis_cpu_us_per_op: plainCost.redis,
    lanes_worker_cpu_us_per_op: lanesCost.worker,
    plain_worker_cpu_us_per_op: plainCost.worker,
    lanes_redis_commands_per_op: lanesCost.commands,
    plain_redis_commands_per_op: plainCost.commands,
    lanes_ops_per_s: Math.round(lanes.opsPerS),
    plain_bullmq_jobs_per_s: Math.round(plain),
    ratio_vs_plain: Number((lanes.opsPerS / plain).toFixed(3)),
    groupmq_jobs_per_s: Math.round(groupmq),
    ratio_vs_groupmq: Number((lanes.opsPerS / groupmq).toFixed(3)),
    hot_lease_ops_per_s: Math.round(hot.opsPerS),
    hot_lease_one_worker_ops_per_s: Math.round(hotOne.opsPerS),
    groupmq_hot_group_jobs_per_s: Math.round(groupmqHot),
    hot_ratio_vs_groupmq: Number((hot.opsPerS / groupmqHot).toFixed(3)),
    hot_redis_cpu_us_per_op: hotCost.redis,
    hot_worker_cpu_us_per_op: hotCost.worker,
    groupmq_hot_redis_cpu_us_per_job: groupmqHotCost.redis,
    groupmq_hot_worker_cpu_us_per_job: groupmqHotCost.worker,
    hot_redis_commands_per_op: hotCost.commands,
    groupmq_hot_redis_commands_per_job: groupmqHotCost.commands,
    handoff_one_worker_p50_ms: Number(percentile(handoffsOne, 50).toFixed(3)),
    handoff_p50_ms: Number(percentile(handoffs, 50).toFixed(3)),
    handoff_p99_ms: Number(percentile(handoffs, 99).toFixed(3)),
    many_leases_ops_per_s: Math.round(many.opsPerS),
    redis_memory_before_bytes: many.memBefore,
    redis_memory_after_bytes: many.memAfter,
    redis_keys_before: many.keysBefore,
    redis_keys_after: many.keysAfter,
    stuck_stop_recovery_s: Number(stuck.seconds.toFixed(1)),
    hook_overhead_p50_ms: hooks.p50Ms,
    hook_overhead_p99_ms: hooks.p99Ms,
    settle_lag_p50_ms: settle.p50Ms,
    settle_lag_p99_ms: settle.p99Ms,
    settle_lag_operations_waited: settle.waited,
    settle_provider_requests_per_op: settle.requestsPerOp,
    settle_lag_backoff_p50_ms: settleBackoff.p50Ms,
    settle_lag_backoff_p99_ms: settleBackoff.p99Ms,
    settle_backoff_provider_requests_per_op: settleBackoff.requestsPerOp,
    activity_redis_cpu_us_per_call: activities.cpu_us_per_call,
    activity_script_us_per_call: activities.script_us_per_call,
    instances,
    lane_keys_left: [...lanesRounds, ...hotRounds, hotOne, many].reduce((n, r) => n + r.laneKeysLeft, 0),
    loads,
  };
  stopCleaningUp();
  const files = writeBenchFiles(figures, { lanesRounds: lanesRounds.map((r) => Math.round(r.opsPerS)), plainRounds: plainRounds.map(Math.round), groupmqRounds: groupmqRounds.map(Math.round), hotRounds: hotRounds.map((r) => Math.round(r.opsPerS)), groupmqHotRounds: groupmqHotRounds.map(Math.round), handoffsMs: handoffs, settleLagsMs: settle.lagsMs }, opts.out ?? 'bench-results');
  out(`bench: figures in ${files.json}, charts in ${files.svg}`);
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(figures)}\n`);
  } else {
    const rows: [string, string][] = [
      [`(a) lanes: ${loads.jobs} ops over ${loads.leases} leases (median of ${ROUNDS})`, `${figures.lanes_ops_per_s} ops/s`],
      [`(b) plain BullMQ: the same jobs and data, no lanes (median of ${ROUNDS})`, `${figures.plain_bullmq_jobs_per_s} jobs/s`],
      [`    ratio (a)/(b)`, `${figures.ratio_vs_plain}`],
      [`    CPU per operation, Redis / workers: (a) and (b)`, `${figures.lanes_redis_cpu_us_per_op} / ${figures.lanes_worker_cpu_us_per_op} µs and ${figures.plain_redis_cpu_us_per_op} / ${figures.plain_worker_cpu_us_per_op} µs`],
      [`    Redis commands per operation: (a) and (b)`, `${figures.lanes_redis_commands_per_op} and ${figures.plain_redis_commands_per_op}`],
      [`(b') groupmq: the same jobs, each lease a group (median of ${ROUNDS})`, `${figures.groupmq_jobs_per_s} jobs/s`],
      [`    ratio (a)/(b')`, `${figures.ratio_vs_groupmq}`],
      [`(c) one hot lease: ${loads.hot_ops} ops (median of ${ROUNDS})`, `${figures.hot_lease_ops_per_s} ops/s`],
      [`    hand-off p50 / p99`, `${figures.handoff_p50_ms} / ${figures.handoff_p99_ms} ms`],
      [`    same, one worker process`, `${figures.hot_lease_one_worker_ops_per_s} ops/s, hand-off p50 ${figures.handoff_one_worker_p50_ms} ms`],
      [`(c') groupmq: one hot group, ${loads.hot_ops} jobs (median of ${ROUNDS})`, `${figures.groupmq_hot_group_jobs_per_s} jobs/s`],
      [`    ratio (c)/(c')`, `${figures.hot_ratio_vs_groupmq}`],
      [`    CPU per operation, Redis / workers: (c) and (c')`, `${figures.hot_redis_cpu_us_per_op} / ${figures.hot_worker_cpu_us_per_op} µs and ${figures.groupmq_hot_redis_cpu_us_per_job} / ${figures.groupmq_hot_worker_cpu_us_per_job} µs`],
      [`    Redis commands per operation: (c) and (c')`, `${figures.hot_redis_commands_per_op} and ${figures.groupmq_hot_redis_commands_per_job}`],
      [`(d) ${loads.many_leases} leases, one op each`, `${figures.many_leases_ops_per_s} ops/s (${(many.opsPerS / lanes.opsPerS).toFixed(2)} of (a))`],
      [`    Redis memory before / after`, `${figures.redis_memory_before_bytes} / ${figures.redis_memory_after_bytes} bytes`],
      [`    keys under the prefix before / after`, `${figures.redis_keys_before} / ${figures.redis_keys_after}`],
      [`    lane keys left in Redis`, `${figures.lane_keys_left}`],
      [`(e) stuck stop: resume enqueued to completed (watchdog, 30 s budget)`, `${figures.stuck_stop_recovery_s} s`],
      [`(f) paperclip resume hook on a quiet lease, minus its provider calls: p50 / p99`, `${figures.hook_overhead_p50_ms} / ${figures.hook_overhead_p99_ms} ms`],
      [`(g) activity gates: Redis CPU / script time per begin, heartbeat or end`, `${figures.activity_redis_cpu_us_per_call} / ${figures.activity_script_us_per_call} µs`],
      [`(h) provider registry: ${instances.instances} instances saved`, `${instances.saves_per_s} saves/s, ${instances.redis_bytes_per_instance} Redis bytes each`],
      [`    listed in ${instances.list_pages} pages of 500: p50 / max per page`, `${instances.list_page_p50_ms} / ${instances.list_page_max_ms} ms`],
      [`    worker heap per built instance (${instances.built} built); an attempt's look-up p50`, `${instances.worker_bytes_per_built_instance} bytes; ${instances.resolve_cached_p50_us} µs`],
      [`(i) settle lag, 1-5 s transitions (${figures.settle_lag_operations_waited} of ${settle.operations} ops waited): p50 / p99`, `${figures.settle_lag_p50_ms} / ${figures.settle_lag_p99_ms} ms`],
      [`    provider requests per operation on its sandbox`, `${figures.settle_provider_requests_per_op}`],
      [`    without Daytona's pushes (backoff only): p50 / p99, requests per operation`, `${figures.settle_lag_backoff_p50_ms} / ${figures.settle_lag_backoff_p99_ms} ms, ${figures.settle_backoff_provider_requests_per_op}`],
    ];
    const w = Math.max(...rows.map((r) => r[0].length));
    process.stdout.write(`${rows.map(([k, v]) => `${k.padEnd(w)}  ${v}`).join('\n')}\n`);
  }
  return figures;
}
