import { Queue, QueueEvents } from 'bullmq';
import { createRedis, reportRedisError, type RedisClient } from './redis.ts';

/**
 * Opens BullMQ's event stream of a queue on its own connection, reading from the stream's
 * end as it is now, not from wherever it ends when the first read starts: a job that ends in
 * between (after its waiter looked) is not missed. BullMQ's default ('$') loses such an end,
 * and the waiter then waits out its whole timeout.
 */
export async function openQueueEvents(redisUrl: string, queueName: string, prefix: string, connection: RedisClient = createRedis(redisUrl)): Promise<{ events: QueueEvents; connection: RedisClient }> {
  const [last] = await connection.xrevrange(`${prefix}:${queueName}:events`, '+', '-', 'COUNT', 1);
  const events = new QueueEvents(queueName, { connection, prefix, lastEventId: last?.[0] ?? '0-0' });
  // Every waiting caller adds a listener; many concurrent waits are normal here.
  events.setMaxListeners(0);
  events.on('error', reportRedisError);
  await events.waitUntilReady();
  return { events, connection };
}

/**
 * A queue that callers add jobs to and wait on (a probe, an exec): the queue and its event
 * stream, each opened on first use and closed together.
 */
export class WaitedQueue {
  private queue: Queue | null = null;
  private events: Promise<{ events: QueueEvents; connection: RedisClient }> | null = null;

  constructor(
    private readonly connection: RedisClient,
    private readonly settings: { REDIS_URL: string; LEASE_OPS_PREFIX: string },
    readonly name: string,
    /** What CLIENT LIST calls its event stream's connection. */
    private readonly connectionName: string,
  ) {}

  /** The queue, and its events opened (from the stream's end) before anything is added. */
  async open(): Promise<{ queue: Queue; events: QueueEvents }> {
    if (!this.queue) {
      this.queue = new Queue(this.name, { connection: this.connection, prefix: this.settings.LEASE_OPS_PREFIX });
      this.queue.on('error', reportRedisError);
    }
    const { events } = await (this.events ??= openQueueEvents(this.settings.REDIS_URL, this.name, this.settings.LEASE_OPS_PREFIX, createRedis(this.settings.REDIS_URL, { connectionName: this.connectionName })));
    return { queue: this.queue, events };
  }

  async close(): Promise<void> {
    if (this.events) {
      const { events, connection } = await this.events;
      await events.close().catch(() => undefined);
      connection.disconnect();
    }
    await this.queue?.close();
  }
}
