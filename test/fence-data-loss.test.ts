import { once } from 'node:events';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { createLogger } from '../src/logger.ts';
import { fencedTransport } from '../src/providers/fenced-transport.ts';
import { Attempt, Fencing, StaleAttemptError } from '../src/queues/fencing.ts';
import { createRedis, type RedisClient } from '../src/queues/redis.ts';
import { RedisCluster } from './helpers/redis-cluster.ts';
import { RedisProcess } from './helpers/redis-process.ts';

// A fence confirmed by one Redis says nothing once that Redis is gone: a restart without
// persistence (or a failover to a replica that had not caught up) takes the lane's token and
// the lock, and a successor can start at once, long before the lock the attempt was told of
// would have expired. Seen in the short chaos campaign: an attempt confirmed before the data
// loss called its sandbox after Redis was back, beside the lease's next operation.
/** The connection's close (events.once would reject on the 'error' a reset connection emits first). */
const closeOf = (redis: RedisClient) => new Promise<void>((resolve) => redis.once('close', () => resolve()));

describe('a fence across a Redis restart that lost its data', () => {
  let server: RedisProcess | null = null;
  let redis: RedisClient | null = null;
  let fencing: Fencing | null = null;
  let cloud: http.Server | null = null;
  afterEach(async () => {
    fencing?.stop();
    redis?.disconnect();
    cloud?.close();
    await server?.stop();
    server = redis = fencing = cloud = null;
  });

  it('is no longer trusted once the connection closed: the request is dropped and the next check finds the attempt stale', { timeout: 30_000 }, async () => {
    server = await RedisProcess.start();
    redis = createRedis(server.url);
    const received: string[] = [];
    cloud = http.createServer((req, res) => {
      received.push(req.url ?? '');
      res.end('{}');
    });
    cloud.listen(0, '127.0.0.1');
    await once(cloud, 'listening');
    const port = (cloud.address() as AddressInfo).port;

    // The lane's holder and the job's lock, as the lane scripts and BullMQ leave them.
    const exec = (laneId: string) => `t:lane:${laneId}:exec`;
    const lock = (jobId: string) => `t:job:${jobId}:lock`;
    await redis.hset(exec('l1'), 'token', '41');
    await redis.set(lock('j1'), 'lock-a', 'PX', 30_000);
    fencing = new Fencing(redis, exec, lock, createLogger({ level: 'silent' }), 60_000);
    const attempt = new Attempt('j1', 'l1', '41', 'lock-a');
    fencing.track(attempt);
    await fencing.check(attempt);
    expect(attempt.fresh()).toBe(true);

    const send = (path: string) =>
      new Promise<string>((resolve) => {
        const req = fencedTransport(() => attempt.fresh()).request({ host: '127.0.0.1', port, path, method: 'GET' }, (res) => {
          res.resume();
          res.on('end', () => resolve(`sent ${res.statusCode}`));
        });
        req.on('error', (err) => resolve(`dropped: ${(err as { code?: string }).code}`));
        req.end();
      });
    expect(await send('/before')).toBe('sent 200');

    // Redis dies and comes back empty; the connection's close is the moment to stop trusting.
    const closed = closeOf(redis);
    await server.crash();
    await closed;
    await server.restart();
    expect(attempt.fresh()).toBe(false);
    expect(await send('/after')).toBe('dropped: fence_window_passed');
    // The next check reaches the new, empty Redis: the attempt holds nothing there.
    await expect(fencing.check(attempt)).rejects.toBeInstanceOf(StaleAttemptError);
    expect(received).toEqual(['/before']);
  });

  it('does not take an answer sent before the connection closed as a confirmation', { timeout: 30_000 }, async () => {
    server = await RedisProcess.start();
    redis = createRedis(server.url);
    const exec = (laneId: string) => `t:lane:${laneId}:exec`;
    const lock = (jobId: string) => `t:job:${jobId}:lock`;
    await redis.hset(exec('l1'), 'token', '7');
    await redis.set(lock('j1'), 'lock-a', 'PX', 30_000);
    fencing = new Fencing(redis, exec, lock, createLogger({ level: 'silent' }), 60_000);
    const attempt = new Attempt('j1', 'l1', '7', 'lock-a');
    fencing.track(attempt);
    // The check is sent; the server is frozen, then killed and started empty before it answers:
    // ioredis fails the check with the connection's error, and the check is asked again of
    // the Redis that answers now, which holds nothing of the attempt.
    server.pause();
    const checked = fencing.check(attempt).then(
      () => 'confirmed',
      (err: unknown) => (err instanceof StaleAttemptError ? 'stale' : `error: ${String(err)}`),
    );
    await new Promise((r) => setImmediate(r));
    const closed = closeOf(redis);
    await server.crash();
    await closed;
    await server.restart();
    expect(await checked).toBe('stale');
    expect(attempt.fresh()).toBe(false);
  });

  it('on Redis Cluster too: the restart of the master holding the lane forgets the confirmation', { timeout: 60_000 }, async () => {
    const cluster = await RedisCluster.start(3);
    const client = createRedis(cluster.url);
    const fencer = new Fencing(client, (laneId) => `{fd}:lane:${laneId}:x`, (jobId) => `{fd}:job:${jobId}:lock`, createLogger({ level: 'silent' }), 60_000);
    try {
      await client.hset('{fd}:lane:l1:x', 'token', '9');
      await client.set('{fd}:job:j1:lock', 'lock-a', 'PX', 30_000);
      const attempt = new Attempt('j1', 'l1', '9', 'lock-a');
      fencer.track(attempt);
      await fencer.check(attempt);
      expect(attempt.fresh()).toBe(true);
      // The master that holds the {fd} slot dies and comes back empty (same node id, same slots).
      const sizes = await Promise.all(cluster.nodes.map(async (n) => {
        const direct = createRedis(n.url);
        try {
          return await direct.dbsize();
        } finally {
          direct.disconnect();
        }
      }));
      const owner = cluster.nodes[sizes.findIndex((n) => n > 0)]!;
      const gone = new Promise<void>((resolve) => client.once('-node', () => resolve()));
      await owner.crash();
      await gone;
      expect(attempt.fresh()).toBe(false);
      await owner.restart();
      // Until the node is back in the cluster the check fails (redirections, CLUSTERDOWN) and
      // nothing is sent; once it answers, the attempt holds nothing there.
      const outcome = async () => {
        for (const until = Date.now() + 20_000; Date.now() < until; await new Promise((r) => setTimeout(r, 200))) {
          const err = await fencer.check(attempt).then(() => null, (e: unknown) => e);
          if (err instanceof StaleAttemptError) return 'stale';
          if (err === null) return 'confirmed';
          expect(attempt.fresh()).toBe(false);
        }
        return 'no answer';
      };
      expect(await outcome()).toBe('stale');
    } finally {
      fencer.stop();
      client.disconnect();
      await cluster.stop();
    }
  });
});
