import { randomBytes } from 'node:crypto';
import { LeaseOpsClient } from '../src/client.ts';
import { loadConfig } from '../src/config.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { seededRandom } from '../src/fakes/seeded-random.ts';
import { createLogger } from '../src/logger.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { createRedis, deleteKeysUnder } from '../src/queues/redis.ts';
import { LeaseWorker } from '../src/queues/worker.ts';

export interface SettleLag {
  /** From the sandbox reaching the state an operation waits for to the operation's end (ms). */
  p50Ms: number;
  p99Ms: number;
  /** Operations that waited for a transition (the others found their state reached). */
  waited: number;
  /** Provider requests per operation, all operations. */
  requestsPerOp: number;
  operations: number;
  /** Each waiting operation's lag (ms), sorted. */
  lagsMs: number[];
}

const KEY = 'settle-lag-bench-key';
const ORG = '5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9';

/**
 * (i) Settle lag on the Daytona fake with transitions of 1-5 s (seeded, drawn per transition):
 * each lease is acquired (the sandbox boots), stopped and resumed, all leases at once, on one
 * worker in this process with the default settings: with Daytona's notification gateway
 * pushing state changes (`push`), or without (every transition waited out by backoff). For each operation whose sandbox's latest
 * transition ended after it was accepted and before it ended, the lag is the operation's end (BullMQ's finishedOn) minus the
 * moment the transition ended; requests are the fake's calls on the sandbox while it ran (a lookup by name before the
 * sandbox exists is not counted).
 */
export async function settleLag(leases: number, opts: { push: boolean }, seed = 20261205): Promise<SettleLag> {
  const prefix = `{lease-ops-bench-settle-${randomBytes(3).toString('hex')}}`;
  const config = loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix, LEASE_OPS_LOG_LEVEL: 'silent' });
  const random = seededRandom(seed);
  const fake = new DaytonaFake({
    apiKey: KEY,
    organizationId: ORG,
    notifications: true,
    transitionMs: (to, ms) => (to === 'started' || to === 'stopped' ? 1_000 + Math.round(random() * 4_000) : ms),
  });
  const apiUrl = await fake.listen();
  const provider = createDaytonaProvider({
    name: 'daytona',
    apiUrl,
    apiKey: KEY,
    organizationId: ORG,
    // Without the gateway's pushes every transition is waited out by backing off (as before them).
    notifications: opts.push,
    timeoutMs: 10_000,
    rateLimits: { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null },
  });
  const worker = new LeaseWorker(config, new ProviderRegistry([provider]), createLogger({ level: 'silent' }));
  await worker.start();
  const client = new LeaseOpsClient(config);
  const lags: number[] = [];
  let requests = 0;
  let operations = 0;
  try {
    await Promise.all(
      Array.from({ length: leases }, async (_, i) => {
        const lease = { provider: 'daytona', companyId: 'bench', environmentId: 'settle', leaseId: `settle-${i}` };
        let sandbox: string | null = null;
        const run = async (op: 'acquire' | 'stop' | 'resume', params: Record<string, unknown>) => {
          const from = process.hrtime.bigint();
          const acceptedAt = Date.now();
          const { jobId } = await client.enqueue(op, lease, params as never);
          const result = await client.waitForResult(jobId, 120_000);
          if (result.state !== 'completed') throw new Error(`settle-lag bench: ${op} of ${lease.leaseId} ended ${result.state}: ${result.error?.message ?? ''}`);
          sandbox ??= (result.result as { providerLeaseId: string }).providerLeaseId;
          const job = await client.ops.queue.getJob(jobId);
          const endedAt = job?.finishedOn ?? 0;
          const reached = fake.transitionEnds.get(sandbox) ?? 0;
          operations++;
          const to = process.hrtime.bigint();
          requests += fake.calls.filter((c) => c.sandboxId === sandbox && c.start >= from && c.start <= to).length;
          // The transition the operation set off ended while it ran (not before it was accepted).
          if (reached > acceptedAt && reached <= endedAt) lags.push(endedAt - reached);
        };
        await run('acquire', { runId: `settle-${i}` });
        await run('stop', { providerLeaseId: sandbox });
        await run('resume', { providerLeaseId: sandbox, leaseMetadata: {} });
      }),
    );
  } finally {
    await client.close();
    await worker.close();
    await fake.close();
    const redis = createRedis(config.REDIS_URL);
    await deleteKeysUnder(redis, prefix);
    redis.disconnect();
  }
  lags.sort((a, b) => a - b);
  const at = (p: number) => (lags.length ? lags[Math.min(lags.length - 1, Math.floor((p / 100) * lags.length))]! : NaN);
  return { p50Ms: at(50), p99Ms: at(99), waited: lags.length, requestsPerOp: Number((requests / Math.max(1, operations)).toFixed(1)), operations, lagsMs: lags };
}
