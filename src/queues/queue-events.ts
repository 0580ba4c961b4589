import { QueueEvents } from 'bullmq';
import { createRedis, reportRedisError, type RedisClient } from './redis.ts';

/**
 * Opens BullMQ's event stream of a queue on its own connection, reading from the stream's
 * end as it is now, not from wherever it ends when the first read starts: a job that ends in
 * between (after its waiter looked) is not missed. BullMQ's default ('$') loses such an end,
 * and the waiter then waits out its whole timeout.
 */
export async function openQueueEvents(redisUrl: string, queueName: string, prefix: string): Promise<{ events: QueueEvents; connection: RedisClient }> {
  const connection = createRedis(redisUrl);
  const [last] = await connection.xrevrange(`${prefix}:${queueName}:events`, '+', '-', 'COUNT', 1);
  const events = new QueueEvents(queueName, { connection, prefix, lastEventId: last?.[0] ?? '0-0' });
  // Every waiting caller adds a listener; many concurrent waits are normal here.
  events.setMaxListeners(0);
  events.on('error', reportRedisError);
  await events.waitUntilReady();
  return { events, connection };
}
