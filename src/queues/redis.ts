import { Redis, type RedisOptions } from 'ioredis';

/**
 * A Redis connection as BullMQ needs it: commands wait for a reconnect instead of failing
 * after a few retries (maxRetriesPerRequest: null), so a Redis restart pauses work.
 */
export function createRedis(url: string, opts: RedisOptions = {}): Redis {
  return new Redis(url, { maxRetriesPerRequest: null, enableReadyCheck: true, ...opts });
}
