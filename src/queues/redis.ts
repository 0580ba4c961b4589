import { Cluster, Redis, type RedisOptions } from 'ioredis';

/** A Redis connection: one server, or a Redis Cluster (REDIS_URL=redis+cluster://host:port,...). */
export type RedisClient = Redis | Cluster;

/** redis+cluster://host:port,host:port (rediss+cluster:// for TLS). */
const CLUSTER_SCHEME = /^(rediss?)\+cluster:\/\/([^,\s]+(?:,[^,\s]+)*)$/;

/** True for a REDIS_URL that names Redis Cluster seed nodes. */
export function isClusterUrl(url: string): boolean {
  return CLUSTER_SCHEME.test(url);
}

/**
 * A Redis connection as BullMQ needs it: commands wait for a reconnect instead of failing
 * after a few retries (maxRetriesPerRequest: null), so a Redis restart pauses work.
 * `redis+cluster://host:port,host:port` connects to a Redis Cluster through those seed
 * nodes; every lease-ops key carries the prefix's {hash tag}, so one slot holds them all.
 */
export function createRedis(url: string, opts: RedisOptions = {}): RedisClient {
  const cluster = CLUSTER_SCHEME.exec(url);
  if (!cluster) return new Redis(url, { maxRetriesPerRequest: null, enableReadyCheck: true, ...opts });
  const [, scheme, hosts] = cluster;
  const seeds = hosts!.split(',').map((hostPort) => {
    const u = new URL(`${scheme}://${hostPort}`);
    return { host: u.hostname, port: Number(u.port || 6379) };
  });
  const auth = new URL(`${scheme}://${hosts!.split(',')[0]}`);
  const { enableOfflineQueue, ...redisOptions } = opts;
  return new Cluster(seeds, {
    ...(enableOfflineQueue === undefined ? {} : { enableOfflineQueue }),
    redisOptions: {
      maxRetriesPerRequest: null,
      enableReadyCheck: true,
      ...(auth.username ? { username: decodeURIComponent(auth.username) } : {}),
      ...(auth.password ? { password: decodeURIComponent(auth.password) } : {}),
      ...(scheme === 'rediss' ? { tls: {} } : {}),
      ...redisOptions,
    },
  });
}

/** Resolves when Redis answers PING, or rejects after `ms` (a down Redis must not hang a probe). */
export async function pingWithin(redis: RedisClient, ms: number): Promise<void> {
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

/** Deletes every key under a prefix (on each master of a cluster): what a demo or a bench run wrote. */
export async function deleteKeysUnder(redis: RedisClient, prefix: string): Promise<void> {
  for (const node of redis instanceof Cluster ? redis.nodes('master') : [redis]) {
    let cursor = '0';
    do {
      const [next, keys] = await node.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 1000);
      cursor = next;
      // One key at a time on a cluster: keys under one prefix share its hash tag, but UNLINK
      // with many keys is refused across slots should a prefix have none.
      if (keys.length) await (redis instanceof Cluster ? Promise.all(keys.map((k) => node.unlink(k))) : node.unlink(...keys));
    } while (cursor !== '0');
  }
}
