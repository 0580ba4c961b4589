import { DelayedError, Queue, UnrecoverableError, Worker, type Job } from 'bullmq';
import type { Redis } from 'ioredis';
import { z } from 'zod';
import type { Config } from '../config.ts';
import { laneIdOfJobId } from '../lease.ts';
import type { Logger } from '../logger.ts';
import { OperationJobDataSchema } from '../operations.ts';
import { runOperation } from '../processors/index.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import { BACKOFF_TYPE, OperationsQueue, PARK_MS } from './operations-queue.ts';
import { createRedis } from './redis.ts';
import { decideRetry, DeadlineExceededError, OperationFailedError, RetryLaterError } from './retry-policy.ts';
import { sweepLanes } from './sweep.ts';

const SWEEP_SCHEDULER_ID = 'lane-sweep';

export type WorkerSettings = Pick<
  Config,
  | 'REDIS_URL'
  | 'LEASE_OPS_PREFIX'
  | 'LEASE_OPS_QUEUE'
  | 'LEASE_OPS_CONCURRENCY'
  | 'LEASE_OPS_LOCK_MS'
  | 'LEASE_OPS_STALLED_INTERVAL_MS'
  | 'LEASE_OPS_MAX_STALLED'
  | 'LEASE_OPS_SWEEP_INTERVAL_MS'
  | 'LEASE_OPS_SWEEP_STALE_MS'
  | 'LEASE_OPS_KEEP_COMPLETED_S'
  | 'LEASE_OPS_KEEP_FAILED_S'
>;

/**
 * A worker replica: runs lease operations from the shared queue, one at a time per lease,
 * and takes part in the lane sweep. Start as many as you like.
 */
export class LeaseWorker {
  readonly ops: OperationsQueue;
  private readonly worker: Worker;
  private readonly maintenanceQueue: Queue;
  private readonly maintenanceWorker: Worker;
  private readonly connection: Redis;
  /** Connections handed to BullMQ, which leaves closing them to their owner. */
  private readonly ownedConnections: Redis[] = [];
  private closing: Promise<void> | null = null;

  constructor(
    private readonly settings: WorkerSettings,
    private readonly providers: ProviderRegistry,
    private readonly log: Logger,
  ) {
    this.connection = createRedis(settings.REDIS_URL);
    const connect = () => {
      const c = createRedis(settings.REDIS_URL);
      this.ownedConnections.push(c);
      return c;
    };
    this.ops = new OperationsQueue(this.connection, settings, log);
    const prefix = settings.LEASE_OPS_PREFIX;
    this.worker = new Worker(settings.LEASE_OPS_QUEUE, (job, token, signal) => this.process(job, token, signal), {
      connection: connect(),
      prefix,
      concurrency: settings.LEASE_OPS_CONCURRENCY,
      lockDuration: settings.LEASE_OPS_LOCK_MS,
      stalledInterval: settings.LEASE_OPS_STALLED_INTERVAL_MS,
      maxStalledCount: settings.LEASE_OPS_MAX_STALLED,
      autorun: false,
      settings: {
        // The processor already chose the delay (retry-policy.ts); -1 means do not retry.
        backoffStrategy: (_attempts, type, err) =>
          type === BACKOFF_TYPE && err instanceof RetryLaterError ? err.delayMs : -1,
      },
    });
    this.worker.on('error', (err) => this.log.error({ err }, 'worker error'));

    // Maintenance runs on its own small queue so a deep backlog of operations never
    // delays the sweep that keeps lanes moving.
    const maintenanceName = `${settings.LEASE_OPS_QUEUE}-maintenance`;
    this.maintenanceQueue = new Queue(maintenanceName, { connection: this.connection, prefix });
    this.maintenanceWorker = new Worker(
      maintenanceName,
      async (job) => {
        if (job.name !== SWEEP_SCHEDULER_ID) throw new UnrecoverableError(`unknown maintenance job ${job.name}`);
        const report = await sweepLanes(this.ops, settings.LEASE_OPS_SWEEP_STALE_MS, this.log);
        if (report.dropped || report.handedOff) this.log.info(report, 'lane sweep repaired lanes');
        return report;
      },
      { connection: connect(), prefix, concurrency: 1, autorun: false },
    );
    this.maintenanceWorker.on('error', (err) => this.log.error({ err }, 'maintenance worker error'));
  }

  /** Starts processing; resolves once the workers are connected and the sweep is scheduled. */
  async start(): Promise<void> {
    // One schedule however many replicas upsert it: BullMQ keys it by id.
    await this.maintenanceQueue.upsertJobScheduler(
      SWEEP_SCHEDULER_ID,
      { every: this.settings.LEASE_OPS_SWEEP_INTERVAL_MS },
      { name: SWEEP_SCHEDULER_ID, opts: { removeOnComplete: true, removeOnFail: 100 } },
    );
    void this.worker.run();
    void this.maintenanceWorker.run();
    await Promise.all([this.worker.waitUntilReady(), this.maintenanceWorker.waitUntilReady()]);
  }

  /** Graceful stop: take no new jobs, let running ones finish, then disconnect. */
  close(): Promise<void> {
    this.closing ??= (async () => {
      await Promise.all([this.worker.close(), this.maintenanceWorker.close()]);
      await Promise.all([this.maintenanceQueue.close(), this.ops.close()]);
      await this.providers.close();
      for (const c of [this.connection, ...this.ownedConnections]) c.disconnect();
    })();
    return this.closing;
  }

  private async process(job: Job, token: string | undefined, signal: AbortSignal | undefined): Promise<unknown> {
    const jobId = job.id ?? '';
    const laneId = laneIdOfJobId(jobId);
    if (!laneId) throw new UnrecoverableError(`job ${jobId} has no lane: only lease-ops' enqueue may add jobs`);

    const acquired = await this.ops.lanes.acquire(laneId, jobId);
    switch (acquired.kind) {
      case 'park':
        // Not this job's turn (it was promoted by hand, or a force-stop went ahead of its
        // backoff): back to the parked set until the lane hands it off.
        await job.moveToDelayed(Date.now() + PARK_MS, token);
        throw new DelayedError();
      case 'done':
        // A re-run after a crash between the lane's release and BullMQ's completion.
        if (acquired.outcome.status === 'completed') return acquired.outcome.result;
        throw new UnrecoverableError(acquired.outcome.error);
      case 'orphan':
        throw new UnrecoverableError('operation was never accepted into its lane (its enqueue was interrupted)');
      case 'run':
        break;
    }
    const fence = acquired.token;

    const parsed = OperationJobDataSchema.safeParse(job.data);
    if (!parsed.success) {
      return this.fail(laneId, jobId, fence, 'invalid_job_data', `invalid job data: ${z.prettifyError(parsed.error)}`);
    }
    const data = parsed.data;
    const log = this.log.child({
      leaseId: data.lease.leaseId,
      provider: data.lease.provider,
      jobId,
      op: data.op,
      attempt: job.attemptsMade + 1,
    });
    const provider = this.providers.get(data.lease.provider);
    if (!provider) {
      return this.fail(laneId, jobId, fence, 'unknown_provider', `no provider named "${data.lease.provider}" is configured`);
    }
    if (Date.now() >= data.deadlineAt) {
      return this.fail(laneId, jobId, fence, 'deadline_exceeded', 'deadline passed before the operation could start');
    }

    let result: unknown;
    try {
      const ctx = { lease: data.lease, jobId, attempt: job.attemptsMade + 1, signal: signal ?? new AbortController().signal, log };
      result = await runOperation(provider, ctx, data);
    } catch (err) {
      const decision = decideRetry(err, job.attemptsMade, data.deadlineAt, Date.now());
      if (decision.retry) {
        log.info({ err, delayMs: decision.delayMs }, 'operation will be retried');
        await this.ops.lanes.yield(laneId, jobId, fence);
        throw new RetryLaterError(decision.delayMs, err);
      }
      const message = err instanceof Error ? err.message : String(err);
      log.warn({ err, reason: decision.reason }, 'operation failed');
      if (decision.reason === 'deadline') {
        return this.fail(laneId, jobId, fence, 'deadline_exceeded', `last provider error: ${message}`);
      }
      return this.fail(laneId, jobId, fence, errorCode(err), message);
    }

    const released = await this.ops.lanes.release(laneId, jobId, fence, { status: 'completed', result });
    if (released.kind === 'stale') {
      log.warn('attempt was superseded while it ran; its result is discarded');
      throw new Error('attempt superseded by a newer attempt of the same job');
    }
    if (released.kind === 'next') await this.ops.handOff(laneId, released.jobId);
    return result;
  }

  /** Records a final failure in the lane, hands off the next job, and fails this one for good. */
  private async fail(laneId: string, jobId: string, fence: string, code: string, message: string): Promise<never> {
    const err = code === 'deadline_exceeded' ? new DeadlineExceededError(message) : new OperationFailedError(code, message);
    const released = await this.ops.lanes.release(laneId, jobId, fence, { status: 'failed', code, error: err.message });
    if (released.kind === 'next') await this.ops.handOff(laneId, released.jobId);
    throw err;
  }
}

function errorCode(err: unknown): string {
  if (err && typeof err === 'object' && 'code' in err && typeof err.code === 'string') return err.code;
  return 'provider_error';
}
