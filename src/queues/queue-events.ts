import { setMaxListeners, type EventEmitter } from 'node:events';
import { Job, Queue, QueueEvents } from 'bullmq';
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
 * A job's end, as BullMQ's Job.waitUntilFinished gives it (its return value, or an Error with
 * its failure; "timed out" after `ttlMs`), where that one could not serve a closing client: its
 * first read of the job runs in a promise no one handles, which rejects unhandled once the
 * client's connection is gone (helper-39's CI run), and its timer outlives a close (105 s for
 * an exec). Here a failed first read leaves it to the events, and `signal` ends the wait, its
 * timer and its listeners at once.
 */
export function waitForJobEnd(queue: Queue, jobId: string, events: QueueEvents, ttlMs: number, signal: AbortSignal): Promise<unknown> {
  // BullMQ emits a job's own events by name (completed:<id>), which its typings do not list.
  const emitter = events as unknown as EventEmitter;
  return new Promise((resolve, reject) => {
    const completedEvent = `completed:${jobId}`;
    const failedEvent = `failed:${jobId}`;
    const settle = (end: () => void) => {
      clearTimeout(timer);
      emitter.off(completedEvent, onCompleted);
      emitter.off(failedEvent, onFailed);
      signal.removeEventListener('abort', onAbort);
      end();
    };
    const onCompleted = (args: { returnvalue: unknown }) => settle(() => resolve(args.returnvalue));
    const onFailed = (args: { failedReason: string }) => settle(() => reject(new Error(args.failedReason)));
    const onAbort = () => settle(() => reject(new Error(`the wait for job ${jobId} ended: its queue is closing`)));
    const timer = setTimeout(() => settle(() => reject(new Error(`Job wait timed out before finishing, no finish notification arrived after ${ttlMs}ms (id=${jobId})`))), ttlMs);
    emitter.on(completedEvent, onCompleted);
    emitter.on(failedEvent, onFailed);
    if (signal.aborted) return onAbort();
    signal.addEventListener('abort', onAbort, { once: true });
    // It may have ended before the listeners were on (the events are read from when they opened).
    void Job.fromId(queue, jobId).then(
      (job) => {
        if (!job?.finishedOn) return;
        if (job.failedReason) onFailed({ failedReason: job.failedReason });
        else onCompleted({ returnvalue: job.returnvalue });
      },
      () => undefined,
    );
  });
}

/**
 * A queue that callers add jobs to and wait on (a probe, an exec): the queue and its event
 * stream, each opened on first use and closed together.
 */
export class WaitedQueue {
  private queue: Queue | null = null;
  private events: Promise<{ events: QueueEvents; connection: RedisClient }> | null = null;
  /** Aborted by close(): every wait for a job's end ends then (each listens on it while it waits, so no limit of 10). */
  private readonly closing = (() => {
    const controller = new AbortController();
    setMaxListeners(0, controller.signal);
    return controller;
  })();

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

  /** A job's end (waitForJobEnd), or an Error once this closes. */
  waitFor(jobId: string, events: QueueEvents, ttlMs: number): Promise<unknown> {
    return waitForJobEnd(this.queue!, jobId, events, ttlMs, this.closing.signal);
  }

  async close(): Promise<void> {
    this.closing.abort();
    if (this.events) {
      const { events, connection } = await this.events;
      await events.close().catch(() => undefined);
      connection.disconnect();
    }
    await this.queue?.close();
  }
}
