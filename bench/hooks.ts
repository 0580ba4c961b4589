import { randomBytes } from 'node:crypto';
import { startApiServer } from '../src/api/server.ts';
import { loadConfig } from '../src/config.ts';
import { createLogger } from '../src/logger.ts';
import { leaseOpsDriverHooks } from '../src/paperclip/driver.ts';
import { httpBackend } from '../src/paperclip/backend.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { createSimulatedProvider } from '../src/providers/simulated/index.ts';
import type { LeaseProvider } from '../src/providers/types.ts';
import { createRedis, deleteKeysUnder } from '../src/queues/redis.ts';
import { LeaseWorker } from '../src/queues/worker.ts';

export interface HookOverhead {
  /** A hook's time minus the time its operation spent in provider calls (ms). */
  p50Ms: number;
  p99Ms: number;
  hooks: number;
}

/** The provider's methods, each call's time added to `spent` (ms): what the cloud's own work took. */
function timed(provider: LeaseProvider, spent: { ms: number }): LeaseProvider {
  const wrap = <A extends unknown[], R>(fn: (...args: A) => Promise<R>) => async (...args: A): Promise<R> => {
    const from = performance.now();
    try {
      return await fn(...args);
    } finally {
      spent.ms += performance.now() - from;
    }
  };
  return {
    ...provider,
    acquire: wrap(provider.acquire),
    resume: wrap(provider.resume),
    release: wrap(provider.release),
    stop: wrap(provider.stop),
    forceStop: wrap(provider.forceStop),
    destroy: wrap(provider.destroy),
    status: wrap(provider.status),
  };
}

/**
 * (f) What the paperclip plugin adds to a hook on a quiet lease: its resume hook (a running
 * sandbox: one attempt, no transition to wait out) through the HTTP API, against one worker
 * on the simulated cloud, minus the time the operation spent in provider calls. What is left
 * is lease-ops': the API, the enqueue, the hand-off to a worker, the lane steps and the wait.
 */
export async function hookOverhead(hooks: number): Promise<HookOverhead> {
  const prefix = `{lease-ops-bench-hooks-${randomBytes(3).toString('hex')}}`;
  const token = `bench-${randomBytes(12).toString('hex')}`;
  const config = loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix, LEASE_OPS_LOG_LEVEL: 'silent', LEASE_OPS_API_TOKENS: token, LEASE_OPS_API_PORT: '0' });
  const log = createLogger({ level: 'silent' });
  const spent = { ms: 0 };
  const provider = timed(await createSimulatedProvider({}), spent);
  const worker = new LeaseWorker(config, new ProviderRegistry([provider]), log);
  await worker.start();
  const api = await startApiServer(config, log);
  try {
    const driver = leaseOpsDriverHooks(() => httpBackend(api.url, token));
    const base = { driverKey: 'lease-ops', companyId: 'bench', environmentId: 'hooks', config: { provider: 'simulated', leaseOpsUrl: api.url, token } };
    const lease = await driver.onAcquireLease({ ...base, runId: 'bench-hooks' });
    const overheads: number[] = [];
    for (let i = 0; i < hooks; i++) {
      const before = spent.ms;
      const from = performance.now();
      await driver.onResumeLease({ ...base, providerLeaseId: lease.providerLeaseId!, leaseMetadata: lease.metadata ?? {} });
      overheads.push(performance.now() - from - (spent.ms - before));
    }
    overheads.sort((a, b) => a - b);
    const at = (p: number) => Number(overheads[Math.min(overheads.length - 1, Math.floor((p / 100) * overheads.length))]!.toFixed(2));
    return { p50Ms: at(50), p99Ms: at(99), hooks };
  } finally {
    await api.close();
    await worker.close();
    await provider.close?.();
    const redis = createRedis(config.REDIS_URL);
    await deleteKeysUnder(redis, prefix);
    redis.disconnect();
  }
}
