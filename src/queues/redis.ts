import { Redis, type RedisOptions } from 'ioredis';

/**
 * A Redis connection as BullMQ needs it: commands wait for a reconnect instead of failing
 * after a few retries (maxRetriesPerRequest: null), so a Redis restart pauses work.
 */
export function createRedis(url: string, opts: RedisOptions = {}): Redis {
  return new Redis(url, { maxRetriesPerRequest: null, enableReadyCheck: true, ...opts });
}

/** Resolves when Redis answers PING, or rejects after `ms` (a down Redis must not hang a probe). */
export async function pingWithin(redis: Redis, ms: number): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  try {
    await Promise.race([
      redis.ping(),
      new Promise((_, reject) => (timer = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms))),
    ]);
  } finally {
    clearTimeout(timer);
  }
}
