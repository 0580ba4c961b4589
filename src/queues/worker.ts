import { DelayedError, MetricsTime, Queue, UnrecoverableError, Worker, type Job } from 'bullmq';
import { Redis } from 'ioredis';
import { z } from 'zod';
import type { Config } from '../config.ts';
import { laneIdOfJobId } from '../lease.ts';
import type { Logger } from '../logger.ts';
import { runOperation } from '../processors/index.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import type { OperationContext, SandboxState } from '../providers/types.ts';
import type { LeaseIdentity } from '../lease.ts';
import { LeaseRecords } from './lease-records.ts';
import { Attempt, Fencing, StaleAttemptError } from './fencing.ts';
import type { Lanes } from './lane.ts';
import { BACKOFF_TYPE, OperationsQueue, PARK_MS } from './operations-queue.ts';
import { createRedis, pingWithin, type RedisClient } from './redis.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import {
  type BackoffSettings,
  decideRetry,
  DEFAULT_BACKOFF,
  DeadlineExceededError,
  OperationFailedError,
  RetryLaterError,
} from './retry-policy.ts';
import { sweepLanes } from './sweep.ts';
import * as telemetry from '../telemetry.ts';
import { attemptEnded } from '../metrics.ts';
import { isProviderError, TransientError } from '../providers/errors.ts';
import { runWatchdog } from './watchdog.ts';
import { DEFAULT_DEADLINE_MS, OperationJobDataSchema, type OperationJobData } from '../operations.ts';

const SWEEP_SCHEDULER_ID = 'lane-sweep';
/** BullMQ's stall limit, set out of reach: lease-ops applies LEASE_OPS_MAX_STALLED itself. */
const BULLMQ_STALLS_UNLIMITED = 1_000_000_000;
const WATCHDOG_SCHEDULER_ID = 'stuck-stop-watchdog';

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
  | 'LEASE_OPS_BACKOFF_BASE_MS'
  | 'LEASE_OPS_BACKOFF_CAP_MS'
  | 'LEASE_OPS_BACKOFF_BY_OP'
  | 'LEASE_OPS_DEADLINES_MS'
  | 'LEASE_OPS_WATCHDOG'
  | 'LEASE_OPS_WATCHDOG_INTERVAL_MS'
  | 'LEASE_OPS_STUCK_STOPPING_MS'
  | 'LEASE_OPS_WATCHDOG_MAX_FORCE'
  | 'LEASE_OPS_BULLMQ_METRICS'
  | 'LEASE_OPS_MAX_QUEUED_PER_LEASE'
  | 'LEASE_OPS_MAX_QUEUED'
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
  private readonly connection: RedisClient;
  private readonly releaseLanes: Lanes;
  private readonly fencing: Fencing;
  readonly records: LeaseRecords;
  private readonly workerConnection: RedisClient;
  private writesHeld = false;
  /** Connections handed to BullMQ, which leaves closing them to their owner. */
  private readonly ownedConnections: RedisClient[] = [];
  private closing: Promise<void> | null = null;
  private readonly backoff: BackoffSettings;
  private readonly writeCheckpoint: LuaCommand;

  constructor(
    private readonly settings: WorkerSettings,
    private readonly providers: ProviderRegistry,
    private readonly log: Logger,
  ) {
    this.backoff = { ...DEFAULT_BACKOFF, baseMs: settings.LEASE_OPS_BACKOFF_BASE_MS, capMs: settings.LEASE_OPS_BACKOFF_CAP_MS };
    this.connection = createRedis(settings.REDIS_URL);
    const connect = () => {
      const c = createRedis(settings.REDIS_URL);
      this.ownedConnections.push(c);
      return c;
    };
    this.ops = new OperationsQueue(this.connection, settings);
    this.records = new LeaseRecords(this.connection, settings.LEASE_OPS_PREFIX);
    this.writeCheckpoint = luaCommand(this.connection, 'job-checkpoint', 1);
    const prefix = settings.LEASE_OPS_PREFIX;
    const workerConnection = connect();
    this.workerConnection = workerConnection;
    // Releases go over the BullMQ worker's own connection: Redis runs one connection's
    // commands in order, so the release (which hands off the next job) always lands just
    // before BullMQ's completion of the same job, whose fetch-next then finds that job.
    this.releaseLanes = this.ops.lanesOn(workerConnection);
    // Two parameters on purpose: BullMQ gives a processor that takes a third one an
    // AbortController per job, which costs more than a no-op operation; the attempt makes
    // its own signal only when a provider asks for it.
    this.worker = new Worker(settings.LEASE_OPS_QUEUE, (job, token) => this.process(job, token), {
      connection: workerConnection,
      prefix,
      concurrency: settings.LEASE_OPS_CONCURRENCY,
      lockDuration: settings.LEASE_OPS_LOCK_MS,
      stalledInterval: settings.LEASE_OPS_STALLED_INTERVAL_MS,
      // lease-ops counts stalls itself (see process): BullMQ's own limit would fail a job
      // without running it, even one whose outcome the lane already recorded.
      maxStalledCount: BULLMQ_STALLS_UNLIMITED,
      // An idle worker's blocking fetch gives up after 1 s (BullMQ's default is 5 s). With
      // two idle processes a backoff retry was seen waiting out the whole block timeout
      // before a worker looked again; this bounds that wait. Root cause not found yet.
      drainDelay: 1,
      autorun: false,
      // BullMQ's per-minute completed/failed counts, exported with the API's /metrics.
      ...(settings.LEASE_OPS_BULLMQ_METRICS ? { metrics: { maxDataPoints: MetricsTime.ONE_WEEK } } : {}),
      settings: {
        // The processor already chose the delay (retry-policy.ts); -1 means do not retry.
        backoffStrategy: (_attempts, type, err) =>
          type === BACKOFF_TYPE && err instanceof RetryLaterError ? err.delayMs : -1,
      },
    });
    this.worker.on('error', (err) => this.log.error({ err }, 'worker error'));
    // Fences are checked on the ops connection; the watcher runs a few times per lock period.
    this.fencing = new Fencing(
      this.connection,
      (laneId) => this.ops.lanes.execKey(laneId),
      (jobId) => `${this.ops.queue.toKey(jobId)}:lock`,
      log,
      Math.max(250, Math.floor(settings.LEASE_OPS_LOCK_MS / 4)),
    );
    this.worker.on('lockRenewalFailed', (jobIds) => this.fencing.lockLost(jobIds));

    // Maintenance runs on its own small queue so a deep backlog of operations never
    // delays the sweep that keeps lanes moving.
    const maintenanceName = `${settings.LEASE_OPS_QUEUE}-maintenance`;
    this.maintenanceQueue = new Queue(maintenanceName, { connection: this.connection, prefix });
    this.maintenanceWorker = new Worker(
      maintenanceName,
      async (job) => {
        if (job.name === WATCHDOG_SCHEDULER_ID) {
          return runWatchdog(this.ops, this.records, this.providers, {
            stuckAfterMs: settings.LEASE_OPS_STUCK_STOPPING_MS,
            maxForceStops: settings.LEASE_OPS_WATCHDOG_MAX_FORCE,
            claimMs: DEFAULT_DEADLINE_MS['force-stop'],
          }, this.log);
        }
        if (job.name !== SWEEP_SCHEDULER_ID) throw new UnrecoverableError(`unknown maintenance job ${job.name}`);
        const report = await sweepLanes(this.ops, settings.LEASE_OPS_SWEEP_STALE_MS, this.log);
        if (report.dropped || report.handedOff) this.log.info(report, 'lane sweep repaired lanes');
        const abandoned = await this.ops.reconcileAcquires();
        if (abandoned) this.log.warn({ abandoned }, 'acquires whose jobs vanished before they ended: their clean-up is queued');
        return { ...report, abandoned };
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
    this.fencing.start();
    if (this.settings.LEASE_OPS_WATCHDOG) await this.maintenanceQueue.upsertJobScheduler(
      WATCHDOG_SCHEDULER_ID,
      { every: this.settings.LEASE_OPS_WATCHDOG_INTERVAL_MS },
      { name: WATCHDOG_SCHEDULER_ID, opts: { removeOnComplete: true, removeOnFail: 100 } },
    );
    void this.worker.run();
    void this.maintenanceWorker.run();
    await Promise.all([this.worker.waitUntilReady(), this.maintenanceWorker.waitUntilReady()]);
  }

  /** Running, not closing, and Redis answers within a second. */
  async ready(): Promise<boolean> {
    if (this.closing || !this.worker.isRunning()) return false;
    return pingWithin(this.connection, 1_000).then(
      () => true,
      () => false,
    );
  }

  /** Graceful stop: take no new jobs, let running ones finish, then disconnect. */
  close(): Promise<void> {
    this.closing ??= (async () => {
      await Promise.all([this.worker.close(), this.maintenanceWorker.close()]);
      this.fencing.stop();
      await Promise.all([this.maintenanceQueue.close(), this.ops.close()]);
      await this.providers.close();
      for (const c of [this.connection, ...this.ownedConnections]) c.disconnect();
    })();
    return this.closing;
  }

  private async process(job: Job, token: string | undefined): Promise<unknown> {
    const jobId = job.id ?? '';
    const startedAt = performance.now();
    const laneId = laneIdOfJobId(jobId);
    if (!laneId) throw new UnrecoverableError(`job ${jobId} has no lane: only lease-ops' enqueue may add jobs`);

    let fence = handedOffFence(job);
    if (fence === null) {
      const acquired = await this.ops.lanes.acquire(laneId, jobId);
      switch (acquired.kind) {
        case 'park':
          // Not this job's turn (it was promoted by hand, or a force-stop went ahead of its
          // backoff): back to the parked set. The lane may have reached it meanwhile, so ask
          // the lane's repair step to hand it off if it is now the head.
          await job.moveToDelayed(Date.now() + PARK_MS, token);
          await this.ops.lanes.repair(laneId);
          throw new DelayedError();
        case 'done':
          // A re-run after a crash between the lane's release and BullMQ's completion.
          if (acquired.outcome.status === 'completed') return acquired.outcome.result;
          throw new UnrecoverableError(acquired.outcome.error);
        case 'orphan':
          throw new UnrecoverableError('operation was never accepted into its lane (its enqueue was interrupted)');
        case 'run':
          fence = acquired.token;
      }
    }

    const parsed = OperationJobDataSchema.safeParse(job.data);
    if (!parsed.success) {
      return this.fail(laneId, jobId, fence, 'unknown', startedAt, 'invalid_job_data', `invalid job data: ${z.prettifyError(parsed.error)}`);
    }
    const data = parsed.data;
    const attempt = job.attemptsMade + 1;
    // A child logger costs more than a no-op operation; make it only when something logs.
    let child: Logger | undefined;
    const bindings = { leaseId: data.lease.leaseId, provider: data.lease.provider, jobId, op: data.op, attempt };
    const logger = () => (child ??= this.log.child(bindings));
    const provider = this.providers.get(data.lease.provider);
    if (!provider) {
      // Another replica may serve it (a rolling change of LEASE_OPS_PROVIDERS): retried
      // like a transient error, so it fails only at its deadline.
      const unknown = new TransientError('unknown_provider', `no provider named "${data.lease.provider}" is configured on this worker`);
      const decision = decideRetry(unknown, job.attemptsMade, data.deadlineAt, Date.now(), this.backoff);
      if (decision.retry) {
        await this.ops.lanes.yield(laneId, jobId, fence);
        throw new RetryLaterError(decision.delayMs, unknown);
      }
      if (data.op === 'acquire') await this.abandon(data, jobId, logger);
      return this.fail(laneId, jobId, fence, data.op, startedAt, 'unknown_provider', unknown.message);
    }
    if (data.op === 'abandon-acquire' && (await this.ops.outcomeOf(data.params.acquireJobId))?.status === 'completed') {
      // The acquire completed after all (a crash came between queueing this and recording
      // its failure, and a re-run succeeded): its sandbox is a lease now, not debris.
      return this.complete(laneId, jobId, fence, data.op, startedAt, { providerLeaseId: null, state: 'none' });
    }
    // A clean-up's own deadline bounds it; a stall limit would leave the sandbox behind.
    if (job.stalledCounter > this.settings.LEASE_OPS_MAX_STALLED && data.op !== 'abandon-acquire') {
      // Its attempts keep dying with their workers (a poison operation, or a crash loop).
      if (data.op === 'acquire') await this.abandon(data, jobId, logger);
      return this.fail(laneId, jobId, fence, data.op, startedAt, 'stalled_too_often', `its attempts stalled ${job.stalledCounter} times (LEASE_OPS_MAX_STALLED=${this.settings.LEASE_OPS_MAX_STALLED}): each one's worker died or froze past its lock`);
    }
    let result: unknown;
    let observed: [string, SandboxState] | null = null;
    const held = new Attempt(jobId, laneId, fence, token ?? '');
    const untrack = this.fencing.track(held);
    const fencing = this.fencing;
    const ctx: OperationContext = {
      lease: data.lease,
      jobId,
      attempt,
      attemptId: `${jobId}:${fence}`,
      get signal() {
        return held.signal;
      },
      deadlineAt: data.deadlineAt,
      fence: () => fencing.check(held),
      fenceIsFresh: () => held.fresh(),
      observe: (providerLeaseId: string, state: SandboxState) => {
        observed = [providerLeaseId, state];
      },
      get log() {
        return logger();
      },
      checkpoint: this.checkpointOf(jobId),
    };
    if (Date.now() >= data.deadlineAt) {
      // A retry can come due just past the deadline; name the error that caused it.
      const last = job.attemptsMade > 0 && job.failedReason ? `last provider error: ${job.failedReason}` : 'deadline passed before the operation could start';
      untrack();
      if (data.op === 'acquire') await this.abandon(data, jobId, logger);
      return this.fail(laneId, jobId, fence, data.op, startedAt, 'deadline_exceeded', last);
    }

    try {
      const spanAttributes = { 'lease.op': data.op, 'lease.provider': data.lease.provider, 'lease.job_id': jobId, 'lease.attempt': attempt };
      result =
        data.op === 'force-stop'
          ? await telemetry.forceStopSpan(spanAttributes, () => runOperation(provider, ctx, data))
          : await runOperation(provider, ctx, data);
      if (data.op === 'force-stop') telemetry.forceStop('succeeded', { 'lease.provider': data.lease.provider });
    } catch (err) {
      if (err instanceof StaleAttemptError || held.stale) {
        untrack();
        // Not this attempt's lane any more: touch nothing, let the current attempt finish.
        logger().warn({ err }, 'stale attempt refused a provider call');
        attemptEnded(data.op, 'stale', (performance.now() - startedAt) / 1000);
        throw held.staleError();
      }
      const decision = decideRetry(err, job.attemptsMade, data.deadlineAt, Date.now(), {
        ...this.backoff,
        ...(data.op === 'abandon-acquire' ? {} : this.settings.LEASE_OPS_BACKOFF_BY_OP[data.op]),
      });
      untrack();
      // An acquire that fails for good leaves no sandbox behind.
      if (!decision.retry && data.op === 'acquire') await this.abandon(data, jobId, logger);
      await this.record(laneId, data.lease, observed, logger);
      if (data.op === 'force-stop' && isProviderError(err) && err.code === 'state_change_in_progress') {
        telemetry.forceStop('refused', { 'lease.provider': data.lease.provider });
      }
      if (decision.retry && isProviderError(err) && err.kind === 'settling') {
        const seen = observed as [string, SandboxState] | null;
        telemetry.waitTransition({
          'lease.op': data.op,
          'lease.provider': data.lease.provider,
          'lease.state': seen ? seen[1].kind : 'unknown',
          'lease.provider_state': seen && 'providerState' in seen[1] ? seen[1].providerState : (seen?.[1].kind ?? 'unknown'),
          'lease.retry_delay_ms': decision.delayMs,
        });
      }
      if (decision.retry) {
        logger().info({ err, delayMs: decision.delayMs }, 'operation will be retried');
        await this.ops.lanes.yield(laneId, jobId, fence);
        attemptEnded(data.op, 'retry', (performance.now() - startedAt) / 1000, isProviderError(err) ? err.kind : 'unexpected');
        throw new RetryLaterError(decision.delayMs, err);
      }
      const message = err instanceof Error ? err.message : String(err);
      logger().warn({ err, reason: decision.reason }, 'operation failed');
      if (decision.reason === 'deadline') {
        return this.fail(laneId, jobId, fence, data.op, startedAt, 'deadline_exceeded', `last provider error: ${message}`);
      }
      return this.fail(laneId, jobId, fence, data.op, startedAt, errorCode(err), message);
    }

    this.coalesceWrites();
    untrack();
    attemptEnded(data.op, 'completed', (performance.now() - startedAt) / 1000);
    if (observed) await this.record(laneId, data.lease, observed, logger);
    // Not awaited: the release is queued on the worker's connection ahead of BullMQ's own
    // completion, so the next job of the lane starts one round trip sooner. A stale
    // release (this attempt was superseded) changes nothing, and BullMQ refuses to
    // complete the job too, as the superseding start took its lock.
    this.releaseLanes.release(laneId, jobId, fence, { status: 'completed', result }, true).then(
      (released) => {
        if (released.kind === 'stale') logger().warn('attempt was superseded while it ran; its result is discarded');
      },
      (err: unknown) => logger().error({ err }, 'lane release failed; the lane sweep will repair the lane'),
    );
    if (data.op === 'acquire') void this.ops.acquireEnded(jobId).catch((err: unknown) => logger().warn({ err }, 'could not forget a completed acquire; the sweep will'));
    return result;
  }

  /**
   * An acquire failed for good: its clean-up (find what its attempts made, destroy it) is
   * queued as an operation of its own in the acquire's lane, where it is retried through a
   * cloud outage or a sandbox still creating, within its own deadline. If even queueing it
   * fails (Redis away), the acquire is retried instead of failed, so that its next attempt
   * queues it again: a failure is never recorded without its clean-up.
   */
  private async abandon(data: OperationJobData & { op: 'acquire' }, jobId: string, logger: () => Logger): Promise<void> {
    try {
      const checkpoint = await this.checkpointOf(jobId).read();
      const { jobId: cleanUp } = await this.ops.enqueueAbandon(data.lease, jobId, checkpoint);
      logger().warn({ cleanUpJobId: cleanUp }, 'acquire failed for good; the clean-up of what it made is queued');
    } catch (err) {
      logger().error({ err }, 'could not queue the clean-up of a failed acquire; the acquire will be retried');
      throw new RetryLaterError(this.backoff.capMs, err);
    }
  }

  /** Keeps what the attempt last saw of its sandbox (before the lane moves on, so in order). */
  private async record(laneId: string, lease: LeaseIdentity, observed: [string, SandboxState] | null, logger: () => Logger): Promise<void> {
    if (!observed) return;
    try {
      await this.records.observe(laneId, lease, observed[0], observed[1]);
    } catch (err) {
      logger().warn({ err }, 'could not record the observed sandbox state');
    }
  }

  /** A job's checkpoint lives in its BullMQ hash, so it goes when the job goes (and is never written after). */
  private checkpointOf(jobId: string): OperationContext['checkpoint'] {
    const key = this.ops.queue.toKey(jobId);
    return {
      read: async () => JSON.parse((await this.connection.hget(key, 'lo:checkpoint')) ?? '{}') as Record<string, unknown>,
      write: async (values) => {
        await this.writeCheckpoint(key, JSON.stringify(values));
      },
    };
  }

  /**
   * Holds this tick's writes on the worker connection and sends them in one go: the lane
   * release and BullMQ's completion of the same job (issued a few microtasks later) then
   * cost one socket write instead of two.
   */
  private coalesceWrites(): void {
    // A cluster connection has one socket per node; corking is for the single-server case.
    const stream = this.workerConnection instanceof Redis ? this.workerConnection.stream : null;
    if (this.writesHeld || !stream || stream.destroyed) return;
    this.writesHeld = true;
    stream.cork();
    setImmediate(() => {
      this.writesHeld = false;
      stream.uncork();
    });
  }

  /** Records a completion decided without a provider call in the lane (which hands off the next job). */
  private async complete(laneId: string, jobId: string, fence: string, op: string, startedAt: number, result: unknown): Promise<unknown> {
    attemptEnded(op, 'completed', (performance.now() - startedAt) / 1000);
    await this.releaseLanes.release(laneId, jobId, fence, { status: 'completed', result }, true);
    return result;
  }

  /** Records a final failure in the lane (which hands off the next job) and fails this one for good. */
  private async fail(
    laneId: string,
    jobId: string,
    fence: string,
    op: string,
    startedAt: number,
    code: string,
    message: string,
  ): Promise<never> {
    attemptEnded(op, 'failed', (performance.now() - startedAt) / 1000);
    const err = code === 'deadline_exceeded' ? new DeadlineExceededError(message) : new OperationFailedError(code, message);
    if (code === 'deadline_exceeded') telemetry.deadlineFailure({ 'lease.lane': laneId });
    await this.releaseLanes.release(laneId, jobId, fence, { status: 'failed', code, error: err.message }, true);
    throw err;
  }
}

/**
 * The fencing token a lane hand-off left in the job's progress field. Trusted only on the
 * job's first start: any later start (a retry, a re-run after a stall, a start after
 * parking) asks the lane for a fresh token, so no two attempts ever share one.
 */
function handedOffFence(job: Job): string | null {
  if (job.attemptsStarted !== 1 || job.attemptsMade !== 0) return null;
  const progress = job.progress as unknown;
  if (progress && typeof progress === 'object' && 'fence' in progress && typeof progress.fence === 'string') {
    return progress.fence;
  }
  return null;
}

function errorCode(err: unknown): string {
  if (err && typeof err === 'object' && 'code' in err && typeof err.code === 'string') return err.code;
  return 'provider_error';
}
