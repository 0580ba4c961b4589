import { randomBytes } from 'node:crypto';
import { loadConfig } from '../src/config.ts';
import { InstanceProviders } from '../src/providers/instances/resolver.ts';
import { MasterKeys } from '../src/providers/instances/sealing.ts';
import { ProviderInstanceStore } from '../src/providers/instances/store.ts';
import { redisRateLimiters } from '../src/providers/pacing.ts';
import { deleteKeysUnder } from '../src/queues/redis.ts';
import { singleRedis } from './bench.ts';

export interface InstanceFigures {
  instances: number;
  /** Saves (seal + one script) per second, 50 at a time. */
  saves_per_s: number;
  /** Redis memory per saved instance (record and index entries), bytes. */
  redis_bytes_per_instance: number;
  /** One company's whole list, pages of 500: the time per page at the median and the worst. */
  list_page_p50_ms: number;
  list_page_max_ms: number;
  list_pages: number;
  /** Worker heap per instance provider built (the decrypted key, settings, its HTTP client), bytes. */
  worker_bytes_per_built_instance: number;
  built: number;
  /** What an attempt pays to find its (already built) instance: one revision read. */
  resolve_cached_p50_us: number;
}

const percentile = (values: number[], p: number) => [...values].sort((a, b) => a - b)[Math.min(values.length - 1, Math.floor((p / 100) * values.length))] ?? 0;

/**
 * (h) The provider registry at 10,000 instances of one company: saves, Redis bytes, a list
 * walked a page at a time, and what a worker holds per instance it has built.
 */
export async function instanceCost(count: number, built: number): Promise<InstanceFigures> {
  const prefix = `{lease-ops-bench-instances-${randomBytes(3).toString('hex')}}`;
  const config = loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix, LEASE_OPS_LOG_LEVEL: 'silent' });
  const redis = singleRedis(config.REDIS_URL);
  const keys = new MasterKeys(randomBytes(32));
  const apiUrl = 'http://127.0.0.1:9/api';
  const store = new ProviderInstanceStore(redis, prefix, { keys, allowedApiUrls: [apiUrl] });
  const memory = async () => Number(/used_memory:(\d+)/.exec(await redis.info('memory'))![1]);
  try {
    const before = await memory();
    const started = performance.now();
    for (let from = 0; from < count; from += 50) {
      await Promise.all(
        Array.from({ length: Math.min(50, count - from) }, (_, j) =>
          store.create('bench', { name: `dt-${String(from + j).padStart(6, '0')}`, type: 'daytona', config: { apiUrl, snapshot: 'agent-base', autoStopMinutes: 30 }, credentials: { apiKey: `dtn_${randomBytes(24).toString('hex')}` } }, 'bench'),
        ),
      );
    }
    const savesPerS = count / ((performance.now() - started) / 1000);
    const after = await memory();

    const pageMs: number[] = [];
    let cursor: string | null = null;
    let listed = 0;
    do {
      const t0 = performance.now();
      const page: Awaited<ReturnType<ProviderInstanceStore['list']>> = await store.list({ companyId: 'bench', limit: 500, ...(cursor ? { after: cursor } : {}) });
      pageMs.push(performance.now() - t0);
      listed += page.instances.length;
      cursor = page.nextCursor;
    } while (cursor);
    if (listed !== count) throw new Error(`listed ${listed} of ${count}`);

    const providers = new InstanceProviders(store, { rateLimiters: redisRateLimiters(redis, prefix) }, [apiUrl], built);
    const gc = (globalThis as { gc?: () => void }).gc;
    gc?.();
    const heapBefore = process.memoryUsage().heapUsed;
    for (let i = 0; i < built; i++) {
      const resolved = await providers.resolve('bench', 'prod', `dt-${String(i).padStart(6, '0')}`);
      if (!('provider' in resolved)) throw new Error(resolved.message);
    }
    gc?.();
    const heapAfter = process.memoryUsage().heapUsed;
    const resolveUs: number[] = [];
    for (let i = 0; i < 2_000; i++) {
      const t0 = performance.now();
      await providers.resolve('bench', 'prod', `dt-${String(i % built).padStart(6, '0')}`);
      resolveUs.push((performance.now() - t0) * 1000);
    }
    return {
      instances: count,
      saves_per_s: Math.round(savesPerS),
      redis_bytes_per_instance: Math.round((after - before) / count),
      list_page_p50_ms: Number(percentile(pageMs, 50).toFixed(2)),
      list_page_max_ms: Number(Math.max(...pageMs).toFixed(2)),
      list_pages: pageMs.length,
      worker_bytes_per_built_instance: Math.max(0, Math.round((heapAfter - heapBefore) / built)),
      built,
      resolve_cached_p50_us: Math.round(percentile(resolveUs, 50)),
    };
  } finally {
    await deleteKeysUnder(redis, prefix);
    redis.disconnect();
  }
}
