// A worker process for the benchmark: plain BullMQ, groupmq or lease-ops lanes, no-op jobs.
// It connects, says 'ready', starts on 'go', and on 'report' sends its op timings.
// lease-ops runs as users run it: the compiled dist/ (`npm run bench` builds it when the
// sources changed). Run through tsx, every function of src/ is wrapped by its name-keeping
// helper, which a CPU profile counted on the hot path.
import { Worker } from 'bullmq';
import { Redis } from 'ioredis';
import { loadConfig } from '../dist/config.js';
import { createLogger } from '../dist/logger.js';
import { PermanentError } from '../dist/providers/errors.js';
import { ProviderRegistry } from '../dist/providers/registry.js';
import type { LeaseProvider } from '../dist/providers/types.js';
import { createRedis } from '../dist/queues/redis.js';
import { LeaseWorkers } from '../dist/queues/partitioned-worker.js';

const mode = process.argv[2] as 'plain' | 'groupmq' | 'lanes';
const config = loadConfig();
const send = (msg: unknown) => process.send?.(msg);
/** Start of every operation, in process.hrtime ns (one clock for all processes), when asked. */
const timings: [string, string][] = [];
let recording = false;

/** A lease whose id starts with `fail-` fails every operation for good (the neighbours bench's failing tenant). */
const failing = (leaseId: string) => {
  if (leaseId.startsWith('fail-')) throw new PermanentError('refused', 'refused for the bench');
};

const noop: LeaseProvider = {
  name: 'noop',
  capabilities: { stop: true, pause: false, forceStop: true },
  // The sandbox has the lease's own id: nothing to name (see AttemptLife.nameSandbox), as
  // before leases had two names, so the figures stay comparable with earlier runs.
  async acquire(ctx) {
    if (recording) {
      const at = String(process.hrtime.bigint());
      timings.push([at, at]);
    }
    return { providerLeaseId: ctx.lease.leaseId, metadata: {}, expiresAt: null };
  },
  async resume(ctx) {
    failing(ctx.lease.leaseId);
    return { providerLeaseId: 'x', metadata: {}, expiresAt: null };
  },
  async release() {
    return null;
  },
  async stop(ctx, p) {
    failing(ctx.lease.leaseId);
    return { providerLeaseId: p.providerLeaseId, state: 'stopped' };
  },
  async forceStop(_c, p) {
    return { providerLeaseId: p.providerLeaseId, state: 'stopped' };
  },
  async destroy(_c, p) {
    return { providerLeaseId: p.providerLeaseId, state: 'destroyed' };
  },
  async status() {
    return { kind: 'running' };
  },
};

let close: () => Promise<void>;
let run: () => void;
if (mode === 'plain') {
  const connection = createRedis(config.REDIS_URL);
  const worker = new Worker(config.LEASE_OPS_QUEUE, async () => 'ok', {
    connection,
    prefix: config.LEASE_OPS_PREFIX,
    concurrency: config.LEASE_OPS_CONCURRENCY,
    autorun: false,
  });
  await worker.waitUntilReady();
  run = () => void worker.run();
  close = async () => {
    await worker.close();
    connection.disconnect();
  };
} else if (mode === 'groupmq') {
  // The peer with the same per-group guarantee (one job per group at a time, in order).
  const { Queue: GroupQueue, Worker: GroupWorker } = await import('groupmq');
  const redis = createRedis(config.REDIS_URL);
  if (!(redis instanceof Redis)) throw new Error('groupmq takes a single Redis server');
  const queue = new GroupQueue({ redis, namespace: config.LEASE_OPS_PREFIX, keepCompleted: 0 });
  let worker: InstanceType<typeof GroupWorker> | null = null;
  // A groupmq worker starts fetching when it is made.
  run = () => void (worker ??= new GroupWorker({ queue, handler: async () => 'ok', concurrency: config.LEASE_OPS_CONCURRENCY }));
  close = async () => {
    await worker?.close();
    await queue.close();
    redis.disconnect();
  };
} else {
  const worker = new LeaseWorkers(config, new ProviderRegistry([noop]), createLogger({ level: 'error' }));
  let started = false;
  run = () => {
    if (!started) void worker.start();
    started = true;
  };
  close = () => worker.close();
}

process.on('message', async (msg: string) => {
  if (msg === 'go') run();
  if (msg === 'report') send({ timings });
  if (msg === 'cpu') send({ cpu: process.cpuUsage() });
  if (msg === 'reset') timings.length = 0;
  if (msg === 'record') recording = true;
  if (msg === 'stop') {
    await close();
    process.exit(0);
  }
});
send('ready');
