import { randomBytes } from 'node:crypto';
import { Queue, type JobsOptions } from 'bullmq';
import type { Redis } from 'ioredis';
import type { Config } from '../config.ts';
import { laneIdOf, type LeaseIdentity } from '../lease.ts';
import type { Logger } from '../logger.ts';
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
    private readonly log?: Logger,
  ) {
    this.queue = new Queue(settings.LEASE_OPS_QUEUE, { connection, prefix: settings.LEASE_OPS_PREFIX });
    this.lanes = new Lanes(connection, settings.LEASE_OPS_PREFIX, (jobId) => this.queue.toKey(jobId));
    this.jobOptions = {
      delay: PARK_MS,
      attempts: UNBOUNDED_ATTEMPTS,
      backoff: { type: BACKOFF_TYPE },
      removeOnComplete: { age: settings.LEASE_OPS_KEEP_COMPLETED_S },
      removeOnFail: { age: settings.LEASE_OPS_KEEP_FAILED_S },
    };
  }

  /**
   * Validates and accepts one operation. The job is stored parked first and only then
   * joins its lane, so a lane never names a job that does not exist.
   */
  async enqueue(request: EnqueueRequest): Promise<Enqueued> {
    const data = buildJobData(request);
    const laneId = laneIdOf(data.lease);
    const jobId = `${laneId}.${randomBytes(12).toString('base64url')}`;
    await this.queue.add(data.op, data, { ...this.jobOptions, jobId });
    // The sanctioned exception: a force-stop goes ahead of queued and backing-off
    // operations of its lease, never alongside an executing one.
    const position = data.op === 'force-stop' ? 'front' : 'tail';
    if (await this.lanes.push(laneId, jobId, position)) await this.handOff(laneId, jobId);
    return { jobId, laneId };
  }

  /**
   * Makes a lane's new head runnable. A head whose job was removed meanwhile is dropped
   * and the next one tried, so a removed job never blocks its lane.
   */
  async handOff(laneId: string, jobId: string): Promise<void> {
    let next: string | null = jobId;
    while (next) {
      try {
        await this.queue.backend.promote(next);
        return;
      } catch (err) {
        const state = await this.queue.getJobState(next);
        if (state !== 'unknown') return; // already waiting or active (e.g. promoted by hand)
        this.log?.warn({ laneId, jobId: next }, 'lane head vanished before hand-off; dropping it');
        const dropped = await this.lanes.drop(laneId, next);
        next = dropped.kind === 'next' ? dropped.jobId : null;
      }
    }
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
