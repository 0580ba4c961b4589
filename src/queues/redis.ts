import { Cluster, Redis, type RedisOptions } from 'ioredis';
import type { Logger } from '../logger.ts';
import { maskUrl } from '../secrets.ts';

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
  const client = connect(url, opts);
  // ioredis prints errors nobody listens to on stderr, four times a second while Redis is
  // down: they go to whoever reportRedisErrorsTo named (a rate-limited pino logger), or nowhere.
  client.on('error', (err: unknown) => redisReport.error(err));
  client.on('ready', () => redisReport.ready());
  return client;
}

/**
 * Keeps `client` and every copy made of it in `into`. BullMQ's Worker copies the connection
 * it is given (duplicate()) for its fetches and owns the copies; their errors are reported
 * as the connection's own, and closeForGood can then reach them too.
 */
export function keepCopies(client: RedisClient, into: RedisClient[]): RedisClient {
  into.push(client);
  const duplicate = client.duplicate.bind(client) as (...args: unknown[]) => RedisClient;
  (client as { duplicate: (...args: unknown[]) => RedisClient }).duplicate = (...args) => {
    const copy = keepCopies(duplicate(...args), into);
    copy.on('error', (err: unknown) => redisReport.error(err));
    return copy;
  };
  return client;
}

/**
 * Disconnects for good: a later connect is refused. BullMQ 6 connects a copy it has closed
 * again when the close came while a timed-out fetch was resetting that copy (its reconnect
 * does not look whether the connection was closed meanwhile), and the copy then lived on.
 */
export function closeForGood(client: RedisClient): void {
  (client as { connect: () => Promise<void> }).connect = () => Promise.reject(new Error(CONNECTION_CLOSED));
  client.disconnect();
}
/** ioredis' (and BullMQ's) message for a closed connection, which BullMQ treats as one. */
const CONNECTION_CLOSED = 'Connection is closed.';

let redisReport: { error: (err: unknown) => void; ready: () => void } = { error: () => undefined, ready: () => undefined };

/** Hands an error of a connection lease-ops does not own (BullMQ's) to the same report. */
export function reportRedisError(err: unknown): void {
  redisReport.error(err);
}

/** Where the connections' errors go (the worker and the API name a rate-limited pino logger). */
export function reportRedisErrorsTo(report: { error: (err: unknown) => void; ready: () => void }): void {
  redisReport = report;
}

/**
 * A report of Redis trouble through pino at most once per `everyMs` (how many were left
 * out is counted), and a line when Redis answers again; the URL is masked.
 */
export function rateLimitedRedisReport(log: Logger, url: string, everyMs = 10_000): { error: (err: unknown) => void; ready: () => void } {
  let last = 0;
  let left = 0;
  let troubled = false;
  return {
    error: (err) => {
      troubled = true;
      const now = Date.now();
      if (now - last < everyMs) {
        left++;
        return;
      }
      log.warn({ redis: maskUrl(url), code: (err as { code?: unknown })?.code ?? (err as Error)?.message, alsoSince: left }, 'Redis does not answer; retrying');
      last = now;
      left = 0;
    },
    ready: () => {
      if (!troubled) return;
      troubled = false;
      log.info({ redis: maskUrl(url) }, 'Redis answers again');
    },
  };
}

/** True for errors that mean Redis cannot be reached right now. */
export function isRedisUnavailable(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = (err as NodeJS.ErrnoException).code;
  return (
    ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH', 'EAI_AGAIN'].includes(code ?? '') ||
    err.name === 'MaxRetriesPerRequestError' ||
    /Connection is closed|Stream isn't writeable|max retries per request|Command timed out|LOADING|enableOfflineQueue/i.test(err.message)
  );
}

function connect(url: string, opts: RedisOptions): RedisClient {
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
  await answerWithin(redis.ping(), ms);
}

/**
 * A command's reply, or an error after `ms`: while Redis is out of reach a command waits in
 * the client's offline queue for as long as that lasts, and one queued while the client is
 * between reconnect attempts is never answered if the client is then disconnected.
 */
export async function answerWithin<T>(reply: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([reply, new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms)))]);
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
