import { Job, QueueEvents } from 'bullmq';
import { z } from 'zod';
import { loadConfig, type Config } from './config.ts';
import { InvalidRequestError, OperationNotFoundError, WaitTimeoutError } from './errors.ts';
import { LeaseIdentitySchema, type LeaseIdentity } from './lease.ts';
import type { OperationName, OperationParams } from './operations.ts';
import { Inspector, type AttentionItem, type AttentionReason, type LeaseView, type OperationView, type QueueOverview } from './queues/inspect.ts';
import { LeaseRecords } from './queues/lease-records.ts';
import { OperationsQueue, type Enqueued } from './queues/operations-queue.ts';
import { createRedis, type RedisClient } from './queues/redis.ts';

export { IdempotencyKeyReusedError, InvalidRequestError, LeaseOpsError, OperationNotFoundError, QueueFullError, WaitTimeoutError } from './errors.ts';

export interface OperationResult {
  jobId: string;
  state: 'completed' | 'failed';
  result?: unknown;
  error?: string;
}

/** How long a fail-fast client waits for Redis to answer one command. */
const FAIL_FAST_TIMEOUT_MS = 2_000;

export interface EnqueueOptions {
  /** The operation fails with deadline_exceeded if it has not succeeded this many ms after acceptance. */
  deadlineMs?: number;
  /** The same key returns the same job for 24 h, however often the request is repeated. */
  idempotencyKey?: string;
}

/**
 * The control plane's handle on lease-ops: enqueue operations, read them and the lanes of
 * their leases, and wait for results. Bad input throws InvalidRequestError before anything
 * is written.
 */
export class LeaseOpsClient {
  readonly ops: OperationsQueue;
  readonly inspector: Inspector;
  private events: Promise<QueueEvents> | null = null;
  private eventsConnection: RedisClient | null = null;
  private readonly connection: RedisClient;

  constructor(
    private readonly settings: Config = loadConfig(),
    opts: { failFast?: boolean } = {},
  ) {
    this.connection = createRedis(
      settings.REDIS_URL,
      // Fail fast: while Redis is unreachable a call errors within the timeout instead of
      // waiting in ioredis' offline queue, where it would run late, after its caller gave up.
      opts.failFast ? { enableOfflineQueue: false, commandTimeout: FAIL_FAST_TIMEOUT_MS, maxRetriesPerRequest: 0 } : {},
    );
    this.ops = new OperationsQueue(this.connection, settings);
    this.inspector = new Inspector(this.ops, new LeaseRecords(this.connection, settings.LEASE_OPS_PREFIX), {
      stuckStoppingMs: settings.LEASE_OPS_STUCK_STOPPING_MS,
      // The sweep repairs a quiet lane within stale + interval; past twice that, it is news.
      blockedAfterMs: 2 * (settings.LEASE_OPS_SWEEP_STALE_MS + settings.LEASE_OPS_SWEEP_INTERVAL_MS),
    });
  }

  /** Resolves once the Redis connection is up (with failFast, calls before that fail). */
  async connected(): Promise<void> {
    if (this.connection.status === 'ready') return;
    await new Promise<void>((resolve, reject) => {
      this.connection.once('ready', resolve);
      this.connection.once('end', () => reject(new Error('Redis connection ended')));
    });
  }

  /** Accepts an operation for a lease and returns its job id at once. */
  async enqueue<Op extends OperationName>(
    op: Op,
    lease: LeaseIdentity,
    params: OperationParams[Op] | Record<string, unknown>,
    opts: EnqueueOptions = {},
  ): Promise<Enqueued> {
    try {
      return await this.ops.enqueue({ op, lease, params, ...opts });
    } catch (err) {
      if (err instanceof z.ZodError) throw InvalidRequestError.fromZod(err);
      throw err;
    }
  }

  /**
   * An operation's state, result or error; null if there is no such operation (or it was
   * removed after its retention). With `waitMs`, waits up to that long for it to end first.
   */
  async getOperation(jobId: string, opts: { waitMs?: number } = {}): Promise<OperationView | null> {
    const view = await this.inspector.operation(jobId);
    return view && opts.waitMs ? this.waitForEnd(view, opts.waitMs) : view;
  }

  /**
   * Given a view just read, waits up to `waitMs` for the operation to end (BullMQ's events)
   * and returns it as it is then; null if it was removed meanwhile.
   */
  async waitForEnd(view: OperationView, waitMs: number): Promise<OperationView | null> {
    if (view.state === 'completed' || view.state === 'failed') return view;
    const job = await Job.fromId(this.ops.queue, view.jobId);
    if (!job) return null;
    try {
      await job.waitUntilFinished(await this.queueEvents(), waitMs);
    } catch {
      // Timed out, or the job failed: either way the view below tells which.
    }
    return this.inspector.operation(view.jobId);
  }

  /** Waits for an operation to end, driven by BullMQ's event stream (no polling). */
  async waitForResult(jobId: string, timeoutMs = 60_000): Promise<OperationResult> {
    const view = await this.getOperation(jobId, { waitMs: timeoutMs });
    if (!view) throw new OperationNotFoundError(jobId);
    if (view.state === 'completed') return { jobId, state: 'completed', result: view.result };
    if (view.state === 'failed') return { jobId, state: 'failed', error: view.error?.message };
    throw new WaitTimeoutError(`operation ${jobId} still ${view.state} after ${timeoutMs} ms`);
  }

  /** A lease's lane: what executes, what waits, what backs off, and what was last seen of the sandbox. */
  async getLease(lease: LeaseIdentity): Promise<LeaseView> {
    const parsed = LeaseIdentitySchema.safeParse(lease);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error);
    return this.inspector.lease(parsed.data);
  }

  /** Leases stuck stopping, whose last operation failed, or whose lane is blocked. */
  leasesNeedingAttention(limit = 200, visible?: (lease: LeaseIdentity | null) => boolean): Promise<AttentionItem[]> {
    return this.inspector.attention(limit, visible);
  }

  /** Leases needing attention, counted by reason (see Inspector.attentionCounts). */
  attentionCounts(): Promise<Record<AttentionReason, number>> {
    return this.inspector.attentionCounts();
  }

  /** The whole queue at a glance: operations by state, open lanes, leases needing attention. */
  overview(): Promise<QueueOverview> {
    return this.inspector.overview();
  }

  /** BullMQ's event stream for this queue (active, completed, failed, delayed, ...). */
  queueEventStream(): Promise<QueueEvents> {
    return this.queueEvents();
  }

  private queueEvents(): Promise<QueueEvents> {
    this.events ??= (async () => {
      this.eventsConnection = createRedis(this.settings.REDIS_URL);
      const events = new QueueEvents(this.settings.LEASE_OPS_QUEUE, {
        connection: this.eventsConnection,
        prefix: this.settings.LEASE_OPS_PREFIX,
      });
      // Every waiting caller adds a listener; many concurrent waits are normal here.
      events.setMaxListeners(0);
      await events.waitUntilReady();
      return events;
    })();
    return this.events;
  }

  async close(): Promise<void> {
    if (this.events) await (await this.events).close();
    await this.ops.close();
    this.eventsConnection?.disconnect();
    this.connection.disconnect();
  }
}
