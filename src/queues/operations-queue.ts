import { createHash, randomBytes } from 'node:crypto';
import { Job, Queue, type JobsOptions } from 'bullmq';
import { z } from 'zod';
import type { RedisClient } from './redis.ts';
import type { Config } from '../config.ts';
import { laneIdOf, laneIdOfJobId, LeaseIdentitySchema, type LeaseIdentity } from '../lease.ts';
import {
  DEFAULT_DEADLINE_MS,
  OperationJobDataSchema,
  OperationParamsSchemas,
  type OperationJobData,
  type OperationName,
  OperationNameSchema,
} from '../operations.ts';
import { QueueFullError } from '../errors.ts';
import { assertTestedBullmq } from './bullmq-version.ts';
import { Lanes, type LaneOutcome } from './lane.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';

/**
 * How long a job waits in BullMQ's delayed set while it is not its lane's turn. The lane,
 * not this timer, releases it; the timer only bounds how long a job whose enqueue was cut
 * short (in BullMQ, but never in a lane) waits before a worker fails it as an orphan.
 */
export const PARK_MS = 24 * 3_600_000;

/** BullMQ's custom backoff type: the processor decides the delay (see retry-policy.ts). */
export const BACKOFF_TYPE = 'lease-ops';

/** Attempts are bounded by the operation's deadline, not by a count. */
const UNBOUNDED_ATTEMPTS = 1_000_000;

export type EnqueueRequest = {
  op: OperationName;
  lease: LeaseIdentity;
  params: unknown;
  deadlineMs?: number;
  /** The caller's key for this request: the same key returns the same job (for 24 h). */
  idempotencyKey?: string;
};

export interface Enqueued {
  jobId: string;
  laneId: string;
  /** Set when no new job was made: an identical queued request or the same key took it. */
  deduplicated?: 'coalesced' | 'idempotency-key' | 'absorbed-stop';
}

const IDEMPOTENCY_TTL_S = 24 * 3_600;

/** What a refused enqueue suggests as Retry-After: operations take seconds, so do queues. */
const FULL_RETRY_AFTER_MS = 5_000;

/**
 * Requests that mean the same as the one queued last and not yet started: a second stop of
 * the same sandbox, or a release with the same parameters. '' for none.
 */
export function coalescingKey(data: OperationJobData): string {
  if (data.op === 'stop') return `stop:${data.params.providerLeaseId}`;
  if (data.op === 'release') return `release:${createHash('sha256').update(JSON.stringify(data.params)).digest('base64url')}`;
  return '';
}

export type QueueSettings = Pick<
  Config,
  | 'LEASE_OPS_PREFIX'
  | 'LEASE_OPS_QUEUE'
  | 'LEASE_OPS_KEEP_COMPLETED_S'
  | 'LEASE_OPS_KEEP_FAILED_S'
  | 'LEASE_OPS_DEADLINES_MS'
  | 'LEASE_OPS_MAX_QUEUED_PER_LEASE'
  | 'LEASE_OPS_MAX_QUEUED'
>;

/**
 * The lease-ops queue: one BullMQ queue for every lease, plus the lanes that keep each
 * lease's operations one at a time and in order. Used by producers and workers alike.
 */
export class OperationsQueue {
  readonly queue: Queue;
  readonly lanes: Lanes;
  private readonly jobOptions: JobsOptions;
  private readonly deleteIfEqual: LuaCommand;
  /** Acquires that have not ended: job id -> lease (JSON). */
  private readonly acquiresKey: string;
  private acquiresCursor = '0';

  constructor(
    readonly connection: RedisClient,
    readonly settings: QueueSettings,
  ) {
    assertTestedBullmqOnce();
    this.queue = new Queue(settings.LEASE_OPS_QUEUE, { connection, prefix: settings.LEASE_OPS_PREFIX });
    this.lanes = this.lanesOn(connection);
    this.deleteIfEqual = luaCommand(connection, 'delete-if-equal', 1);
    this.acquiresKey = `${settings.LEASE_OPS_PREFIX}:acquires`;
    this.jobOptions = {
      delay: PARK_MS,
      attempts: UNBOUNDED_ATTEMPTS,
      backoff: { type: BACKOFF_TYPE },
      // 0 means remove at once; BullMQ's `true` does that without an age scan per job.
      removeOnComplete: settings.LEASE_OPS_KEEP_COMPLETED_S === 0 ? true : { age: settings.LEASE_OPS_KEEP_COMPLETED_S },
      removeOnFail: settings.LEASE_OPS_KEEP_FAILED_S === 0 ? true : { age: settings.LEASE_OPS_KEEP_FAILED_S },
    };
  }

  /**
   * Validates and accepts one operation. The job is stored parked first and only then
   * joins its lane (which hands it to the workers if it is the head), so a lane never
   * names a job that does not exist.
   */
  async enqueue(request: EnqueueRequest): Promise<Enqueued> {
    const data = buildJobData(request, Date.now(), this.settings.LEASE_OPS_DEADLINES_MS);
    const laneId = laneIdOf(data.lease);
    const idemKey = request.idempotencyKey === undefined ? null : this.idempotencyKey(request.idempotencyKey);
    if (idemKey) {
      const earlier = await this.connection.get(idemKey);
      const state = earlier ? await this.queue.getJobState(earlier) : 'unknown';
      if (earlier && state !== 'unknown') {
        // The earlier request may have been cut short between storing its job and joining
        // the lane (Redis went away, the caller timed out): then this retry finishes it.
        if (state === 'delayed') await this.adopt(earlier);
        return { jobId: earlier, laneId, deduplicated: 'idempotency-key' };
      }
    }
    const coalesceAs = coalescingKey(data);
    if (data.op === 'force-stop') {
      // A force-stop absorbs a stop of the same sandbox that has not started yet.
      const upgraded = await this.lanes.upgradeQueuedStop(laneId, `stop:${data.params.providerLeaseId}`, data);
      if (upgraded) {
        if (idemKey) await this.connection.set(idemKey, upgraded, 'EX', IDEMPOTENCY_TTL_S);
        return { jobId: upgraded, laneId, deduplicated: 'absorbed-stop' };
      }
    }
    const jobId = `${laneId}.${randomBytes(12).toString('base64url')}`;
    if (idemKey && (await this.connection.set(idemKey, jobId, 'EX', IDEMPOTENCY_TTL_S, 'NX')) !== 'OK') {
      const racing = await this.connection.get(idemKey);
      if (racing) return { jobId: racing, laneId, deduplicated: 'idempotency-key' };
    }
    await this.queue.add(data.op, data, { ...this.jobOptions, jobId });
    // Until it ends, an acquire is known here with its lease: if its job vanishes (an operator
    // removed it), the sweep still knows what to clean up after it (reconcileAcquires).
    if (data.op === 'acquire') await this.connection.hset(this.acquiresKey, jobId, JSON.stringify(data.lease));
    // The sanctioned exception: a force-stop goes ahead of queued and backing-off
    // operations of its lease, never alongside an executing one.
    const pushed = await this.lanes.push(laneId, jobId, data.op === 'force-stop' ? 'front' : 'tail', coalesceAs, {
      perLane: this.settings.LEASE_OPS_MAX_QUEUED_PER_LEASE,
      queued: this.settings.LEASE_OPS_MAX_QUEUED,
    });
    if (pushed.kind === 'absorbed') {
      // An identical request got in first: ours never joined the lane, so drop its job.
      await this.queue.remove(jobId);
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      if (idemKey) await this.connection.set(idemKey, pushed.by, 'EX', IDEMPOTENCY_TTL_S);
      return { jobId: pushed.by, laneId, deduplicated: 'coalesced' };
    }
    if (pushed.kind === 'full') {
      // Refused: nothing of this request may stay behind, neither its job nor its key.
      await this.queue.remove(jobId);
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      if (idemKey) await this.deleteIfEqual(idemKey, jobId);
      throw new QueueFullError(pushed.limit, pushed.count, FULL_RETRY_AFTER_MS);
    }
    return { jobId, laneId };
  }

  /**
   * Queues the clean-up of an acquire that failed for good (see processors/abandon-acquire.ts)
   * in the acquire's own lane, ahead of what waits there. Never refused by queue limits, and
   * queued once per acquire however often its failure is handled (a crash may repeat it).
   * `checkpoint` is what the acquire's attempts saved, or null when its job is gone.
   */
  async enqueueAbandon(lease: LeaseIdentity, acquireJobId: string, checkpoint: Record<string, unknown> | null): Promise<Enqueued> {
    const laneId = laneIdOf(lease);
    const now = Date.now();
    const strings = checkpoint && Object.fromEntries(Object.entries(checkpoint).filter((e): e is [string, string] => typeof e[1] === 'string'));
    const data = OperationJobDataSchema.parse({
      op: 'abandon-acquire',
      lease,
      params: { acquireJobId, checkpoint: strings },
      acceptedAt: now,
      deadlineAt: now + (this.settings.LEASE_OPS_DEADLINES_MS['abandon-acquire'] ?? DEFAULT_DEADLINE_MS['abandon-acquire']),
    });
    const jobId = `${laneId}.${createHash('sha256').update(`abandon:${acquireJobId}`).digest('base64url').slice(0, 16)}`;
    await this.queue.add(data.op, data, { ...this.jobOptions, jobId });
    const pushed = await this.lanes.push(laneId, jobId, 'front', '', { perLane: 0, queued: 0 }, true);
    await this.connection.hdel(this.acquiresKey, acquireJobId);
    return { jobId, laneId, ...(pushed.kind === 'present' ? { deduplicated: 'idempotency-key' as const } : {}) };
  }

  /** An acquire completed: it is no longer one to clean up after. */
  async acquireEnded(jobId: string): Promise<void> {
    await this.connection.hdel(this.acquiresKey, jobId);
  }

  /**
   * Acquires whose job vanished before they ended (removed by an operator) get their
   * clean-up queued, as if they had failed; ended ones are forgotten. Looks at up to `count`
   * acquires per call, continuing where the last call stopped. Returns how many it queued.
   */
  async reconcileAcquires(count = 200): Promise<number> {
    const [next, flat] = await this.connection.hscan(this.acquiresKey, this.acquiresCursor, 'COUNT', count);
    this.acquiresCursor = next;
    let queued = 0;
    for (let i = 0; i + 1 < flat.length; i += 2) {
      const jobId = flat[i]!;
      const state = await this.queue.getJobState(jobId);
      if (state === 'completed' || state === 'failed') await this.connection.hdel(this.acquiresKey, jobId);
      else if (state === 'unknown') {
        const lease = LeaseIdentitySchema.safeParse(JSON.parse(flat[i + 1]!));
        if (lease.success) {
          await this.enqueueAbandon(lease.data, jobId, null);
          queued++;
        } else await this.connection.hdel(this.acquiresKey, jobId);
      }
    }
    return queued;
  }

  /** The outcome the lane recorded for a job (null while it runs, or once the job is gone). */
  async outcomeOf(jobId: string): Promise<LaneOutcome | null> {
    const text = await this.connection.hget(this.queue.toKey(jobId), 'lo:outcome');
    if (!text) return null;
    try {
      return JSON.parse(text) as LaneOutcome;
    } catch {
      return null;
    }
  }

  /** Puts a stored job into its lane if an interrupted enqueue never did (see lane-push.lua). */
  private async adopt(jobId: string): Promise<void> {
    const laneId = laneIdOfJobId(jobId);
    const job = laneId ? await Job.fromId(this.queue, jobId) : undefined;
    if (!laneId || !job || job.delay < PARK_MS / 2) return;
    await this.lanes.push(laneId, jobId, job.name === 'force-stop' ? 'front' : 'tail', '', { perLane: 0, queued: 0 }, true);
  }

  private idempotencyKey(key: string): string {
    return `${this.settings.LEASE_OPS_PREFIX}:idem:${createHash('sha256').update(key).digest('base64url')}`;
  }

  /** The lanes of this queue, spoken to over another connection. */
  lanesOn(connection: RedisClient): Lanes {
    return new Lanes(connection, this.settings.LEASE_OPS_PREFIX, this.queue.toKey(''), PARK_MS / 2);
  }

  async close(): Promise<void> {
    await this.queue.close();
  }
}

let bullmqChecked = false;
/** Producers, workers and the API all write BullMQ's keys through the lanes: each refuses an untested BullMQ. */
function assertTestedBullmqOnce(): void {
  if (bullmqChecked) return;
  assertTestedBullmq();
  bullmqChecked = true;
}

/** Turns a request into validated job data; throws a ZodError naming every bad field. */
export function buildJobData(
  request: EnqueueRequest,
  now = Date.now(),
  deadlines: Partial<Record<OperationName, number>> = {},
): OperationJobData {
  const op = OperationNameSchema.parse(request.op);
  const params = OperationParamsSchemas[op].parse(request.params);
  // A lane serialises one sandbox: the lease it names must be the sandbox the operation touches.
  if (op !== 'acquire' && (params as { providerLeaseId: string }).providerLeaseId !== (request.lease as { leaseId?: unknown } | null)?.leaseId) {
    throw new z.ZodError([
      {
        code: 'custom',
        path: ['params', 'providerLeaseId'],
        message: 'must be the lease\'s own sandbox: lease.leaseId names the sandbox of every operation but acquire',
        input: (params as { providerLeaseId: string }).providerLeaseId,
      },
    ]);
  }
  const deadlineMs = request.deadlineMs ?? deadlines[op] ?? DEFAULT_DEADLINE_MS[op];
  return OperationJobDataSchema.parse({ op, lease: request.lease, params, acceptedAt: now, deadlineAt: now + deadlineMs });
}
