import { setMaxListeners } from 'node:events';
import { partitionOfLane } from '../partitions.ts';
import { DelayedError, MetricsTime, Queue, UnrecoverableError, Worker, type Job, type WorkerOptions } from 'bullmq';
import { Redis } from 'ioredis';
import type { Config } from '../config.ts';
import { faultPoint } from '../fault-points.ts';
import type { Logger } from '../logger.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import type { OperationContext, ProviderCapabilities } from '../providers/types.ts';
import { AttemptLife, type AttemptDeps } from './attempt-life.ts';
import { Fencing, StaleAttemptError } from './fencing.ts';
import type { Lanes } from './lane.ts';
import type { LaneNames } from './lane-names.ts';
import { LeaseHistory } from './lease-history.ts';
import { LeaseRecords } from './lease-records.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import { defineQuietFetch, UNRELEASED_ACQUIRE } from './quiet-fetch.ts';
import { BACKOFF_TYPE, OperationsQueue } from './operations-queue.ts';
import { answerWithin, closeForGood, createRedis, keepCopies, isRedisUnavailable, pingWithin, reportRedisError, type RedisClient } from './redis.ts';
import { type BackoffSettings, DEFAULT_BACKOFF, RetryLaterError } from './retry-policy.ts';
import { PROBE_DEADLINE_MS, PROBE_JOB, ProbeTargetSchema, runProbe } from './provider-probes.ts';
import { execQueueName, runExec } from './exec-jobs.ts';
import { passOnUnserved } from './pass-on.ts';
import { sweepLanes } from './sweep.ts';
import { Watchdog } from './watchdog.ts';

const SWEEP_SCHEDULER_ID = 'lane-sweep';
/** How long a closing worker waits for Redis to answer before it closes without waiting for its jobs. */
const CLOSE_PING_MS = 2_000;
/** BullMQ's error after a lockRenewalFailed event, one per job (test/bullmq-contract.test.ts pins it). */
export const LOCK_RENEWAL_FAILED = /^could not renew lock for job /;
/**
 * BullMQ's errors when a job's end comes from an attempt whose lock passed on (a superseded
 * attempt, frozen past its lock, say): the lock gone, or another attempt's now. The lane
 * refused its release already, and this is no fault of the worker's (test/bullmq-contract.test.ts
 * pins both).
 */
export const SUPERSEDED_END = /^(Missing lock for job \S+\. |Lock mismatch for job \S+\. Cmd )moveTo(Finished|Failed|Delayed)\b/;
/**
 * BullMQ's error when a job's end comes after the job was removed (its lock lapsed, then an
 * operator removed it): nothing is left to end, the lane sweep drops it from its lane, and
 * the clean-up of an acquire that vanished is queued (test/bullmq-contract.test.ts pins it).
 */
export const REMOVED_END = /^Missing key for job \S+\. moveTo(Finished|Failed|Delayed)\b/;
/** How long a closing worker waits for BullMQ's close once no job runs and Redis answers. */
const CLOSE_STUCK_MS = 5_000;
/** How a closing worker's wait for BullMQ's close ended (see waitForClose). */
type CloseWait = 'closed' | 'redis-gone' | 'stuck';
/** BullMQ's stall limit, set out of reach: lease-ops applies LEASE_OPS_MAX_STALLED itself. */
const BULLMQ_STALLS_UNLIMITED = 1_000_000_000;
const WATCHDOG_SCHEDULER_ID = 'stuck-stop-watchdog';
/** A delayed check of one stopping episode, at the moment it would be stuck. */
const STUCK_CHECK = 'stuck-check';

export type WorkerSettings = Pick<
  Config,
  | 'REDIS_URL'
  | 'LEASE_OPS_PREFIX'
  | 'LEASE_OPS_QUEUE'
  | 'LEASE_OPS_CONCURRENCY'
  | 'LEASE_OPS_MAX_PAUSED_PER_COMPANY'
  | 'LEASE_OPS_EXEC_CONCURRENCY'
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
  | 'LEASE_OPS_INFLIGHT_GRACE_MS'
  | 'LEASE_OPS_SETTLE_WAIT_MS'
  | 'LEASE_OPS_SETTLE_WAITS'
  | 'LEASE_OPS_BULLMQ_METRICS'
  | 'LEASE_OPS_MAX_QUEUED_PER_LEASE'
  | 'LEASE_OPS_MAX_QUEUED'
  | 'LEASE_OPS_MAX_QUEUED_PER_COMPANY'
  | 'LEASE_OPS_MAX_BYTES_PER_COMPANY'
  | 'LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT'
  | 'LEASE_OPS_QUEUE_LIMITS'
  | 'LEASE_OPS_PARTITIONS'
>;

/** BullMQ's backoff for lease-ops jobs: the processor already chose the delay (retry-policy.ts); -1 means do not retry. */
export function backoffStrategy(_attempts: number, type?: string, err?: Error): number {
  return type === BACKOFF_TYPE && err instanceof RetryLaterError ? err.delayMs : -1;
}

/**
 * BullMQ's Worker, with one step added to a job's completion: a completion moveToFinished
 * refused (UNRELEASED_ACQUIRE in quiet-fetch.ts: an acquire whose release has not recorded its
 * outcome) runs what the attempt left for that case (refusedEnds), which waits for the
 * release's answer: refused for a cancel, it fails the acquire as cancelled (its clean-up
 * queued first) and that failure is the job's; released after all (it ran late), the job is
 * completed again. The attempt registers that step only where the completion is so rewritten,
 * and sends the release and the completion in one write.
 */
export class LaneJobsWorker extends Worker {
  readonly refusedEnds = new WeakMap<Job, () => Promise<void>>();
  /** Errors that end a refused completion: the attempt said them, so the 'error' event does not again. */
  readonly saidErrors = new WeakSet<Error>();

  constructor(
    name: string,
    processor: (job: Job, token: string | undefined) => Promise<unknown>,
    opts: WorkerOptions,
    private readonly retryDelayMs: number,
    private readonly warn: (jobId: string | undefined, message: string) => void,
    /** Whether a release recorded the job's completion in this run of it (Lanes.releasedCompleted). */
    private readonly releasedCompleted: (job: Job) => Promise<boolean>,
  ) {
    super(name, processor, opts);
  }

  /** The job runs again (its next attempt repeats the outcome its release recorded, or finds the cancel); said once, as a warning. */
  private runAgain(job: Job, why: string): RetryLaterError {
    this.warn(job.id, `${why}; it runs again`);
    const again = new RetryLaterError(this.retryDelayMs, new Error(`${job.id}: ${why}`));
    this.saidErrors.add(again);
    return again;
  }

  protected override async handleCompleted(result: unknown, job: Job, token: string, fetchNextCallback?: () => boolean, span?: Parameters<Worker['handleCompleted']>[4]): Promise<Job> {
    try {
      return await super.handleCompleted(result, job, token, fetchNextCallback, span);
    } catch (err) {
      if ((err as { code?: unknown }).code !== UNRELEASED_ACQUIRE) throw err;
      const end = this.refusedEnds.get(job);
      // None registered (its step already ran and was cut short): completed if its release
      // recorded that meanwhile, else the job runs again.
      const ended = end ? await end().then(() => null, (e: unknown) => e) : (await this.releasedCompleted(job).catch(() => false)) ? null : this.runAgain(job, 'its completion was refused before its release had recorded it');
      if (ended === null) {
        // Its release answered that it ended the job: the outcome is there, so this completion goes.
        return await super.handleCompleted(result, job, token, fetchNextCallback, span).catch((again: unknown) => {
          throw (again as { code?: unknown }).code === UNRELEASED_ACQUIRE ? this.runAgain(job, 'its completion was refused again after its release') : again;
        });
      }
      if (ended instanceof Error) this.saidErrors.add(ended);
      throw ended;
    } finally {
      this.refusedEnds.delete(job);
    }
  }
}

/** Finished maintenance passes kept, each with its report (a sweep every 5 s: the last ~15 minutes). */
const MAINTENANCE_KEPT = 200;

/**
 * A worker replica: runs lease operations from the shared queue, one at a time per lease,
 * and takes part in the lane sweep. Start as many as you like.
 */
export class LeaseWorker {
  readonly ops: OperationsQueue;
  private readonly worker: LaneJobsWorker;
  private readonly maintenanceQueue: Queue;
  private readonly maintenanceWorker: Worker;
  /** Runs commands in sandboxes (exec), beside the lanes: an activity orders them against stops. */
  private readonly execWorker: Worker;
  private readonly connection: RedisClient;
  private readonly releaseLanes: Lanes;
  private readonly fencing: Fencing;
  readonly records: LeaseRecords;
  readonly history: LeaseHistory;
  private readonly workerConnection: RedisClient;
  private writesHeld = false;
  /** Connections handed to BullMQ (which leaves closing them to their owner), and its copies of them. */
  private readonly ownedConnections: RedisClient[] = [];
  private closing: Promise<void> | null = null;
  /** Aborted as close() begins: attempts waiting for a pushed state change stop waiting (each listens while it waits). */
  private readonly closeBegan = (() => {
    const controller = new AbortController();
    setMaxListeners(0, controller.signal);
    return controller;
  })();
  /** Attempts between BullMQ handing over their job and their end (see waitForClose). */
  private attemptsInFlight = 0;
  private readonly backoff: BackoffSettings;
  private readonly writeCheckpoint: LuaCommand;
  private readonly attemptDeps: AttemptDeps;
  private readonly watchdog: Watchdog;
  private scheduleCheck: NodeJS.Timeout | null = null;
  private schedulesMissing = false;

  constructor(
    private readonly settings: WorkerSettings,
    private readonly providers: ProviderRegistry,
    private readonly log: Logger,
    /**
     * Which partition of how many this worker serves (settings' prefix is that partition's),
     * and the queue of each partition, for what it queues in other lanes (the watchdog).
     */
    private readonly partition: { index: number; count: number; queueOf?: (laneId: string) => OperationsQueue; names?: LaneNames } = { index: 0, count: 1 },
  ) {
    this.backoff = { ...DEFAULT_BACKOFF, baseMs: settings.LEASE_OPS_BACKOFF_BASE_MS, capMs: settings.LEASE_OPS_BACKOFF_CAP_MS };
    // Named, so CLIENT LIST says which of a worker's connections is which (the tests cut one).
    this.connection = createRedis(settings.REDIS_URL, { connectionName: 'lease-ops-worker' });
    const connect = (connectionName: string) => {
      return keepCopies(createRedis(settings.REDIS_URL, { connectionName }), this.ownedConnections);
    };
    this.ops = new OperationsQueue(this.connection, settings, partition.names);
    this.records = new LeaseRecords(this.connection, settings.LEASE_OPS_PREFIX);
    this.history = new LeaseHistory(this.connection, settings.LEASE_OPS_PREFIX, log);
    this.writeCheckpoint = luaCommand(this.connection, 'job-checkpoint', 1);
    const prefix = settings.LEASE_OPS_PREFIX;
    const workerConnection = connect('lease-ops-worker-jobs');
    this.workerConnection = workerConnection;
    // Releases go over the BullMQ worker's own connection: Redis runs one connection's
    // commands in order, so the release (which hands off the next job) always lands just
    // before BullMQ's completion of the same job, whose fetch-next then finds that job.
    this.releaseLanes = this.ops.lanesOn(workerConnection);
    // Before the Worker is made: it then fetches with these (see quiet-fetch.ts).
    const completionGuarded = defineQuietFetch(workerConnection);
    if (!completionGuarded) log.warn('BullMQ\'s fetch scripts are not the ones lease-ops patches; running them as shipped (an idle worker wakes once per operation for nothing, a backoff retry can start up to 1 s late, and an acquire\'s end waits for its release before BullMQ\'s completion)');
    // Two parameters on purpose: BullMQ gives a processor that takes a third one an
    // AbortController per job, which costs more than a no-op operation; the attempt makes
    // its own signal only when a provider asks for it.
    this.worker = new LaneJobsWorker(settings.LEASE_OPS_QUEUE, (job, token) => this.process(job, token), {
      connection: workerConnection,
      prefix,
      concurrency: settings.LEASE_OPS_CONCURRENCY,
      lockDuration: settings.LEASE_OPS_LOCK_MS,
      stalledInterval: settings.LEASE_OPS_STALLED_INTERVAL_MS,
      // lease-ops counts stalls itself (see process): BullMQ's own limit would fail a job
      // without running it, even one whose outcome the lane already recorded.
      maxStalledCount: BULLMQ_STALLS_UNLIMITED,
      // An idle worker's blocking fetch gives up after 1 s (BullMQ's default is 5 s). Backoff
      // retries used to wait out the whole block timeout when no worker knew their due time;
      // quiet-fetch.ts keeps the due times, and this bound stays for any wake-up still missed.
      drainDelay: 1,
      autorun: false,
      // BullMQ's per-minute completed/failed counts, exported with the API's /metrics.
      ...(settings.LEASE_OPS_BULLMQ_METRICS ? { metrics: { maxDataPoints: MetricsTime.ONE_WEEK } } : {}),
      settings: { backoffStrategy },
    }, this.backoff.baseMs, (jobId, message) => log.warn({ jobId }, message), (job) => this.releaseLanes.releasedCompleted(job.id ?? '', job.attemptsMade));
    this.worker.on('error', (err) => {
      if (this.worker.saidErrors.has(err)) return;
      if (isRedisUnavailable(err)) reportRedisError(err);
      // Said already, by job, through lockRenewalFailed (below): no second line, no stack.
      else if (LOCK_RENEWAL_FAILED.test(err.message)) return;
      else if (SUPERSEDED_END.test(err.message)) this.log.warn({ reason: err.message }, 'BullMQ refused the end of a superseded attempt (its lock had passed on); its lane had refused it already');
      else if (REMOVED_END.test(err.message)) this.log.warn({ reason: err.message }, 'BullMQ refused the end of an attempt whose job was removed meanwhile (its lock had lapsed); the lane sweep drops it');
      else this.log.error({ err }, 'worker error');
    });
    // Fences are checked on the ops connection; the watcher runs a few times per lock period.
    this.fencing = new Fencing(
      this.connection,
      (laneId) => this.ops.lanes.execKey(laneId),
      (jobId) => this.ops.lanes.lockKey(jobId),
      log,
      Math.max(250, Math.floor(settings.LEASE_OPS_LOCK_MS / 4)),
    );
    this.worker.on('lockRenewalFailed', (jobIds) => this.fencing.lockLost(jobIds));
    this.attemptDeps = {
      ops: this.ops,
      releaseLanes: this.releaseLanes,
      fencing: this.fencing,
      records: this.records,
      releaseRecords: new LeaseRecords(workerConnection, prefix),
      history: this.history,
      providers,
      backoff: this.backoff,
      backoffByOp: settings.LEASE_OPS_BACKOFF_BY_OP,
      maxStalled: settings.LEASE_OPS_MAX_STALLED,
      inFlightGraceMs: settings.LEASE_OPS_INFLIGHT_GRACE_MS,
      settleWaitMs: settings.LEASE_OPS_SETTLE_WAIT_MS,
      settleWaits: { active: 0, max: settings.LEASE_OPS_SETTLE_WAITS ?? Math.max(1, Math.floor(settings.LEASE_OPS_CONCURRENCY / 2)) },
      closing: this.closeBegan.signal,
      log,
      redis: this.connection,
      checkpointOf: (jobId: string) => this.checkpointOf(jobId),
      coalesceWrites: () => this.coalesceWrites(),
      refusedEnd: completionGuarded
        ? (job: Job, end: () => Promise<void>) =>
            this.worker.refusedEnds.set(job, async () => {
              // Still this attempt's work: a closing worker waits for it as for any attempt.
              this.attemptsInFlight++;
              try {
                return await end();
              } finally {
                this.attemptsInFlight--;
              }
            })
        : null,
      // A worker that closes or is paused fetches nothing after its completion: the next
      // job of the lane must then wake another worker (see handOff's lazy marker).
      fetchesNext: () => !this.closing && !this.worker.closing && !this.worker.isPaused(),
      ownsLane: (laneId: string) => this.ownsLane(laneId),
      stoppingBegan: (laneId: string, since: number, now: number) => this.stuckCheck(laneId, since, now),
    };

    // Maintenance runs on its own small queue so a deep backlog of operations never
    // delays the sweep that keeps lanes moving. The sweep, the watchdog's scan and each
    // episode's stuck check run side by side (none waits behind another), and none of them
    // calls a provider: they read Redis and queue operations.
    const maintenanceName = `${settings.LEASE_OPS_QUEUE}-maintenance`;
    this.maintenanceQueue = new Queue(maintenanceName, { connection: this.connection, prefix });
    this.maintenanceQueue.on('error', reportRedisError);
    const queueOf = partition.queueOf;
    this.watchdog = new Watchdog(this.ops, this.records, providers, {
      stuckAfterMs: settings.LEASE_OPS_STUCK_STOPPING_MS,
      maxForceStops: settings.LEASE_OPS_WATCHDOG_MAX_FORCE,
    }, log, (laneId) => (queueOf && !this.ownsLane(laneId) ? queueOf(laneId) : this.ops), this.ops.names);
    this.maintenanceWorker = new Worker(
      maintenanceName,
      async (job, token) => {
        switch (job.name) {
          case WATCHDOG_SCHEDULER_ID:
            return this.watchdog.scan();
          case STUCK_CHECK:
            return this.watchdog.consider((job.data as { laneId: string }).laneId);
          case PROBE_JOB:
            {
            const target = ProbeTargetSchema.safeParse(job.data);
            if (!target.success) throw new UnrecoverableError('a probe job that names no provider');
            return runProbe(this.providers, target.data, this.log, async () => {
              // Not served here: back for another replica, for a while (see pass-on.ts).
              if (await passOnUnserved(job, token, job.timestamp + PROBE_DEADLINE_MS, () => this.announcedAnywhere(target.data.provider))) throw new DelayedError();
            });
          }
          case SWEEP_SCHEDULER_ID: {
            const report = await sweepLanes(this.ops, settings.LEASE_OPS_SWEEP_STALE_MS, this.log);
            if (report.dropped || report.handedOff) this.log.info(report, 'lane sweep repaired lanes');
            const instances = this.providers.instances;
            const abandoned = await this.ops.reconcileAcquires(undefined, undefined, async (lease) => instances !== null && (await instances.store.holds(lease)));
            if (abandoned) this.log.warn({ abandoned }, 'acquires whose jobs vanished before they ended: their clean-up is queued');
            const deadlineEntriesForgotten = await this.ops.lanes.tidyDeadlines(this.ops.bytes.heldKey);
            return { ...report, abandoned, deadlineEntriesForgotten };
          }
          default:
            throw new UnrecoverableError(`unknown maintenance job ${job.name}`);
        }
      },
      // The deployment's lock and stall check, not BullMQ's 30 s defaults: BullMQ adds a
      // schedule's next iteration after the fetch of the current one, so a replica that dies
      // in between holds every sweep (and watchdog scan) back until its lock lapses and a
      // stall check moves the iteration on.
      {
        connection: connect('lease-ops-worker-maintenance'),
        prefix,
        concurrency: 4,
        autorun: false,
        lockDuration: settings.LEASE_OPS_LOCK_MS,
        stalledInterval: settings.LEASE_OPS_STALLED_INTERVAL_MS,
      },
    );
    this.maintenanceWorker.on('error', (err) => {
      if (isRedisUnavailable(err)) reportRedisError(err);
      // A sweep or watchdog scan whose process stalled past its lock (frozen, or its event loop
      // held): its schedule's next run was added when it was fetched, and goes on. A warning
      // without a stack, not an error (helper-25: a worker frozen while it held a sweep said so
      // as an error, with a stack, when it woke).
      else if (LOCK_RENEWAL_FAILED.test(err.message) || SUPERSEDED_END.test(err.message)) this.log.warn({ reason: err.message }, 'a maintenance job (a lane sweep or watchdog scan) lost its lock while this process stalled; its schedule goes on');
      else this.log.error({ err }, 'maintenance worker error');
    });
    // A command is never run twice: a worker that dies mid-command leaves its job failed
    // (stalled), since the command may have run; the caller is told so.
    this.execWorker = new Worker(
      execQueueName(settings.LEASE_OPS_QUEUE),
      (job, token) => runExec(job, token, { announced: (provider) => this.announcedAnywhere(provider), providers: this.providers, activities: this.ops.activities, keys: this.providers.instances?.store.keys ?? null, log: this.log, redis: this.connection, prefix }),
      {
        connection: connect('lease-ops-worker-exec'),
        prefix,
        concurrency: settings.LEASE_OPS_EXEC_CONCURRENCY,
        autorun: false,
        maxStalledCount: 0,
        lockDuration: settings.LEASE_OPS_LOCK_MS,
        stalledInterval: settings.LEASE_OPS_STALLED_INTERVAL_MS,
      },
    );
    this.execWorker.on('error', (err) => (isRedisUnavailable(err) ? reportRedisError(err) : this.log.error({ err }, 'exec worker error')));
  }

  /** Starts processing; resolves once the workers are connected and the maintenance is scheduled. */
  async start(): Promise<void> {
    await this.schedule();
    await this.ops.announceProviders(this.announced());
    await this.ops.announceStuckBudget(this.settings.LEASE_OPS_STUCK_STOPPING_MS);
    // Closed meanwhile: nothing more starts (a timer set now would outlive the close).
    if (this.closing) return;
    this.fencing.start();
    // Redis can lose its data (a restart without persistence, a failover to a replica that
    // lagged): the schedules are then gone while the workers keep running. Look every sweep
    // interval, re-create them, and say so; until then this replica is not ready.
    this.scheduleCheck = setInterval(() => void this.checkSchedules(), this.settings.LEASE_OPS_SWEEP_INTERVAL_MS);
    this.scheduleCheck.unref();
    void this.worker.run();
    void this.maintenanceWorker.run();
    void this.execWorker.run();
    await Promise.all([this.worker.waitUntilReady(), this.maintenanceWorker.waitUntilReady(), this.execWorker.waitUntilReady()]);
  }

  /** One schedule per maintenance task however many replicas upsert it: BullMQ keys it by id. */
  private async schedule(): Promise<void> {
    await this.maintenanceQueue.upsertJobScheduler(
      SWEEP_SCHEDULER_ID,
      { every: this.settings.LEASE_OPS_SWEEP_INTERVAL_MS },
      // The last passes stay (Bull Board shows what each did: lanes repaired, acquires cleaned up).
      { name: SWEEP_SCHEDULER_ID, opts: { removeOnComplete: { count: MAINTENANCE_KEPT }, removeOnFail: 100 } },
    );
    if (this.settings.LEASE_OPS_WATCHDOG) {
      await this.maintenanceQueue.upsertJobScheduler(
        WATCHDOG_SCHEDULER_ID,
        { every: this.settings.LEASE_OPS_WATCHDOG_INTERVAL_MS },
        { name: WATCHDOG_SCHEDULER_ID, opts: { removeOnComplete: { count: MAINTENANCE_KEPT }, removeOnFail: 100 } },
      );
    }
    this.schedulesMissing = false;
  }

  private async checkSchedules(): Promise<void> {
    // Said again each time, so the API knows it after Redis lost its data too.
    this.ops.announceProviders(this.announced()).catch((err: unknown) => this.log.warn({ err }, 'could not say which providers this replica serves'));
    this.ops.announceStuckBudget(this.settings.LEASE_OPS_STUCK_STOPPING_MS).catch((err: unknown) => this.log.warn({ err }, 'could not say its stuck-stopping budget'));
    try {
      const ids = [SWEEP_SCHEDULER_ID, ...(this.settings.LEASE_OPS_WATCHDOG ? [WATCHDOG_SCHEDULER_ID] : [])];
      const present = await Promise.all(ids.map((id) => this.maintenanceQueue.getJobScheduler(id)));
      if (present.every(Boolean)) return;
      this.schedulesMissing = true;
      this.log.error({ missing: ids.filter((_, i) => !present[i]) }, 'the maintenance schedules are gone from Redis (did it lose its data?); re-creating them');
      await this.schedule();
    } catch (err) {
      this.log.warn({ err }, 'could not check the maintenance schedules');
    }
  }

  /**
   * An operation saw a sandbox begin a stopping episode: check it again the moment it would
   * be stuck (the watchdog's scan is the safety net). One check per episode: the job id names it.
   * Kept once done like the scans (the last MAINTENANCE_KEPT), so the board shows what it did.
   */
  private stuckCheck(laneId: string, since: number, redisNow: number): void {
    if (!this.settings.LEASE_OPS_WATCHDOG) return;
    // Both times are Redis': the delay is right whatever this process' clock says.
    const delay = Math.max(0, since + this.settings.LEASE_OPS_STUCK_STOPPING_MS - redisNow) + 5;
    void this.maintenanceQueue
      .add(STUCK_CHECK, { laneId }, { jobId: `${STUCK_CHECK}.${laneId}.${since}`, delay, removeOnComplete: { count: MAINTENANCE_KEPT }, removeOnFail: 100 })
      .catch((err: unknown) => this.log.warn({ err, laneId }, 'could not schedule the stuck check of a stopping sandbox; the watchdog scan will see it'));
  }

  /** The providers this replica serves and what each can do, as the API lists them. */
  private announced(): { name: string; capabilities: ProviderCapabilities }[] {
    return this.providers.names().map((name) => ({ name, capabilities: this.providers.get(name)!.capabilities }));
  }

  /** Whether a lane belongs to the partition this worker serves, as the deployment's partition count maps it. */
  private ownsLane(laneId: string): boolean {
    return partitionOfLane(laneId, this.partition.count) === this.partition.index;
  }

  /** Running, not closing, its maintenance scheduled, and Redis answers within a second. */
  async ready(): Promise<boolean> {
    if (this.closing || !this.worker.isRunning() || this.schedulesMissing) return false;
    return this.redisAnswersWithin(1_000);
  }

  /**
   * Graceful stop: take no new jobs, let running ones finish, then disconnect. With Redis out
   * of reach it does not wait: BullMQ's graceful close waits for its blocking connection to
   * end, which one that is reconnecting never does, and a running job could not end without
   * Redis anyway (its lock lapses and it runs again elsewhere, as after a crash).
   */
  close(): Promise<void> {
    this.closing ??= (async () => {
      this.closeBegan.abort();
      if (this.scheduleCheck) clearInterval(this.scheduleCheck);
      const reachable = await this.redisAnswersWithin(CLOSE_PING_MS);
      if (!reachable) this.log.warn('Redis does not answer: closing without waiting for running jobs (their locks lapse and they run again elsewhere)');
      else if (this.attemptsInFlight > 0) this.log.info({ running: this.attemptsInFlight }, 'closing: waiting for the running operations to end');
      const workersClosed = Promise.all([this.worker.close(!reachable), this.maintenanceWorker.close(!reachable), this.execWorker.close(!reachable)]);
      let waited: CloseWait = 'redis-gone';
      if (reachable) waited = await this.waitForClose(workersClosed);
      else await workersClosed;
      if (waited === 'closed') {
        await faultPoint('close-wake-up');
        await this.wakeIdleWorkers();
      } else {
        // In a process that lives on (lease-ops used as a library), they would run on beside
        // their successors once their locks lapse: their signals abort, their fences refuse.
        const abandoned = this.fencing.abandonAll();
        if (abandoned) this.log.warn({ abandoned }, 'closed without waiting for provider calls in flight: they are told to stop, and their ends are not written');
      }
      this.fencing.stop();
      // Before anything more is awaited: after a close that did not wait, a completion sent
      // before it and answered only now would hand this worker its lane's next job (BullMQ
      // runs what it fetched while it closes); over closed connections nothing comes.
      for (const c of [this.connection, ...this.ownedConnections]) closeForGood(c);
      await Promise.all([this.maintenanceQueue.close(), this.ops.close()]);
      await this.providers.close();
    })();
    return this.closing;
  }

  /**
   * Waits for BullMQ's graceful close, asking Redis once a second meanwhile on the two
   * connections the running jobs need. It stops waiting when they have not both answered for
   * one lock period (a Redis away that long has let every lock lapse: the jobs run again
   * elsewhere whatever this worker does; a shorter outage is waited out, so the jobs' ends are
   * written when Redis is back), or when no job has run for CLOSE_STUCK_MS while both answer and
   * BullMQ still has not closed (a connection of BullMQ's own cannot reconnect, and its close
   * would wait for it for ever).
   */
  private async waitForClose(closed: Promise<unknown>): Promise<CloseWait> {
    let settled = false;
    const done = closed.then(
      () => (settled = true),
      () => (settled = true),
    );
    let answeredAt = performance.now();
    let idleSince: number | null = null;
    while (!settled) {
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([done, new Promise((resolve) => (timer = setTimeout(resolve, 1_000)))]);
      clearTimeout(timer);
      if (settled) break;
      // Both connections the running jobs need: the jobs' own (their ends and locks; a ping
      // answered there also means what was queued on it before has been answered) and the lanes'.
      const answered = (await Promise.all([this.redisAnswersWithin(CLOSE_PING_MS), this.redisAnswersWithin(CLOSE_PING_MS, this.workerConnection)])).every(Boolean);
      if (settled) break;
      const now = performance.now();
      if (answered) answeredAt = now;
      else if (now - answeredAt >= this.settings.LEASE_OPS_LOCK_MS) {
        this.log.warn({ silentMs: Math.round(now - answeredAt) }, 'Redis went away while closing (or a connection to it did) and stayed away for a lock period: not waiting any longer (the running jobs cannot end without it; they run again elsewhere once their locks lapse)');
        return 'redis-gone';
      }
      idleSince = answered && this.attemptsInFlight === 0 ? (idleSince ?? now) : null;
      if (idleSince !== null && now - idleSince >= CLOSE_STUCK_MS) {
        this.log.warn('BullMQ\'s close has not finished though no job runs and Redis answers (a connection of its own cannot reconnect?): closing without it');
        return 'stuck';
      }
    }
    await closed;
    return 'closed';
  }

  private redisAnswersWithin(ms: number, client: RedisClient = this.connection): Promise<boolean> {
    return pingWithin(client, ms).then(
      () => true,
      () => false,
    );
  }

  /** See wake-if-waiting.lua: a wake-up this worker's closing fetch may have swallowed is sent again. */
  private async wakeIdleWorkers(): Promise<void> {
    const k = this.ops.queue.keys;
    // Bounded: Redis may go away right now, and the command would wait for it for ever.
    await answerWithin(luaCommand(this.connection, 'wake-if-waiting', 4)(k.wait!, k.meta!, k.active!, k.marker!), CLOSE_PING_MS).catch((err: unknown) => {
      this.log.warn({ err }, 'could not wake idle workers on close; the lane sweep will');
    });
  }

  /** Whether the close stopped waiting for the running jobs (see Fencing.abandonAll): nothing starts after. */
  private get closedWithoutWaiting(): boolean {
    return this.fencing.abandoned;
  }

  private async process(job: Job, token: string | undefined): Promise<unknown> {
    // Handed over after this worker closed without waiting (a reply that still came over a
    // closing connection): it does not start here. Its lock lapses, and it runs elsewhere.
    if (this.closedWithoutWaiting) throw new RetryLaterError(this.backoff.baseMs, new StaleAttemptError(`attempt of ${job.id} not started: its worker closed without waiting`));
    this.attemptsInFlight++;
    try {
      return await new AttemptLife(this.attemptDeps, job, token ?? '').live();
    } finally {
      this.attemptsInFlight--;
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
  /** Whether some worker has announced `provider` (what probes and execs this worker does not serve go on for). */
  private async announcedAnywhere(provider: string): Promise<boolean> {
    return (await this.ops.announcedProviders(provider)).includes(provider);
  }

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
}


