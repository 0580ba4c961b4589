import { Job, QueueEvents } from 'bullmq';
import type { Redis } from 'ioredis';
import { loadConfig, type Config } from './config.ts';
import type { LeaseIdentity } from './lease.ts';
import type { OperationName } from './operations.ts';
import { OperationsQueue, type Enqueued } from './queues/operations-queue.ts';
import { createRedis } from './queues/redis.ts';

export interface OperationResult {
  jobId: string;
  state: 'completed' | 'failed';
  result?: unknown;
  error?: string;
}

/** Thrown by waitForResult when the operation did not finish within the timeout. */
export class WaitTimeoutError extends Error {
  override name = 'WaitTimeoutError';
}

/**
 * The control plane's handle on lease-ops: enqueue operations and wait for their results.
 */
export class LeaseOpsClient {
  readonly ops: OperationsQueue;
  private events: QueueEvents | null = null;
  private eventsConnection: Redis | null = null;
  private readonly connection: Redis;

  constructor(private readonly settings: Config = loadConfig()) {
    this.connection = createRedis(settings.REDIS_URL);
    this.ops = new OperationsQueue(this.connection, settings);
  }

  enqueue<Op extends OperationName>(
    op: Op,
    lease: LeaseIdentity,
    params: unknown,
    opts: { deadlineMs?: number; idempotencyKey?: string } = {},
  ): Promise<Enqueued> {
    return this.ops.enqueue({ op, lease, params, ...opts });
  }

  /** Waits for an operation to end, driven by BullMQ's event stream (no polling). */
  async waitForResult(jobId: string, timeoutMs = 60_000): Promise<OperationResult> {
    const events = await this.queueEvents();
    const job = await Job.fromId(this.ops.queue, jobId);
    if (!job) throw new Error(`no operation ${jobId}`);
    try {
      const result = await job.waitUntilFinished(events, timeoutMs);
      return { jobId, state: 'completed', result };
    } catch (err) {
      const message = (err as Error).message;
      if (/timed out/i.test(message) && !(await job.isFailed())) throw new WaitTimeoutError(`operation ${jobId} still running after ${timeoutMs} ms`);
      return { jobId, state: 'failed', error: message };
    }
  }

  /** BullMQ's event stream for this queue (active, completed, failed, delayed, ...). */
  queueEventStream(): Promise<QueueEvents> {
    return this.queueEvents();
  }

  private async queueEvents(): Promise<QueueEvents> {
    if (!this.events) {
      this.eventsConnection = createRedis(this.settings.REDIS_URL);
      this.events = new QueueEvents(this.settings.LEASE_OPS_QUEUE, {
        connection: this.eventsConnection,
        prefix: this.settings.LEASE_OPS_PREFIX,
      });
      await this.events.waitUntilReady();
    }
    return this.events;
  }

  async close(): Promise<void> {
    await this.events?.close();
    await this.ops.close();
    this.eventsConnection?.disconnect();
    this.connection.disconnect();
  }
}
