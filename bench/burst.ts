// `npm run bench -- --burst`: the 9 a.m. burst (issue 28 item 2). Thousands of acquires at
// once over as many leases, on the Daytona fake with its create throttler at Daytona's tier-1
// limit (300 a minute per organization, a fixed window) and creates taking 2-10 s, served by
// three worker processes at concurrency 2,000 each. Then what in-flight operations cost: worker
// memory and Redis CPU per operation in flight, from 500 in flight up.
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { once } from 'node:events';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { barChartSvg } from '../src/charts.ts';
import { LeaseOpsClient } from '../src/client.ts';
import { loadConfig } from '../src/config.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { seededRandom } from '../src/fakes/seeded-random.ts';
import { createRedis, deleteKeysUnder, type RedisClient } from '../src/queues/redis.ts';

const out = (line: string) => process.stderr.write(`${line}\n`);
const KEY = 'burst-bench-key';
const ORG = '3a4b5c6d-7e8f-4a0b-9c1d-2e3f4a5b6c7d';
const REPLICAS = 3;
const CONCURRENCY = 2_000;
/** Daytona's tier-1 create limit: 300 a minute per organization. */
const CREATE_LIMIT_PER_MIN = 300;
/**
 * The pacing the bench's workers use: 290 a minute after a burst of 10, so that no fixed
 * one-minute window sees more than 300 (10 + 290), whatever its phase.
 */
const CREATE_PACING = { perMinute: 290, burst: 10 };
const CLI = new URL('../src/cli.ts', import.meta.url).pathname;

export interface ScalingPoint {
  in_flight: number;
  worker_rss_bytes_per_in_flight: number;
  redis_cpu_us_per_in_flight_per_s: number;
  worker_cpu_us_per_in_flight_per_s: number;
}

export interface BurstFigures {
  acquires: number;
  replicas: number;
  concurrency: number;
  create_limit_per_min: number;
  /** The first enqueue to the last acquire's end. */
  burst_s: number;
  /** What the create limit allows at best: every create sent at the limit's rate, the last one's boot after it. */
  burst_bound_s: number;
  burst_ratio: number;
  completed: number;
  failed: number;
  /** Accepted acquires that neither completed nor failed by the end (must be 0). */
  lost: number;
  provider_requests: number;
  provider_requests_429: number;
  rate_429: number;
  /** Sandboxes the fake holds beyond one per acquire (must be 0). */
  extra_sandboxes: number;
  scaling: ScalingPoint[];
  loads: Record<string, number>;
}

interface Worker {
  child: ChildProcess;
  ready: Promise<void>;
}

function startWorker(env: Record<string, string>): Worker {
  const child = spawn(process.execPath, ['--import', 'tsx', CLI, 'worker'], { env: { ...process.env, LEASE_OPS_LOG_LEVEL: 'info', ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  const ready = new Promise<void>((resolve, reject) => {
    child.once('exit', (code) => reject(new Error(`burst bench: a worker exited (${code}) before it was ready`)));
    for (const stream of [child.stdout!, child.stderr!]) {
      createInterface({ input: stream }).on('line', (line) => {
        if (line.includes('"worker started"')) resolve();
        else if (/"level":(50|60)/.test(line)) out(`worker: ${line.slice(0, 300)}`);
      });
    }
  });
  return { child, ready };
}

async function stopAll(workers: Worker[]): Promise<void> {
  await Promise.all(
    workers.map(async ({ child }) => {
      if (child.exitCode !== null) return;
      child.kill('SIGKILL');
      await once(child, 'exit');
    }),
  );
}

/** A process' resident memory (bytes) and CPU so far (µs), from /proc. */
function procStats(pid: number): { rssBytes: number; cpuUs: number } {
  const status = readFileSync(`/proc/${pid}/status`, 'utf8');
  const rssKb = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0);
  // utime and stime are fields 14 and 15 of /proc/<pid>/stat, in clock ticks (100 a second here).
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  const ticks = Number(fields[11]) + Number(fields[12]);
  return { rssBytes: rssKb * 1024, cpuUs: ticks * 10_000 };
}

async function redisCpuUs(redis: RedisClient): Promise<number> {
  const info = await redis.info('cpu');
  const sys = Number(/used_cpu_sys:([\d.]+)/.exec(info)?.[1] ?? 0);
  const user = Number(/used_cpu_user:([\d.]+)/.exec(info)?.[1] ?? 0);
  return (sys + user) * 1e6;
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

function workerEnv(prefix: string, apiUrl: string, rateLimits: string): Record<string, string> {
  const config = loadConfig();
  return {
    REDIS_URL: config.REDIS_URL,
    LEASE_OPS_PREFIX: prefix,
    LEASE_OPS_PROVIDERS: 'daytona',
    DAYTONA_API_URL: apiUrl,
    DAYTONA_API_KEY: KEY,
    DAYTONA_ORGANIZATION_ID: ORG,
    DAYTONA_RATE_LIMITS: rateLimits,
    LEASE_OPS_CONCURRENCY: String(CONCURRENCY),
    LEASE_OPS_KEEP_COMPLETED_S: '3600',
  };
}

/** Waits until every job has ended; returns how many completed and failed, and when the last ended. */
async function ended(client: LeaseOpsClient, jobIds: string[], timeoutMs: number): Promise<{ completed: number; failed: number; lastEndMs: number; pending: number }> {
  const until = Date.now() + timeoutMs;
  let pending = jobIds;
  let completed = 0;
  let failed = 0;
  let lastEndMs = 0;
  while (pending.length && Date.now() < until) {
    await sleep(1_000);
    const still: string[] = [];
    for (let i = 0; i < pending.length; i += 500) {
      const batch = pending.slice(i, i + 500);
      const states = await Promise.all(batch.map((id) => client.ops.queue.getJobState(id)));
      const jobs = await Promise.all(batch.map((id, k) => (states[k] === 'completed' || states[k] === 'failed' ? client.ops.queue.getJob(id) : null)));
      states.forEach((state, k) => {
        if (state === 'completed') completed++;
        else if (state === 'failed') failed++;
        else return void still.push(batch[k]!);
        lastEndMs = Math.max(lastEndMs, jobs[k]?.finishedOn ?? 0);
      });
    }
    pending = still;
  }
  return { completed, failed, lastEndMs, pending: pending.length };
}

async function enqueueAll(client: LeaseOpsClient, prefix: string, count: number, deadlineMs: number): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < count; i += 200) {
    const batch = await Promise.all(
      Array.from({ length: Math.min(200, count - i) }, (_, k) =>
        client.enqueue('acquire', { provider: 'daytona', companyId: 'burst', environmentId: prefix.slice(-8, -1), leaseId: `agent-${i + k}` }, { runId: `run-${i + k}` }, { deadlineMs }),
      ),
    );
    ids.push(...batch.map((b) => b.jobId));
  }
  return ids;
}

/** (1) The burst: all acquires at once under the create limit. */
async function burst(acquires: number, seed: number): Promise<Omit<BurstFigures, 'scaling' | 'loads'>> {
  const prefix = `{lease-ops-bench-burst-${randomBytes(3).toString('hex')}}`;
  const random = seededRandom(seed);
  const boots: number[] = [];
  const fake = new DaytonaFake({
    apiKey: KEY,
    organizationId: ORG,
    notifications: true,
    rateLimits: { 'sandbox-create': { limit: CREATE_LIMIT_PER_MIN, windowMs: 60_000 } },
    transitionMs: (to, ms) => {
      if (to !== 'started') return ms;
      const boot = 2_000 + Math.round(random() * 8_000);
      boots.push(boot);
      return boot;
    },
  });
  const apiUrl = await fake.listen();
  const workers = Array.from({ length: REPLICAS }, () => startWorker(workerEnv(prefix, apiUrl, JSON.stringify({ 'sandbox-create': CREATE_PACING }))));
  const client = new LeaseOpsClient(loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix, LEASE_OPS_MAX_QUEUED_PER_COMPANY: '0' }));
  try {
    await Promise.all(workers.map((w) => w.ready));
    // Sent at the limit's own rate, the creates need (acquires - 1) intervals; the last sandbox then boots.
    const sendS = ((acquires - 1) * 60) / CREATE_LIMIT_PER_MIN;
    const deadlineMs = Math.round((sendS * 3 + 300) * 1000);
    const from = Date.now();
    const ids = await enqueueAll(client, prefix, acquires, deadlineMs);
    out(`    ${acquires} acquires enqueued in ${((Date.now() - from) / 1000).toFixed(1)} s`);
    const end = await ended(client, ids, deadlineMs + 60_000);
    const lastBootS = (boots.at(-1) ?? 0) / 1000;
    const bound = sendS + lastBootS;
    const burstS = (end.lastEndMs - from) / 1000;
    const calls = fake.calls.length;
    const limited = fake.calls.filter((c) => c.status === 429).length;
    return {
      acquires,
      replicas: REPLICAS,
      concurrency: CONCURRENCY,
      create_limit_per_min: CREATE_LIMIT_PER_MIN,
      burst_s: Number(burstS.toFixed(1)),
      burst_bound_s: Number(bound.toFixed(1)),
      burst_ratio: Number((burstS / bound).toFixed(3)),
      completed: end.completed,
      failed: end.failed,
      lost: end.pending,
      provider_requests: calls,
      provider_requests_429: limited,
      rate_429: Number((limited / Math.max(1, calls)).toFixed(4)),
      extra_sandboxes: Math.max(0, fake.ids().length - acquires),
    };
  } finally {
    await stopAll(workers);
    await client.close();
    await fake.close();
    const redis = createRedis(loadConfig().REDIS_URL);
    await deleteKeysUnder(redis, prefix);
    redis.disconnect();
  }
}

/**
 * (2) What operations in flight cost: `inFlight` acquires whose sandboxes take 10 minutes to
 * boot, so every one stays in flight (waiting in its attempt for the push, or backing off
 * between attempts) while the workers' memory and CPU and Redis' CPU are sampled for `sampleS`.
 */
async function inFlightCost(inFlight: number, sampleS: number): Promise<ScalingPoint> {
  const prefix = `{lease-ops-bench-inflight-${randomBytes(3).toString('hex')}}`;
  const fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, transitionMs: (to, ms) => (to === 'started' ? 600_000 : ms) });
  const apiUrl = await fake.listen();
  const workers = Array.from({ length: REPLICAS }, () => startWorker(workerEnv(prefix, apiUrl, JSON.stringify({ 'sandbox-create': null }))));
  const client = new LeaseOpsClient(loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix, LEASE_OPS_MAX_QUEUED_PER_COMPANY: '0' }));
  const redis = createRedis(loadConfig().REDIS_URL);
  try {
    await Promise.all(workers.map((w) => w.ready));
    const pids = workers.map((w) => w.child.pid!);
    const idleRss = pids.reduce((n, pid) => n + procStats(pid).rssBytes, 0);
    await enqueueAll(client, prefix, inFlight, 30 * 60_000);
    // Every acquire has made its sandbox and is in flight: its create was sent.
    for (const until = Date.now() + 120_000; fake.calls.filter((c) => c.method === 'POST' && c.path === '/sandbox').length < inFlight && Date.now() < until; ) await sleep(250);
    // Past the first retries' short backoffs: every one polls at the backoff's cap by then.
    await sleep(20_000);
    const before = { redis: await redisCpuUs(redis), workers: pids.reduce((n, pid) => n + procStats(pid).cpuUs, 0), at: performance.now() };
    await sleep(sampleS * 1000);
    const seconds = (performance.now() - before.at) / 1000;
    const redisUs = (await redisCpuUs(redis)) - before.redis;
    const workerUs = pids.reduce((n, pid) => n + procStats(pid).cpuUs, 0) - before.workers;
    const rss = pids.reduce((n, pid) => n + procStats(pid).rssBytes, 0);
    return {
      in_flight: inFlight,
      worker_rss_bytes_per_in_flight: Math.round((rss - idleRss) / inFlight),
      redis_cpu_us_per_in_flight_per_s: Number((redisUs / inFlight / seconds).toFixed(2)),
      worker_cpu_us_per_in_flight_per_s: Number((workerUs / inFlight / seconds).toFixed(2)),
    };
  } finally {
    await stopAll(workers);
    await client.close();
    await fake.close();
    await deleteKeysUnder(redis, prefix);
    redis.disconnect();
  }
}

export async function runBurst(opts: { json: boolean; quick: boolean; out?: string }): Promise<BurstFigures> {
  const acquires = opts.quick ? 500 : 5_000;
  const levels = opts.quick ? [500, 1_000, 2_000] : [500, 1_000, 2_000, 5_000];
  const sampleS = opts.quick ? 10 : 20;
  out(`burst (1): ${acquires} acquires at once, ${REPLICAS} workers at concurrency ${CONCURRENCY}, creates limited to ${CREATE_LIMIT_PER_MIN}/min and booting in 2-10 s ...`);
  const figures = await burst(acquires, 20261206);
  const scaling: ScalingPoint[] = [];
  for (const n of levels) {
    out(`burst (2): ${n} acquires in flight (sandboxes that take 10 minutes to boot), sampled for ${sampleS} s ...`);
    scaling.push(await inFlightCost(n, sampleS));
  }
  const result: BurstFigures = { ...figures, scaling, loads: { acquires, sample_s: sampleS } };
  const dir = opts.out ?? 'bench-results';
  mkdirSync(dir, { recursive: true });
  const stamp = new Date().toISOString().replace(/[:.]/g, '-');
  const json = join(dir, `burst-${stamp}.json`);
  writeFileSync(json, `${JSON.stringify(result, null, 2)}\n`);
  const svg = join(dir, `burst-${stamp}.svg`);
  writeFileSync(
    svg,
    barChartSvg(
      'Operations in flight: Redis CPU per operation per second',
      'µs/s',
      scaling.map((p) => ({ label: `${p.in_flight} in flight`, value: p.redis_cpu_us_per_in_flight_per_s })),
    ),
  );
  out(`bench: figures in ${json}, chart in ${svg}`);
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(result)}\n`);
  } else {
    const rows: [string, string][] = [
      [`burst: ${acquires} acquires, ${REPLICAS} workers x ${CONCURRENCY}, create limit ${CREATE_LIMIT_PER_MIN}/min`, `${result.burst_s} s (bound ${result.burst_bound_s} s, ratio ${result.burst_ratio})`],
      [`    completed / failed / lost`, `${result.completed} / ${result.failed} / ${result.lost}`],
      [`    provider requests, of them 429`, `${result.provider_requests}, ${result.provider_requests_429} (${(result.rate_429 * 100).toFixed(2)} %)`],
      [`    sandboxes beyond one per acquire`, `${result.extra_sandboxes}`],
      ...scaling.map((p): [string, string] => [
        `in flight ${p.in_flight}: worker RSS / Redis CPU / worker CPU per operation`,
        `${p.worker_rss_bytes_per_in_flight} B, ${p.redis_cpu_us_per_in_flight_per_s} µs/s, ${p.worker_cpu_us_per_in_flight_per_s} µs/s`,
      ]),
    ];
    const w = Math.max(...rows.map((r) => r[0].length));
    process.stdout.write(`${rows.map(([k, v]) => `${k.padEnd(w)}  ${v}`).join('\n')}\n`);
  }
  return result;
}
