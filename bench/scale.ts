// `npm run bench -- --scale`: how lanes scale, in one run. Throughput by worker processes (one
// Redis), by partitions (a local 3-master cluster of the bench's own) and by open leases, and
// what each operation costs Redis, against plain BullMQ's jobs. See docs/scaling.md.
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Cluster } from 'ioredis';
import { barChartSvg, stackSvg } from '../src/charts.ts';
import { LeaseOpsClient } from '../src/client.ts';
import { partitionPrefixes } from '../src/partitions.ts';
import { deleteKeysUnder } from '../src/queues/redis.ts';
import { RedisCluster } from '../test/helpers/redis-cluster.ts';
import { benchConfig, LANES_PREFIX, lanesRun, leaseOf, plainRun, pool, startWorkers, stopWorkers, workersCpuUs } from './bench.ts';
import { measureRedis, perOperation, type RedisCost } from './redis-cost.ts';

const out = (line: string) => process.stderr.write(`${line}\n`);

interface Point {
  label: string;
  ops_per_s: number;
  redis_cpu_us_per_op: number;
  scripts_per_op: number;
  script_us_per_op: number;
  /** CPU the worker processes spent per operation (µs). */
  worker_cpu_us_per_op: number;
}

export interface ScaleFigures {
  by_workers: Point[];
  by_partitions: Point[];
  by_open_leases: Point[];
  plain_bullmq: Point;
  lanes_2_workers: Point;
  loads: { jobs: number; leases: number };
}

function point(label: string, run: { opsPerS: number; cost: RedisCost; workerCpuUs: number }, operations: number): Point {
  const per = perOperation(run.cost, operations);
  return {
    label,
    ops_per_s: Math.round(run.opsPerS),
    redis_cpu_us_per_op: per.cpu_us,
    scripts_per_op: per.scripts,
    script_us_per_op: per.script_us,
    worker_cpu_us_per_op: Number((run.workerCpuUs / operations).toFixed(1)),
  };
}

/**
 * `jobs` operations over `leases` leases through `partitions` partitions on a cluster, with
 * `workers` worker processes serving all of them; added first (queues paused), then timed.
 */
async function partitionedRun(url: string, partitions: number, jobs: number, leases: number, workers: number): Promise<{ opsPerS: number; cost: RedisCost; workerCpuUs: number }> {
  const config = benchConfig(LANES_PREFIX, { REDIS_URL: url, LEASE_OPS_PARTITIONS: String(partitions) });
  const client = new LeaseOpsClient(config, { failFast: false });
  const cluster = client.ops.connection as Cluster;
  const prefixes = partitionPrefixes(config.LEASE_OPS_PREFIX, partitions);
  const clean = () => Promise.all([config.LEASE_OPS_PREFIX, ...prefixes].map((p) => deleteKeysUnder(cluster, p)));
  await clean();
  const children = await startWorkers('lanes', config, workers);
  for (const c of children) c.send('go');
  await Promise.all(client.partitions.map((p) => p.ops.queue.pause()));
  await pool([...Array(jobs).keys()], 200, (i) => client.enqueue('acquire', leaseOf(i % leases), { runId: `r${i}` }));
  const measured = await measureRedis(cluster.nodes('master'));
  const cpuBefore = await workersCpuUs(children);
  const t0 = performance.now();
  await Promise.all(client.partitions.map((p) => p.ops.queue.resume()));
  // Drained: no job to run and no lane open in any partition (read as cheaply as the other runs read theirs).
  const busy = async () =>
    (
      await Promise.all(
        client.partitions.map(async (p) => {
          const counts = await p.ops.queue.getJobCounts('wait', 'active', 'delayed', 'prioritized');
          return Object.values(counts).reduce((n, c) => n + c, 0) + (await cluster.zcard(p.ops.lanes.lanesKey));
        }),
      )
    ).some((n) => n > 0);
  while (await busy()) await new Promise((r) => setTimeout(r, 5));
  const seconds = (performance.now() - t0) / 1000;
  const cost = await measured();
  const workerCpuUs = (await workersCpuUs(children)) - cpuBefore;
  await stopWorkers(children);
  await clean();
  await client.close();
  return { opsPerS: jobs / seconds, cost, workerCpuUs };
}

export async function runScale(opts: { json: boolean; quick: boolean; out: string }): Promise<ScaleFigures> {
  const jobs = opts.quick ? 4_000 : 20_000;
  const leases = 1_000;
  const openLeases = opts.quick ? [1_000, 10_000] : [1_000, 10_000, 100_000];

  out(`scale: plain BullMQ, ${jobs} jobs, 2 worker processes ...`);
  const plain = await plainRun(jobs, leases);
  const byWorkers: Point[] = [];
  for (const workers of [1, 2, 4]) {
    out(`scale: lanes, ${jobs} operations over ${leases} leases, ${workers} worker process(es) ...`);
    const run = await lanesRun(jobs, leases, false, workers);
    byWorkers.push(point(`${workers} worker process${workers > 1 ? 'es' : ''}`, run, jobs));
  }
  const byLeases: Point[] = [];
  for (const open of openLeases) {
    // As many operations as leases at least: each lease has one or more queued.
    const n = Math.max(jobs, open);
    out(`scale: lanes, ${n} operations over ${open} open leases ...`);
    const run = await lanesRun(n, open);
    byLeases.push(point(`${open.toLocaleString('en-US')} open leases`, run, n));
  }
  out('scale: starting a local Redis Cluster of 3 masters ...');
  const cluster = await RedisCluster.start(3);
  const byPartitions: Point[] = [];
  try {
    for (const partitions of [1, 3, 6]) {
      out(`scale: lanes on the cluster, ${partitions} partition(s), ${jobs} operations, 2 worker processes ...`);
      const run = await partitionedRun(cluster.url, partitions, jobs, leases, 2);
      byPartitions.push(point(`${partitions} partition${partitions > 1 ? 's' : ''} (3 masters)`, run, jobs));
    }
  } finally {
    await cluster.stop();
  }
  const figures: ScaleFigures = {
    by_workers: byWorkers,
    by_partitions: byPartitions,
    by_open_leases: byLeases,
    plain_bullmq: point('plain BullMQ, 2 worker processes', { ...plain, opsPerS: plain.jobsPerS }, jobs),
    lanes_2_workers: byWorkers[1]!,
    loads: { jobs, leases },
  };
  const stamp = new Date().toISOString().replace(/[:.]/g, '-');
  mkdirSync(opts.out, { recursive: true });
  const json = join(opts.out, `scale-${stamp}.json`);
  const svg = join(opts.out, `scale-${stamp}.svg`);
  writeFileSync(json, `${JSON.stringify(figures, null, 2)}\n`);
  const bars = (title: string, points: Point[]) => barChartSvg(title, '/s', points.map((p) => ({ label: p.label, value: p.ops_per_s })));
  writeFileSync(
    svg,
    stackSvg([
      bars('Lanes by worker processes (one Redis)', byWorkers),
      bars('Lanes by partitions (local 3-master cluster)', byPartitions),
      bars('Lanes by open leases', byLeases),
      barChartSvg('Redis CPU per operation (µs)', ' µs', [figures.plain_bullmq, figures.lanes_2_workers, ...byPartitions].map((p) => ({ label: p.label, value: p.redis_cpu_us_per_op }))),
    ]),
  );
  out(`scale: figures in ${json}, charts in ${svg}`);
  if (opts.json) process.stdout.write(`${JSON.stringify(figures)}\n`);
  else {
    const rows = [figures.plain_bullmq, ...byWorkers, ...byPartitions, ...byLeases];
    const w = Math.max(...rows.map((r) => r.label.length));
    process.stdout.write(`${'run'.padEnd(w)}  ops/s    Redis CPU/op  scripts/op  script time/op  worker CPU/op\n`);
    for (const r of rows)
      process.stdout.write(
        `${r.label.padEnd(w)}  ${String(r.ops_per_s).padEnd(7)}  ${`${r.redis_cpu_us_per_op} µs`.padEnd(12)}  ${String(r.scripts_per_op).padEnd(10)}  ${`${r.script_us_per_op} µs`.padEnd(14)}  ${r.worker_cpu_us_per_op} µs\n`,
      );
  }
  return figures;
}
