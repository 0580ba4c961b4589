import { randomUUID } from 'node:crypto';
import { setMaxListeners } from 'node:events';
import { Job, type QueueEvents } from 'bullmq';
import { openQueueEvents } from './queues/queue-events.ts';
import { z } from 'zod';
import { loadConfig, type Config } from './config.ts';
import { ActivityNotFoundError, ClientClosedError, ExecError, InvalidRequestError, LeaseClosingError, OperationNotFoundError, QueueFullError, RedisUnavailableError, WaitTimeoutError } from './errors.ts';
import { laneOfToken, MAX_ACTIVITY_TTL_MS, MIN_ACTIVITY_TTL_MS } from './queues/activities.ts';
import { LeaseIdentitySchema, laneIdOf, laneIdOfJobId, type LeaseIdentity } from './lease.ts';
import { partitionOfLane, partitionPrefixes } from './partitions.ts';
import { claimPartitionLayout, heldPartitionCount, LayoutError } from './queues/layout.ts';
import { OperationJobDataSchema, type OperationName, type OperationParams } from './operations.ts';
import { OperatorActions, type AcknowledgeResult, type CancelResult, type PauseResult, type RerunResult } from './queues/operator-actions.ts';
import { Inspector, jobOrNone, type AttentionItem, type AttentionScope, type AttentionReason, type LeaseTimeline, type LeaseView, type OperationView, type QueueOverview, type QueueGauges } from './queues/inspect.ts';
import { LeaseRecords } from './queues/lease-records.ts';
import { LaneNames } from './queues/lane-names.ts';
import { enqueueRouted, OperationsQueue, type AnnouncedProvider, type Enqueued } from './queues/operations-queue.ts';
import { ProviderProbes, type ProbeTarget, type ProviderProbe } from './queues/provider-probes.ts';
import { ExecJobs, ExecRequestSchema, type ExecRequestInput } from './queues/exec-jobs.ts';
import type { ExecResult } from './providers/types.ts';
import { ProviderInstances } from './providers/instances/manager.ts';
import { checkMasterKeys } from './providers/instances/resolver.ts';
import { parseAllowedApiUrls } from './providers/instances/schemas.ts';
import { loadMasterKeys, type MasterKeys } from './providers/instances/sealing.ts';
import { ProviderInstanceStore } from './providers/instances/store.ts';
import { BUILT_IN_PROVIDER_NAMES } from './providers/registry.ts';
import { createRedis, isRedisUnavailable, reportRedisError, type RedisClient } from './queues/redis.ts';
import { maskUrl, withoutInfrastructure } from './secrets.ts';

export {
  ActivityNotFoundError,
  IdempotencyKeyReusedError,
  InvalidRequestError,
  LeaseClosingError,
  LeaseHasSandboxError,
  LeaseOpsError,
  OperationNotFoundError,
  QueueFullError,
  RedisUnavailableError,
  WaitTimeoutError,
} from './errors.ts';

/** How an operation ended: a failure's `error` has the one shape of lease-ops' errors, `{ code, message }`. */
export interface OperationResult {
  jobId: string;
  state: 'completed' | 'failed';
  result?: unknown;
  error?: { code: string; message: string };
}


export interface EnqueueOptions {
  /** The operation fails with deadline_exceeded if it has not succeeded this many ms after acceptance. */
  deadlineMs?: number;
  /** The same key returns the same job for 24 h, however often the request is repeated. */
  idempotencyKey?: string;
  /**
   * Run it with the lease's company's provider instance of that name, never a configured
   * provider of the same name (true), or a configured provider of the name first (false).
   * Default: true when the company holds an instance of the name for the lease's environment.
   */
  companyInstance?: boolean;
}

/** Idempotency keys lease-ops' own requests use; refused from callers. */
const RESERVED_KEY_PREFIX = 'lease-ops:';

/** How BullMQ's Job.waitUntilFinished says its wait timed out (pinned in test/bullmq-contract.test.ts). */
export const WAIT_TIMED_OUT = /timed out before finishing/;

/**
 * The control plane's handle on lease-ops: enqueue operations, read them and the lanes of
 * their leases, and wait for results. Bad input throws InvalidRequestError before anything
 * is written.
 */
export class LeaseOpsClient {
  /** One per partition (LEASE_OPS_PARTITIONS), in order; a lease's lives in partitions[partitionOfLane(its lane)]. */
  readonly partitions: ClientPartition[];
  /** A lease's two names (its acquire's id, its sandbox's), as every partition's queue sees them. */
  readonly names: LaneNames;
  private readonly connection: RedisClient;
  private probes: ProviderProbes | null = null;
  private readonly execJobs = new Map<number, ExecJobs>();
  /** Reads of a job's view begun by waits that woke on its end, by job id (waitForEnd). */
  private readonly readsAfterEnd = new Map<string, Promise<OperationView | null>>();
  /** Aborted by endWaits() and close(): a wait for an operation's end then ends at once. */
  private readonly closing = withoutListenerLimit(new AbortController());
  /** Whether waits for an operation's end were ended (endWaits, close): new ones end at once too. */
  private get waitsEnded(): boolean {
    return this.closing.signal.aborted;
  }
  /** Set by close(): every call after it, and one its closing cut short, fails with ClientClosedError. */
  private closed = false;
  /** Whether close() was called: a caller can then tell the client closing from Redis away. */
  get isClosed(): boolean {
    return this.closed;
  }
  /** Aborted by closeNow(): execs and probes still waiting end with ClientClosedError, an exec's command cancelled. */
  private readonly cutting = withoutListenerLimit(new AbortController());
  /** Execs' activities being ended as closeNow() cuts them: it waits a moment for them before its connections go. */
  private readonly execsEnding = new Set<Promise<unknown>>();

  /** `work`, or ClientClosedError as soon as closeNow() cuts it. */
  private untilCut<T>(work: Promise<T>): Promise<T> {
    if (this.cutting.signal.aborted) return Promise.reject(new ClientClosedError());
    let onCut = () => undefined as void;
    const cut = new Promise<never>((_, reject) => {
      onCut = () => reject(new ClientClosedError());
      this.cutting.signal.addEventListener('abort', onCut, { once: true });
    });
    return Promise.race([work, cut]).finally(() => this.cutting.signal.removeEventListener('abort', onCut));
  }
  private layoutClaimed: Promise<void> | null = null;
  private layoutClaimedAt = 0;

  /** How long a call waits for Redis before RedisUnavailableError (LEASE_OPS_REDIS_TIMEOUT_MS). */
  private readonly timeoutMs: number;
  private lastRedisError: unknown = undefined;

  constructor(
    private readonly settings: Config = loadConfig(),
    /** failFast (the default): calls fail with RedisUnavailableError while Redis does not answer. */
    private readonly opts: {
      failFast?: boolean;
      /** The provider registry's master keys; from LEASE_OPS_SECRETS_KEY (and _PREVIOUS) when left out. */
      masterKeys?: MasterKeys | null;
    } = {},
  ) {
    this.timeoutMs = settings.LEASE_OPS_REDIS_TIMEOUT_MS;
    this.connection = this.newConnection('lease-ops-client');
    this.names = new LaneNames((laneId) => this.partitionOf(laneId).ops.lanes);
    this.partitions = partitionPrefixes(settings.LEASE_OPS_PREFIX, settings.LEASE_OPS_PARTITIONS).map(
      (prefix, index) => new ClientPartition(index, { ...settings, LEASE_OPS_PREFIX: prefix }, this.connection, this.names, () => this.walkConnectionOf()),
    );
  }

  private newConnection(connectionName: string): RedisClient {
    const connection = createRedis(
      this.settings.REDIS_URL,
      // Fail fast: while Redis is unreachable a call errors within the timeout instead of
      // waiting in ioredis' offline queue, where it would run late, after its caller gave up.
      (this.opts.failFast ?? true) ? { connectionName, enableOfflineQueue: false, commandTimeout: this.timeoutMs, maxRetriesPerRequest: 0 } : { connectionName },
    );
    connection.on('error', (err: unknown) => (this.lastRedisError = err));
    return connection;
  }

  /**
   * Walks (attention, timelines, the overview) send thousands of commands: they get a
   * connection of their own, opened at the first, so that a cheap read or an enqueue on the
   * main one never waits in line behind a walk's replies (issue 27, noisy neighbours).
   */
  private walkConnection: RedisClient | null = null;
  private walkConnectionOf(): RedisClient {
    return (this.walkConnection ??= this.newConnection('lease-ops-client-walks'));
  }

  /** Like call, for a walk: its connection up (within the timeout) first. */
  private walk<T>(run: () => Promise<T>): Promise<T> {
    return this.call(async () => {
      await this.readyWithinTimeout(this.walkConnectionOf());
      return run();
    });
  }

  /** The first partition's queue: with one partition (the default), the whole deployment's. */
  get ops(): OperationsQueue {
    return this.partitions[0]!.ops;
  }

  /**
   * The partition that holds a lane (a lease's own, or a job's by its id; partition 0 for an id
   * that names none). A lease named by its sandbox's id runs in its acquire's lane: see laneOf.
   */
  partitionOf(lane: LeaseIdentity | string): ClientPartition {
    const laneId = typeof lane === 'string' ? (laneIdOfJobId(lane) ?? lane) : laneIdOf(lane);
    return this.partitions[partitionOfLane(laneId, this.partitions.length)]!;
  }

  /** The lane a lease's operations run in, by either of its names, and that lane's partition. */
  async laneOf(lease: LeaseIdentity): Promise<{ laneId: string; partition: ClientPartition }> {
    if (this.closed) throw new ClientClosedError();
    const laneId = await this.names.resolve(laneIdOf(lease));
    return { laneId, partition: this.partitionOf(laneId) };
  }

  /** Whether Redis answers on the client's connection now. */
  get redisReady(): boolean {
    return this.connection.status === 'ready';
  }

  /** Resolves once the Redis connection is up (with failFast, calls before that fail). */
  async connected(): Promise<void> {
    if (this.closed) throw new ClientClosedError();
    await whenReady(this.connection);
  }

  /** Resolves once `connection` is up; RedisUnavailableError past LEASE_OPS_REDIS_TIMEOUT_MS. */
  private async readyWithinTimeout(connection: RedisClient): Promise<void> {
    if (connection.status === 'ready') return;
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([
      whenReady(connection),
      new Promise((_, reject) => (timer = setTimeout(() => reject(this.unavailable(this.lastRedisError)), this.timeoutMs))),
    ]).finally(() => clearTimeout(timer));
  }

  /**
   * Whether the lease's company holds an instance of the lease's provider name for its
   * environment: what an operation of `lease` runs with when its caller did not say
   * (EnqueueOptions.companyInstance), and what the API decides by (helper-61: the CLI's and an
   * in-process paperclip host's operations ran with a configured provider of the name, the
   * operator's key). A built-in name is never an instance's: no read.
   */
  async holdsInstance(lease: LeaseIdentity): Promise<boolean> {
    if ((BUILT_IN_PROVIDER_NAMES as readonly string[]).includes(lease.provider)) return false;
    const parsed = LeaseIdentitySchema.safeParse(lease);
    return parsed.success && this.instances.store.holds(parsed.data);
  }

  /** Accepts an operation for a lease and returns its job id at once. */
  async enqueue<Op extends OperationName>(
    op: Op,
    lease: LeaseIdentity,
    params: OperationParams[Op] | Record<string, unknown>,
    opts: EnqueueOptions = {},
  ): Promise<Enqueued> {
    // lease-ops' own requests (the watchdog's force-stops) use keys under `lease-ops:`: a
    // caller's request under one would take the key the watchdog's next force-stop needs.
    if (opts.idempotencyKey?.startsWith(RESERVED_KEY_PREFIX)) {
      throw new InvalidRequestError(`idempotencyKey: keys starting with "${RESERVED_KEY_PREFIX}" are lease-ops' own`, [
        { code: 'custom', path: ['idempotencyKey'], message: `keys starting with "${RESERVED_KEY_PREFIX}" are lease-ops' own`, input: opts.idempotencyKey },
      ]);
    }
    try {
      return await this.call(async () => {
        const partition = this.partitionOf(lease);
        const companyInstance = opts.companyInstance ?? (await this.holdsInstance(lease));
        const request = { op, lease, params, ...opts, companyInstance };
        const pin = this.partitions.length > 1 ? await partition.ops.pinIdempotencyKey(request, this.settings.LEASE_OPS_PREFIX) : null;
        try {
          const { jobId, laneId, deduplicated } = await enqueueRouted((laneId) => this.partitionOf(laneId).ops, this.names, request);
          await pin?.settled(true);
          return { jobId, laneId, ...(deduplicated ? { deduplicated } : {}) };
        } catch (err) {
          // Refused for sure (nothing of it was kept): its pin goes after a moment. Any other
          // error may have come after the operation was accepted: the pin stays.
          if (err instanceof QueueFullError || err instanceof LayoutError) await pin?.settled(false);
          throw err;
        }
      });
    } catch (err) {
      if (err instanceof z.ZodError) throw InvalidRequestError.fromZod(err);
      throw err;
    }
  }

  /**
   * Enqueues and waits up to `waitMs` for the operation to end (BullMQ's events, no polling):
   * the operation as it is then, completed, failed, or still on its way (then read it again
   * with getOperation, by its job id). The wait never loses the operation: it is accepted first.
   */
  async enqueueAndWait<Op extends OperationName>(
    op: Op,
    lease: LeaseIdentity,
    params: OperationParams[Op] | Record<string, unknown>,
    opts: EnqueueOptions & { waitMs: number },
  ): Promise<Enqueued & { operation: OperationView }> {
    const { waitMs, ...enqueueOpts } = opts;
    const enqueued = await this.enqueue(op, lease, params, enqueueOpts);
    const operation = await this.getOperation(enqueued.jobId, { waitMs });
    if (!operation) throw new OperationNotFoundError(enqueued.jobId);
    return { ...enqueued, operation };
  }

  /**
   * An operation's state, result or error; null if there is no such operation (or it was
   * removed after its retention). With `waitMs`, waits up to that long for it to end first.
   */
  async getOperation(jobId: string, opts: { waitMs?: number } = {}): Promise<OperationView | null> {
    const view = await this.call(() => this.partitionOf(jobId).inspector.operation(jobId));
    return view && opts.waitMs ? this.waitForEnd(view, opts.waitMs) : view;
  }

  /**
   * An operation's lease and whether BullMQ finished it, from one read of its job: enough to
   * refuse a wait (the lease's scope, and that there is something to wait for) without
   * reading its whole view. Null when there is no such job; its lease null when its data is
   * not an operation's (read as its view reads it, so the two agree on whose it is).
   */
  async peekOperation(jobId: string): Promise<{ lease: LeaseIdentity | null; finished: boolean } | null> {
    const { ops } = this.partitionOf(jobId);
    // An id that names one of the queue's own keys (`events`, `id`, `failed`) is no job: not
    // found, as the view's read says (helper-23: Redis' WRONGTYPE answered 500).
    const [finishedOn, data] = await this.call(() => ops.connection.hmget(ops.queue.toKey(jobId), 'finishedOn', 'data').catch((err: unknown) => (err instanceof Error && err.message.startsWith('WRONGTYPE') ? [null, null] : Promise.reject(err))));
    if (data === null || data === undefined) return null;
    let parsed: unknown;
    try {
      parsed = JSON.parse(data);
    } catch {
      parsed = null;
    }
    const operation = OperationJobDataSchema.safeParse(parsed);
    return { lease: operation.success ? operation.data.lease : null, finished: finishedOn !== null };
  }

  /**
   * Given a view just read, waits up to `waitMs` for the operation to end (BullMQ's events)
   * and returns it as it is then; null if it was removed meanwhile.
   */
  async waitForEnd(view: OperationView, waitMs: number): Promise<OperationView | null> {
    if (view.state === 'completed' || view.state === 'failed') return view;
    if (this.closed) throw new ClientClosedError(view.jobId);
    // Waits were ended (endWaits: the API closing): answered as a wait whose time ran out.
    if (this.waitsEnded) return view;
    return this.waitForEndOf(view.jobId, waitMs);
  }

  /**
   * Waits up to `waitMs` for operation `jobId` to end, without reading its view first (for a
   * caller that saw it unfinished: a long poll's peek, an enqueue just accepted; one that
   * ended meanwhile is found at once), and returns it as it is then; null if there is no such
   * operation or it was removed meanwhile.
   */
  async waitForEndOf(jobId: string, waitMs: number): Promise<OperationView | null> {
    if (this.closed) throw new ClientClosedError(jobId);
    if (this.waitsEnded) return this.answerEnded(jobId);
    const partition = this.partitionOf(jobId);
    const job = await this.call(() => jobOrNone(partition.ops.queue, jobId));
    if (!job) return null;
    // Ended while it read the job: it opens nothing (helper-34: a stream opened after close() kept the process alive).
    if (this.waitsEnded) return this.answerEnded(jobId);
    const until = Date.now() + waitMs;
    let ended = true;
    try {
      // Opening the event stream counts in the wait: the first wait of a partition opens it,
      // and a Redis that takes no new connection held one 2 s wait 10.6 s (helper-32).
      const events = await settledWithin(partition.queueEvents(), waitMs, this.closing.signal);
      if (events === null) ended = false;
      else await untilFinishedOrRemoved(job, jobId, events, Math.max(1, until - Date.now()), async () => (await partition.ops.connection.exists(partition.ops.queue.toKey(jobId))) === 1);
    } catch (err) {
      // Timed out, or the job failed: either way the view below tells which.
      ended = !(err instanceof Error && WAIT_TIMED_OUT.test(err.message));
    }
    // Woken by endWaits() or close() (ClientPartition.wakeWaits), or ended meanwhile.
    if (this.waitsEnded) return this.answerEnded(jobId);
    if (!ended) return this.call(() => partition.inspector.operation(jobId));
    // Every wait on this job woke on its one end event: they share one read of it, begun
    // after that event (helper-31: 100 polls on one job read its view 100 times at once).
    // Joined only until this turn of the event loop ends, by waits that woke on an end too.
    // Each joiner gets a copy of its own: a caller that changes its view changes no other's (helper-32).
    const shared = this.readsAfterEnd.get(jobId);
    if (shared) return shared.then((read) => read && structuredClone(read));
    const read = this.call(() => partition.inspector.operation(jobId));
    this.readsAfterEnd.set(jobId, read);
    setImmediate(() => this.readsAfterEnd.delete(jobId));
    return read;
  }

  /**
   * A wait that endWaits() ended answers as one whose time ran out: the operation as it is now
   * (the API's long poll a 200 with it, `Prefer: wait` its 202 receipt: the operation was
   * accepted, and a 503 would have a caller without an idempotency key enqueue it again). One
   * that close() ended has nothing to read on: ClientClosedError.
   */
  private answerEnded(jobId: string): Promise<OperationView | null> {
    if (this.closed) return Promise.reject(new ClientClosedError(jobId));
    return this.call(() => this.partitionOf(jobId).inspector.operation(jobId));
  }

  /** Waits for an operation to end, driven by BullMQ's event stream (no polling). */
  async waitForResult(jobId: string, timeoutMs = 60_000): Promise<OperationResult> {
    const view = await this.getOperation(jobId, { waitMs: timeoutMs });
    if (!view) throw new OperationNotFoundError(jobId);
    if (view.state === 'completed') return { jobId, state: 'completed', result: view.result };
    if (view.state === 'failed') return { jobId, state: 'failed', error: view.error ?? { code: 'failed', message: 'the operation failed' } };
    // Ended by endWaits() (the client is closing), not by its time: a caller that reads a
    // timeout as "ask again" would ask again at once, and again (helper-36: 1,914 in 1 s).
    if (this.waitsEnded) throw new ClientClosedError(jobId);
    throw new WaitTimeoutError(`operation ${jobId} still ${view.state} after ${timeoutMs} ms`);
  }

  /** A lease's lane: what executes, what waits, what backs off, and what was last seen of the sandbox. */
  async getLease(lease: LeaseIdentity): Promise<LeaseView> {
    const parsed = LeaseIdentitySchema.safeParse(lease);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error);
    return this.call(async () => {
      const { laneId, partition } = await this.laneOf(parsed.data);
      return partition.inspector.lease(parsed.data, undefined, laneId);
    });
  }

  /** A lease's lane now, its recent events (accepted, attempts, what the provider said, backoffs, the watchdog) and their operations. */
  async getLeaseTimeline(lease: LeaseIdentity): Promise<LeaseTimeline> {
    const parsed = LeaseIdentitySchema.safeParse(lease);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error);
    return this.walk(async () => {
      const { laneId, partition } = await this.laneOf(parsed.data);
      return partition.walker.timeline(parsed.data, undefined, laneId);
    });
  }

  /**
   * Cancels a queued or backing-off operation: it leaves its lane and fails with `cancelled`.
   * OperatorActionRefusedError when it executes or ended; null when there is no such operation.
   */
  cancelOperation(jobId: string, by = 'client'): Promise<CancelResult | null> {
    return this.call(() => this.partitionOf(jobId).actions.cancel(jobId, by));
  }

  /**
   * Runs a failed operation again, with its original time budget from now
   * (OperatorActionRefusedError unless failed), counted against its lease's queue limits
   * (QueueFullError) unless `override`, which goes past them and says so.
   */
  rerunOperation(jobId: string, by = 'client', opts: { override?: boolean } = {}): Promise<RerunResult | null> {
    return this.call(() => this.partitionOf(jobId).actions.rerun(jobId, by, opts));
  }

  /**
   * Takes a lease's failures off the attention list (an operator saw them). A failure also
   * leaves it when the lease's next operation of the same kind succeeds.
   */
  acknowledgeFailures(lease: LeaseIdentity, by = 'client'): Promise<AcknowledgeResult> {
    const parsed = LeaseIdentitySchema.safeParse(lease);
    if (!parsed.success) return Promise.reject(InvalidRequestError.fromZod(parsed.error));
    return this.call(async () => (await this.laneOf(parsed.data)).partition.actions.acknowledge(parsed.data, by));
  }

  /**
   * Pauses a lease's lane: its executing operation finishes, nothing new starts until
   * unpauseLane. Counted against the company's paused lanes (PausesFullError past
   * LEASE_OPS_MAX_PAUSED_PER_COMPANY) unless `override`, which goes past and says so.
   */
  pauseLane(lease: LeaseIdentity, by = 'client', opts: { override?: boolean } = {}): Promise<PauseResult> {
    const parsed = LeaseIdentitySchema.safeParse(lease);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error);
    return this.call(async () => (await this.laneOf(parsed.data)).partition.actions.pause(parsed.data, by, opts));
  }

  unpauseLane(lease: LeaseIdentity, by = 'client'): Promise<PauseResult> {
    const parsed = LeaseIdentitySchema.safeParse(lease);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error);
    return this.call(async () => (await this.laneOf(parsed.data)).partition.actions.unpause(parsed.data, by));
  }

  /**
   * Begins an activity (work inside the lease's sandbox: an exec, a sync) on a lease, by
   * either of its names: a stop, release or destroy of it waits until the activity ends (or
   * its heartbeats stop for `ttlMs`). LeaseClosingError while such an operation is queued or
   * runs. Returns the token to heartbeat and end it with.
   */
  async beginActivity(lease: LeaseIdentity, kind: string, ttlMs: number): Promise<{ token: string; laneId: string; expiresAt: number }> {
    const parsed = ActivityRequestSchema.safeParse({ lease, kind, ttlMs });
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error);
    return this.call(async () => {
      const { laneId, partition } = await this.laneOf(parsed.data.lease);
      const begun = await partition.ops.activities.begin(laneId, parsed.data.lease, parsed.data.kind, parsed.data.ttlMs);
      if (begun.kind === 'closing') throw new LeaseClosingError(begun.jobId, begun.op);
      return { token: begun.token, laneId, expiresAt: begun.expiresAt };
    });
  }

  /** Extends an open activity by `ttlMs` from now; `cancel` says a stop asked it to cancel. ActivityNotFoundError once it is gone. */
  async heartbeatActivity(token: string, ttlMs: number): Promise<{ expiresAt: number; cancel: boolean }> {
    const ttl = ActivityRequestSchema.shape.ttlMs.safeParse(ttlMs);
    if (!ttl.success) throw InvalidRequestError.fromZod(ttl.error);
    if (!laneOfToken(token)) throw new ActivityNotFoundError();
    const beat = await this.call(() => this.partitionOf(laneOfToken(token)!).ops.activities.heartbeat(token, ttl.data));
    if (!beat) throw new ActivityNotFoundError();
    return beat;
  }

  /** Ends an activity; false when it was gone already. */
  async endActivity(token: string): Promise<boolean> {
    if (!laneOfToken(token)) return false;
    return this.call(() => this.partitionOf(laneOfToken(token)!).ops.activities.end(token));
  }

  /** The lease an open activity was begun on (null once it is gone): what a caller's scope is checked against. */
  async activityLease(token: string): Promise<LeaseIdentity | null> {
    if (!laneOfToken(token)) return null;
    return this.call(() => this.partitionOf(laneOfToken(token)!).ops.activities.leaseOf(token));
  }

  private instanceManager: ProviderInstances | null = null;

  /**
   * Provider instances saved at run time (the provider registry in Redis): create, update,
   * list and delete a company's instances, their credentials sealed with the master key.
   */
  get instances(): ProviderInstances {
    this.instanceManager ??= new ProviderInstances(
      new ProviderInstanceStore(this.connection, this.settings.LEASE_OPS_PREFIX, {
        keys: this.opts.masterKeys === undefined ? loadMasterKeys() : this.opts.masterKeys,
        allowedApiUrls: parseAllowedApiUrls(this.settings.LEASE_OPS_INSTANCE_API_URLS),
        maxPerCompany: this.settings.LEASE_OPS_MAX_PROVIDER_INSTANCES_PER_COMPANY,
      }),
      {
        configuredNames: async () => (await this.providers()).map((p) => p.name),
        // Each worker says its stuck budget right after its providers, at its start and every sweep.
        workersAnnounced: async () => (await this.partitions[0]!.ops.announcedStuckBudget()) !== null,
        probe: (target) => this.probeProvider(target),
        call: (run) => this.call(run),
      },
    );
    return this.instanceManager;
  }

  /**
   * Runs a command in a lease's sandbox and resolves with how it ended (exit code, output).
   * An activity brackets it: refused with LeaseClosingError while a stop, release or destroy
   * of the lease is queued or runs; such an operation waits for it, and one with
   * `cancelActiveWork` cancels it (the answer then says `cancelled`). Its env and stdin travel
   * sealed with the master key (needed for them). Fails with ExecError when it cannot run.
   */
  async exec(lease: LeaseIdentity, request: ExecRequestInput, opts: { signal?: AbortSignal; companyInstance?: boolean } = {}): Promise<ExecResult> {
    const parsedLease = LeaseIdentitySchema.safeParse(lease);
    if (!parsedLease.success) throw InvalidRequestError.fromZod(parsedLease.error, 'lease');
    const parsed = ExecRequestSchema.safeParse(request);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error, 'exec request');
    const { laneId, partition } = await this.call(() => this.laneOf(parsedLease.data));
    // The sandbox must be this lease's (by its id, or the id its acquire ran under): a
    // command in another lease's sandbox would run outside that lease's gate.
    const sandboxLane = await this.call(() => this.laneOf({ ...parsedLease.data, leaseId: parsed.data.providerLeaseId }));
    if (sandboxLane.laneId !== laneId) throw new ExecError('not_the_lease_sandbox', `${parsed.data.providerLeaseId} is not the sandbox of lease ${parsedLease.data.leaseId}: run the command on that sandbox's own lease`);
    const companyInstance = opts.companyInstance ?? (await this.call(() => this.holdsInstance(parsedLease.data)));
    const begun = await this.call(() => partition.ops.activities.begin(laneId, parsedLease.data, parsed.data.kind, parsed.data.ttlMs));
    if (begun.kind === 'closing') throw new LeaseClosingError(begun.jobId, begun.op);
    // A caller that goes away ends the activity: the worker sees it gone within a second and cancels the command.
    const onAbort = () => void partition.ops.activities.end(begun.token).catch(() => undefined);
    if (opts.signal?.aborted) onAbort();
    opts.signal?.addEventListener('abort', onAbort, { once: true });
    let jobs = this.execJobs.get(partition.index);
    if (!jobs) {
      jobs = new ExecJobs(this.connection, partition.settings, () => (this.opts.masterKeys === undefined ? loadMasterKeys() : this.opts.masterKeys));
      this.execJobs.set(partition.index, jobs);
    }
    const outcome = await this.call(() => this.untilCut(jobs.run(parsedLease.data, begun.token, parsed.data, `exec.${randomUUID()}`, companyInstance))).catch(async (err: unknown) => {
      // Ended, the activity has the worker cancel the command (cut by closeNow, too: helper-38's ran on).
      const ending = partition.ops.activities.end(begun.token).then(
        () => true,
        () => false,
      );
      this.execsEnding.add(ending);
      const cancelled = await ending.finally(() => this.execsEnding.delete(ending));
      // Cut, with its end not in Redis (Redis slow at the cut): the command may run on, and a
      // caller told to retry would run it twice (helper-39).
      if (err instanceof ClientClosedError && !cancelled) throw new ExecError('exec_cut', 'the API closed while the command ran and could not cancel it: it may still be running; do not run it again blindly');
      throw err;
    });
    opts.signal?.removeEventListener('abort', onAbort);
    if (!outcome.ok) {
      // The worker ends it after running; one that never ran it leaves it to this caller.
      await partition.ops.activities.end(begun.token).catch(() => undefined);
      throw new ExecError(outcome.code, withoutInfrastructure(outcome.message));
    }
    return outcome.result;
  }

  /** Refuses (ConfigError) a master key that does not open the registry's instances: an API's start check. */
  async checkMasterKeys(): Promise<void> {
    await this.call(() => checkMasterKeys(this.instances.store));
  }

  /** The providers the workers serve, each with what it can do (expiry, archive, force-stop, ...). */
  providers(): Promise<AnnouncedProvider[]> {
    return this.call(() => this.partitions[0]!.ops.providerDetails());
  }

  /**
   * Has a worker ask the service whether it takes the provider's credentials (one paced read;
   * answers are shared for 30 s). Never throws for the provider's answer: `ok` says.
   */
  probeProvider(target: string | ProbeTarget): Promise<ProviderProbe> {
    this.probes ??= new ProviderProbes(this.connection, this.partitions[0]!.settings);
    const probes = this.probes;
    // Any caller may read it: no addresses or paths of the infrastructure (a network error's, say).
    return this.call(async () => {
      const probe = await this.untilCut(probes.probe(target));
      return { ...probe, message: withoutInfrastructure(probe.message) };
    });
  }

  /** Leases stuck stopping, whose last operation failed, or whose lane is blocked. */
  async leasesNeedingAttention(limit = 200, visible?: (lease: LeaseIdentity | null) => boolean): Promise<AttentionItem[]> {
    return (await this.attentionPage(0, limit, visible)).items;
  }

  /** A page of leasesNeedingAttention from `offset`, with the offset of the next page (null at the end). */
  async attentionPage(offset: number, limit: number, visible?: (lease: LeaseIdentity | null) => boolean, scope?: AttentionScope): Promise<{ items: AttentionItem[]; next: number | null }> {
    if (this.partitions.length === 1) return this.walk(() => this.partitions[0]!.walker.attentionPage(offset, limit, visible, scope));
    // Each partition lists its items in the same order of reasons: the first offset + limit + 1
    // of all of them are among each one's first offset + limit + 1.
    const lists = await this.walk(() => Promise.all(this.partitions.map((p) => p.walker.attention(offset + limit + 1, visible, scope))));
    const all = mergeByReason(lists);
    return { items: all.slice(offset, offset + limit), next: all.length > offset + limit ? offset + limit : null };
  }

  /** How many entries of the scope index a scoped attention walk reads, over all partitions: what the walk will cost, before it runs. */
  async attentionEntries(scope: AttentionScope): Promise<number> {
    const counts = await this.call(() => Promise.all(this.partitions.map((p) => p.inspector.scopeEntries(scope))));
    return counts.reduce((sum, n) => sum + n, 0);
  }

  /** Leases needing attention, counted by reason (see Inspector.attentionCounts). */
  async attentionCounts(): Promise<Record<AttentionReason, number>> {
    const counts = await this.walk(() => Promise.all(this.partitions.map((p) => p.walker.attentionCounts())));
    return sumRecords(counts);
  }

  /** The overview's counts and the attention by reason, without reading any item: what /metrics reports. */
  async gauges(): Promise<QueueGauges> {
    const views = await this.walk(() => Promise.all(this.partitions.map((p) => p.walker.gauges())));
    if (views.length === 1) return views[0]!;
    return { ...sumCounts(views), attentionByReason: sumRecords(views.map((v) => v.attentionByReason)) };
  }

  /** The whole queue at a glance: operations by state, open lanes, leases needing attention. */
  async overview(): Promise<QueueOverview> {
    const views = await this.walk(() => Promise.all(this.partitions.map((p) => p.walker.overview())));
    if (views.length === 1) return views[0]!;
    return { ...sumCounts(views), attention: mergeByReason(views.map((v) => v.attention)).slice(0, 200) };
  }

  /** Resolves once this client's partition count is the deployment's (LayoutError if not, RedisUnavailableError without Redis). */
  async layoutChecked(): Promise<void> {
    await this.call(async () => undefined);
  }

  /** The partition count Redis holds for this deployment (null before any process ran); no claim of this client's own. */
  heldPartitionCount(): Promise<number | null> {
    return this.call(() => heldPartitionCount(this.connection, this.settings.LEASE_OPS_PREFIX), false);
  }

  /**
   * Runs a call once Redis answers: within LEASE_OPS_REDIS_TIMEOUT_MS, or RedisUnavailableError
   * (with the URL masked and the connection's last error as the cause).
   */
  private async call<T>(run: () => Promise<T>, claimLayout = true): Promise<T> {
    if (this.closed) throw new ClientClosedError();
    try {
      await this.readyWithinTimeout(this.connection);
      if (claimLayout) await this.claimLayout();
      return await run();
    } catch (err) {
      // Its connection was closed under it: that is why it failed (helper-34: redis_unavailable,
      // or a bare Error, before). An answer of its own (a key reused, say) stays (helper-35).
      if (this.closed && (err instanceof RedisUnavailableError || isRedisUnavailable(err) || (err instanceof Error && /connection ended/i.test(err.message)))) throw new ClientClosedError();
      if (err instanceof RedisUnavailableError) throw err;
      if (isRedisUnavailable(err)) throw this.unavailable(err);
      throw err;
    }
  }

  /**
   * A count that differs from the deployment's is refused before any use, and looked at again
   * every 5 s: a long-lived client learns of a change of the count.
   */
  private claimLayout(): Promise<void> {
    if (this.layoutClaimed === null || Date.now() - this.layoutClaimedAt > LAYOUT_RECHECK_MS) {
      this.layoutClaimedAt = Date.now();
      this.layoutClaimed = claimPartitionLayout(this.connection, this.settings).catch((err: unknown) => {
        this.layoutClaimed = null;
        throw err;
      });
    }
    return this.layoutClaimed;
  }

  private unavailable(cause: unknown): RedisUnavailableError {
    return new RedisUnavailableError(maskUrl(this.settings.REDIS_URL), this.timeoutMs, cause === undefined ? undefined : { cause }, refusesCredentials(cause));
  }

  /** BullMQ's event stream of a partition's queue (active, completed, failed, delayed, ...); the first partition's by default. */
  queueEventStream(partition = 0): Promise<QueueEvents> {
    return this.partitions[partition]!.queueEvents();
  }

  /**
   * Ends every pending wait for an operation's end now, and every later one at once: each
   * answers the operation as it is then, as a wait whose time ran out does; the connections
   * stay open. The API's close calls it first, so that its long polls answer before it stops.
   */
  endWaits(): void {
    this.closing.abort();
    for (const p of this.partitions) p.wakeWaits();
  }

  /**
   * close() without waiting for what is in flight: its connections go at once, so calls still
   * running end with ClientClosedError now (the API's close, at its cut).
   */
  async closeNow(): Promise<void> {
    this.closed = true;
    this.endWaits();
    // Execs and probes still waiting end now; an exec's activity is ended first (its command
    // cancelled), for up to 250 ms, while the connections are still up.
    this.cutting.abort();
    await new Promise((resolve) => setImmediate(resolve));
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([Promise.allSettled([...this.execsEnding]), new Promise((resolve) => (timer = setTimeout(resolve, 250)))]);
    clearTimeout(timer);
    for (const p of this.partitions) p.disconnect();
    this.connection.disconnect();
    this.walkConnection?.disconnect();
    await this.close();
  }

  /** Closes the connections; with Redis gone, gives BullMQ LEASE_OPS_REDIS_TIMEOUT_MS to close, then cuts them. */
  async close(): Promise<void> {
    this.closed = true;
    this.endWaits();
    const closing = Promise.all([...this.partitions.map((p) => p.close()), this.probes?.close(), ...[...this.execJobs.values()].map((j) => j.close())]);
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([closing.catch(() => undefined), new Promise((resolve) => (timer = setTimeout(resolve, this.timeoutMs)))]);
    clearTimeout(timer);
    for (const p of this.partitions) p.disconnect();
    this.connection.disconnect();
    this.walkConnection?.disconnect();
  }
}

/** One partition as a client sees it: its queue and lanes, their views, operator actions and event stream. */
export class ClientPartition {
  readonly ops: OperationsQueue;
  readonly actions: OperatorActions;
  readonly inspector: Inspector;
  private events: Promise<QueueEvents> | null = null;
  private opened: QueueEvents | null = null;
  private eventsConnection: RedisClient | null = null;
  private closed = false;

  constructor(
    readonly index: number,
    /** The settings with this partition's prefix. */
    readonly settings: Config,
    connection: RedisClient,
    names?: LaneNames,
    /** The connection walks read on (LeaseOpsClient opens it at the first); the main one if left out. */
    private readonly walkConnection: () => RedisClient = () => connection,
  ) {
    this.ops = new OperationsQueue(connection, settings, names);
    // Each wait for an operation's end listens for the queue closing; many concurrent waits are normal here.
    this.ops.queue.setMaxListeners(0);
    this.actions = new OperatorActions(this.ops);
    this.inspector = this.inspectorOn(this.ops, connection);
  }

  private inspectorOn(ops: OperationsQueue, connection: RedisClient): Inspector {
    return new Inspector(ops, new LeaseRecords(connection, this.settings.LEASE_OPS_PREFIX), {
      stuckStoppingMs: this.settings.LEASE_OPS_STUCK_STOPPING_MS,
      // The sweep repairs a quiet lane within stale + interval; past twice that, it is news.
      blockedAfterMs: 2 * (this.settings.LEASE_OPS_SWEEP_STALE_MS + this.settings.LEASE_OPS_SWEEP_INTERVAL_MS),
    });
  }

  private walkOps: OperationsQueue | null = null;
  private walkInspector: Inspector | null = null;
  /** The inspector for walks (attention, timelines, the overview), on the walk connection. */
  get walker(): Inspector {
    if (!this.walkInspector) {
      const connection = this.walkConnection();
      this.walkOps = connection === this.ops.connection ? this.ops : new OperationsQueue(connection, this.settings, this.ops.names);
      this.walkInspector = this.inspectorOn(this.walkOps, connection);
    }
    return this.walkInspector;
  }

  queueEvents(): Promise<QueueEvents> {
    if (this.closed) return Promise.reject(new ClientClosedError());
    if (!this.events) {
      // Its connection is known before it opens: close() cuts one still opening (a Redis that
      // takes no new connection), which would otherwise keep the process alive (helper-34).
      const connection = createRedis(this.settings.REDIS_URL, { connectionName: 'lease-ops-client-events' });
      this.eventsConnection = connection;
      this.events = openQueueEvents(this.settings.REDIS_URL, this.settings.LEASE_OPS_QUEUE, this.settings.LEASE_OPS_PREFIX, connection).then(
        ({ events }) => (this.opened = events),
        (err: unknown) => {
          // Not opened: the next wait tries again, rather than every wait failing for good.
          connection.disconnect();
          if (this.eventsConnection === connection) this.eventsConnection = null;
          this.events = null;
          throw err;
        },
      );
    }
    return this.events;
  }

  /**
   * Ends every wait for an operation's end on this partition now: BullMQ's waitUntilFinished
   * gives up when its queue emits 'closing', which BullMQ's Queue itself never emits
   * (pinned in test/bullmq-contract.test.ts).
   */
  wakeWaits(): void {
    (this.ops.queue as unknown as NodeJS.EventEmitter).emit('closing', 'the client closed');
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.opened) await this.opened.close();
    else if (this.events) {
      // Still opening: its connection goes now, and the opening fails.
      this.eventsConnection?.disconnect();
      await this.events.catch(() => undefined);
    }
    await this.ops.close();
    if (this.walkOps && this.walkOps !== this.ops) await this.walkOps.close();
  }

  disconnect(): void {
    this.eventsConnection?.disconnect();
  }
}

const ActivityRequestSchema = z.object({
  lease: LeaseIdentitySchema,
  kind: z.string().min(1).max(64).regex(/^[^\p{Cc}]+$/u, 'kind must not contain control characters'),
  ttlMs: z.number().int().min(MIN_ACTIVITY_TTL_MS).max(MAX_ACTIVITY_TTL_MS),
});

/** Every wait opening the event stream listens on one controller's signal: no limit to warn at. */
function withoutListenerLimit(controller: AbortController): AbortController {
  setMaxListeners(0, controller.signal);
  return controller;
}

/**
 * BullMQ's wait for a job's end, or the job's removal (an operator, in Bull Board: BullMQ's
 * wait hears only its completed and failed events, and ran out its time; helper-54): removed,
 * it settles at once, and BullMQ's wait is left to end at its time or the client's closing,
 * unheard. A bulk clean names no job (one `cleaned` event with a count): each wait then asks
 * whether its own job is still there (one EXISTS), and settles if not.
 */
async function untilFinishedOrRemoved(job: Job, jobId: string, events: QueueEvents, ttlMs: number, stillThere: () => Promise<boolean>): Promise<void> {
  // BullMQ emits a job's own events by name (removed:<id>), which its typings do not list.
  const emitter = events as unknown as NodeJS.EventEmitter;
  const removedEvent = `removed:${jobId}`;
  let onRemoved = (): void => undefined;
  const removed = new Promise<void>((resolve) => (onRemoved = () => resolve()));
  const onCleaned = () => void stillThere().then((there) => there || onRemoved(), () => undefined);
  emitter.once(removedEvent, onRemoved);
  emitter.on('cleaned', onCleaned);
  const finished = job.waitUntilFinished(events, ttlMs);
  try {
    await Promise.race([finished, removed]);
  } finally {
    emitter.off(removedEvent, onRemoved);
    emitter.off('cleaned', onCleaned);
    finished.catch(() => undefined);
  }
}

/** What `promise` gives, or null when `ms` pass (or `signal` aborts) first. */
async function settledWithin<T>(promise: Promise<T>, ms: number, signal: AbortSignal): Promise<T | null> {
  let timer: NodeJS.Timeout | undefined;
  let onAbort: (() => void) | undefined;
  try {
    return await Promise.race([
      promise,
      new Promise<null>((resolve) => {
        timer = setTimeout(() => resolve(null), ms);
        onAbort = () => resolve(null);
        if (signal.aborted) resolve(null);
        else signal.addEventListener('abort', onAbort, { once: true });
      }),
    ]);
  } finally {
    clearTimeout(timer);
    if (onAbort) signal.removeEventListener('abort', onAbort);
  }
}

/** The wait for each connection's next 'ready', shared by every call made meanwhile. */
const readiness = new WeakMap<RedisClient, Promise<void>>();

/**
 * Resolves once the connection is up (at once if it is); rejects if it ends first. Calls made
 * meanwhile share one pair of listeners, removed when either fires: a listener each, left
 * behind, made 17 enqueues at start-up warn of an EventEmitter leak.
 */
async function whenReady(connection: RedisClient): Promise<void> {
  if (connection.status === 'ready') return;
  let pending = readiness.get(connection);
  if (!pending) {
    pending = new Promise<void>((resolve, reject) => {
      const settle = (err?: Error) => {
        connection.off('ready', onReady);
        connection.off('end', onEnd);
        readiness.delete(connection);
        if (err) reject(err);
        else resolve();
      };
      const onReady = () => settle();
      const onEnd = () => settle(new Error('Redis connection ended'));
      connection.on('ready', onReady);
      connection.on('end', onEnd);
    });
    readiness.set(connection, pending);
  }
  await pending;
}

/** How often a client looks at the deployment's partition count again. */
const LAYOUT_RECHECK_MS = 5_000;

const REASON_ORDER: AttentionReason[] = ['stuck_stopping', 'operation_failed', 'paused', 'blocked'];

/** Attention lists of several partitions as one, in the order of reasons each keeps. */
function mergeByReason(lists: AttentionItem[][]): AttentionItem[] {
  return REASON_ORDER.flatMap((reason) => lists.flatMap((items) => items.filter((item) => item.reason === reason)));
}

/** The partitions' overview counts as one: each a sum. */
function sumCounts(views: Omit<QueueOverview, 'attention'>[]): Omit<QueueOverview, 'attention'> {
  return {
    counts: sumRecords(views.map((v) => v.counts)),
    openLanes: views.reduce((n, v) => n + v.openLanes, 0),
    attentionLeases: views.reduce((n, v) => n + v.attentionLeases, 0),
    bytesByCompany: sumRecords(views.map((v) => v.bytesByCompany)),
  };
}

function sumRecords<K extends string>(records: Record<K, number>[]): Record<K, number> {
  const sum = { ...records[0]! };
  for (const record of records.slice(1)) for (const key of Object.keys(record) as K[]) sum[key] = (sum[key] ?? 0) + record[key];
  return sum;
}

/** Whether Redis answered, but refused the credentials (a wrong or missing password). */
function refusesCredentials(err: unknown): boolean {
  return /NOAUTH|WRONGPASS|invalid password|invalid username/i.test(String((err as Error | undefined)?.message));
}
