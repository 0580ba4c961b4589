import { randomBytes } from 'node:crypto';
import { Queue, type JobsOptions } from 'bullmq';
import type { Redis } from 'ioredis';
import type { Config } from '../config.ts';
import { laneIdOf, type LeaseIdentity } from '../lease.ts';
import {
  DEFAULT_DEADLINE_MS,
  OperationJobDataSchema,
  OperationParamsSchemas,
  type OperationJobData,
  type OperationName,
  OperationNameSchema,
} from '../operations.ts';
import { Lanes } from './lane.ts';

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
};

export interface Enqueued {
  jobId: string;
  laneId: string;
}

export type QueueSettings = Pick<
  Config,
  'LEASE_OPS_PREFIX' | 'LEASE_OPS_QUEUE' | 'LEASE_OPS_KEEP_COMPLETED_S' | 'LEASE_OPS_KEEP_FAILED_S'
>;

/**
 * The lease-ops queue: one BullMQ queue for every lease, plus the lanes that keep each
 * lease's operations one at a time and in order. Used by producers and workers alike.
 */
export class OperationsQueue {
  readonly queue: Queue;
  readonly lanes: Lanes;
  private readonly jobOptions: JobsOptions;

  constructor(
    readonly connection: Redis,
    readonly settings: QueueSettings,
  ) {
    this.queue = new Queue(settings.LEASE_OPS_QUEUE, { connection, prefix: settings.LEASE_OPS_PREFIX });
    this.lanes = this.lanesOn(connection);
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
    const data = buildJobData(request);
    const laneId = laneIdOf(data.lease);
    const jobId = `${laneId}.${randomBytes(12).toString('base64url')}`;
    await this.queue.add(data.op, data, { ...this.jobOptions, jobId });
    // The sanctioned exception: a force-stop goes ahead of queued and backing-off
    // operations of its lease, never alongside an executing one.
    await this.lanes.push(laneId, jobId, data.op === 'force-stop' ? 'front' : 'tail');
    return { jobId, laneId };
  }

  /** The lanes of this queue, spoken to over another connection. */
  lanesOn(connection: Redis): Lanes {
    return new Lanes(connection, this.settings.LEASE_OPS_PREFIX, this.queue.toKey(''), PARK_MS / 2);
  }

  async close(): Promise<void> {
    await this.queue.close();
  }
}

/** Turns a request into validated job data; throws a ZodError naming every bad field. */
export function buildJobData(request: EnqueueRequest, now = Date.now()): OperationJobData {
  const op = OperationNameSchema.parse(request.op);
  const params = OperationParamsSchemas[op].parse(request.params);
  const deadlineMs = request.deadlineMs ?? DEFAULT_DEADLINE_MS[op];
  return OperationJobDataSchema.parse({ op, lease: request.lease, params, acceptedAt: now, deadlineAt: now + deadlineMs });
}
