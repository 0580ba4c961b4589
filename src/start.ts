import { LeaseOpsClient } from './client.ts';
import { loadConfig } from './config.ts';
import type { LeaseIdentity } from './lease.ts';
import { NoRedisError, redisOrPrivate } from './redis-server.ts';
import { exitOnSignals, loggerFor, startWorker } from './runtime.ts';

const out = (line: string) => process.stdout.write(`${line}\n`);

/**
 * The main job on the embedded default: a worker against the simulated cloud, and one
 * lease taken through acquire, stop, resume and release while you watch.
 */
export async function runStart(opts: { once: boolean }): Promise<void> {
  let config = loadConfig({ LEASE_OPS_LOG_LEVEL: 'warn', ...process.env });
  let redis;
  try {
    redis = await redisOrPrivate(config.REDIS_URL, (url) =>
      out(`lease-ops: no Redis answered at ${config.REDIS_URL}; started a private one at ${url} (nothing persists)`),
    );
  } catch (err) {
    if (!(err instanceof NoRedisError)) throw err;
    process.stderr.write(`lease-ops: ${err.message}\n`);
    process.exitCode = 1;
    return;
  }
  const privateRedis = redis.privateRedis;
  config = { ...config, REDIS_URL: redis.url };
  const log = loggerFor(config);
  const worker = await startWorker(config, log);
  const client = new LeaseOpsClient(config);
  const started = Date.now();
  const stamp = () => `${((Date.now() - started) / 1000).toFixed(2).padStart(6)}s`;
  out(`lease-ops: worker running against ${config.REDIS_URL} (providers: ${config.LEASE_OPS_PROVIDERS})`);

  const lease: LeaseIdentity = { provider: 'simulated', companyId: 'demo-co', environmentId: 'demo-env', leaseId: `demo-${Date.now()}` };
  const run = async (op: Parameters<LeaseOpsClient['enqueue']>[0], params: unknown) => {
    const { jobId } = await client.enqueue(op, lease, params);
    const r = await client.waitForResult(jobId, 30_000);
    out(`${stamp()}  ${op.padEnd(10)} ${r.state.padEnd(9)} ${JSON.stringify(r.result ?? r.error)}`);
    if (r.state !== 'completed') throw new Error(`${op} failed: ${r.error}`);
    return r.result as { providerLeaseId: string };
  };
  try {
    const acquired = await run('acquire', { runId: 'demo-run' });
    // Later operations of the lease name the sandbox the acquire created; acquire used a
    // caller-chosen lane id, so switch the identity to the provider's lease id.
    lease.leaseId = acquired.providerLeaseId;
    const target = { providerLeaseId: acquired.providerLeaseId };
    await run('stop', target);
    await run('resume', { ...target, leaseMetadata: {} });
    await run('release', { ...target, leaseMetadata: {}, resourceDisposition: 'destroy' });
    out(`${stamp()}  lifecycle done: every operation ran in order through the lease's lane`);
  } finally {
    if (opts.once) {
      await client.close();
      await worker.close();
      privateRedis?.stop();
    }
  }
  if (!opts.once) {
    out('lease-ops: serving; press Ctrl-C to stop');
    exitOnSignals(log, async () => {
      await client.close();
      await worker.close();
      privateRedis?.stop();
    });
  }
}
