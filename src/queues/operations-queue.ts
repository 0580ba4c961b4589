import { createHash, randomBytes } from 'node:crypto';
import { Job, Queue, type JobsOptions } from 'bullmq';
import { z } from 'zod';
import { reportRedisError, type RedisClient } from './redis.ts';
import { ACCEPTED_ALLOWANCE_BYTES, CompanyBytes } from './company-bytes.ts';
import { leaseRecordKey } from './lease-records.ts';
import type { Config } from '../config.ts';
import { laneIdOf, laneIdOfJobId, LeaseIdentitySchema, type LeaseIdentity } from '../lease.ts';
import { partitionOfLane } from '../partitions.ts';
import {
  DEFAULT_DEADLINE_MS,
  OperationJobDataSchema,
  OperationParamsSchemas,
  type OperationJobData,
  type OperationName,
  OperationNameSchema,
} from '../operations.ts';
import { IdempotencyKeyReusedError, LeaseHasSandboxError, QueueFullError, type QueueLimit } from '../errors.ts';
import { assertTestedBullmq } from './bullmq-version.ts';
import { faultPoint } from '../fault-points.ts';
import { PartitionLayoutError } from './layout.ts';
import { LeaseHistory, type HistoryNote } from './lease-history.ts';
import { Lanes, NO_LIMITS, type LaneOutcome, type QueueLimits } from './lane.ts';
import { Activities } from './activities.ts';
import { LaneNames, LaneRedirect } from './lane-names.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import { hasAcquiredSandbox, type LeaseRecord } from './lease-records.ts';
import type { ProviderCapabilities } from '../providers/types.ts';

/**
 * How long a job waits in BullMQ's delayed set while it is not its lane's turn. The lane,
 * not this timer, releases it; the timer only bounds how long a job whose enqueue was cut
 * short (in BullMQ, but never in a lane) waits before a worker fails it as an orphan.
 */
export const PARK_MS = 24 * 3_600_000;
/** How long a read of the announced providers answers for a name it holds (see announcedProviders). */
export const ANNOUNCED_REUSE_MS = 5_000;

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
  /** Run with the lease's company's provider instance of its name only (OperationJobData's `instance`). */
  companyInstance?: boolean;
  /** lease-ops' own: an event on the lease's timeline written with this operation, just before it is accepted. */
  note?: HistoryNote;
  /**
   * lease-ops' own: the watchdog's claim of this force-stop on the record of lane `laneId`
   * (lease-force-claim.lua). It joins its lane only while the record shows the claim, and the
   * record keeps its job in the same step; otherwise ForceStopClaimOver. (Not held for a
   * record in another partition than the lane's.)
   */
  claim?: { laneId: string; since: number; forceStops: number };
};

/** A watchdog's force-stop was not queued: the lease's record no longer shows the claim it was queued for. */
export class ForceStopClaimOver extends Error {
  override name = 'ForceStopClaimOver';
  constructor() {
    super("the stuck episode the force-stop was claimed for is over on the lease's record");
  }
}

export interface Enqueued {
  jobId: string;
  laneId: string;
  /** Set when no new job was made: an identical queued request or the same key took it. */
  deduplicated?: 'coalesced' | 'idempotency-key' | 'absorbed-stop';
}

/**
 * What an enqueue answers inside lease-ops: also whether this call put the job into its
 * lane, writing its timeline note (a retry of a request cut short may be the one that does,
 * and still answers as deduplicated). The client answers an Enqueued without it.
 */
export type EnqueuedHere = Enqueued & { joinedHere: boolean };

const IDEMPOTENCY_TTL_S = 24 * 3_600;

/** Events BullMQ keeps in the queue's stream (about: it trims whole nodes); waiters read them as they come. */
export const EVENTS_KEPT = 2_000;

/** What a refused enqueue suggests as Retry-After: operations take seconds, so do queues. */
const FULL_RETRY_AFTER_MS = 5_000;

/**
 * Requests that mean the same as the one queued last and not yet started: a second stop of
 * the same sandbox, or a release with the same parameters. '' for none.
 */
export function coalescingKey(data: OperationJobData): string {
  if (data.op === 'stop') return stopKey(data.params.providerLeaseId, data.params.cancelActiveWork === true, data.instance === true);
  if (data.op === 'release') return `release:${createHash('sha256').update(JSON.stringify(data.params)).digest('base64url')}${data.instance ? ':instance' : ''}`;
  return '';
}

/**
 * A queued stop's coalescing key. A stop that asks the work in the sandbox to cancel is not the
 * same request as one that waits for it; nor is one for the company's instance the same as one
 * for a configured provider (helper-61), for a stop joining it or a force-stop absorbing it (helper-62).
 */
function stopKey(providerLeaseId: string, cancelActiveWork: boolean, companyInstance: boolean): string {
  return `stop:${providerLeaseId}${cancelActiveWork ? ':cancel' : ''}${companyInstance ? ':instance' : ''}`;
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
  | 'LEASE_OPS_MAX_QUEUED_PER_COMPANY'
  | 'LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT'
  | 'LEASE_OPS_MAX_PAUSED_PER_COMPANY'
  | 'LEASE_OPS_MAX_BYTES_PER_COMPANY'
  | 'LEASE_OPS_QUEUE_LIMITS'
  | 'LEASE_OPS_PARTITIONS'
>;

/**
 * The lease-ops queue: one BullMQ queue for every lease, plus the lanes that keep each
 * lease's operations one at a time and in order. Used by producers and workers alike.
 */
export class OperationsQueue {
  readonly queue: Queue;
  readonly lanes: Lanes;
  /** Each lease's events (the lane and record scripts write most; see lease-history.ts). */
  readonly history: LeaseHistory;
  private readonly jobOptions: JobsOptions;
  private readonly deleteIfEqual: LuaCommand;
  private readonly replaceIfEqual: LuaCommand;
  /** Acquires that have not ended: job id -> lease (JSON). */
  private readonly acquiresKey: string;
  /** Provider names some worker served, with when it last said so. */
  readonly providersKey: string;
  /** The workers' settings that views must judge by too (the stuck-stopping budget). */
  readonly deploymentKey: string;
  private acquiresCursor = '0';
  /** Acquires seen without a job, and since when (see reconcileAcquires). */
  private readonly vanishedSince = new Map<string, number>();

  /** Redis bytes each company's operations hold, against its budget. */
  readonly bytes: CompanyBytes;
  /** The second names of lanes (a sandbox's id, after its acquire), shared by a deployment's partitions. */
  readonly names: LaneNames;
  /** Work inside the leases' sandboxes that their stops wait for (activity gates). */
  readonly activities: Activities;

  constructor(
    readonly connection: RedisClient,
    readonly settings: QueueSettings,
    /** With several partitions, one for all of them (a name's key is in the partition of the lane it names). */
    names?: LaneNames,
  ) {
    assertTestedBullmqOnce();
    // The event stream carries each completion's result (a lease's metadata, up to 16 KiB):
    // kept to EVENTS_KEPT, not BullMQ's 10,000, so it holds tens of MB at most, not 160.
    this.queue = new Queue(settings.LEASE_OPS_QUEUE, { connection, prefix: settings.LEASE_OPS_PREFIX, streams: { events: { maxLen: EVENTS_KEPT } } });
    // BullMQ prints an error event nobody listens to: it goes to the same report as the connection's.
    this.queue.on('error', reportRedisError);
    this.lanes = this.lanesOn(connection);
    this.names = names ?? new LaneNames(() => this.lanes);
    this.activities = new Activities(connection, settings.LEASE_OPS_PREFIX, this.queue.toKey(''));
    this.history = new LeaseHistory(connection, settings.LEASE_OPS_PREFIX);
    this.bytes = new CompanyBytes(connection, settings.LEASE_OPS_PREFIX, this.queue.toKey(''));
    this.deleteIfEqual = luaCommand(connection, 'delete-if-equal', 1);
    this.replaceIfEqual = luaCommand(connection, 'replace-if-equal', 1);
    this.acquiresKey = this.lanes.acquiresKey;
    this.providersKey = `${settings.LEASE_OPS_PREFIX}:providers`;
    this.deploymentKey = `${settings.LEASE_OPS_PREFIX}:deployment`;
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
   * names a job that does not exist. A parked job's BullMQ timer is its deadline: if it is
   * still waiting in its lane then, a worker fails it (deadline_exceeded) at that moment.
   *
   * Idempotency keys are scoped to the lease's company and environment, and remember the
   * request they came with: the same key with another request is refused
   * (IdempotencyKeyReusedError). The key is written (pending, naming the job id to be)
   * before the job, and marked accepted in the step that puts the job in its lane; a retry
   * of a request cut short in between finishes it under the same job id, which BullMQ adds
   * at most once, whoever gets there first.
   */
  async enqueue(request: EnqueueRequest, route: { laneId?: string } = {}): Promise<Enqueued> {
    const { jobId, laneId, deduplicated } = await this.enqueueHere(request, route);
    return { jobId, laneId, ...(deduplicated ? { deduplicated } : {}) };
  }

  /** As enqueue, also saying whether this call put the job into its lane (EnqueuedHere). */
  async enqueueHere(request: EnqueueRequest, route: { laneId?: string } = {}): Promise<EnqueuedHere> {
    // Another request with the same idempotency key may take back the job this one meant to
    // finish: then this one starts over (and, if that one was refused, is refused the same way).
    let laneId = route.laneId;
    for (;;) {
      const enqueued = await this.enqueueOnce(request, laneId);
      if (enqueued === null) continue;
      if ('movedTo' in enqueued) {
        // The lease is a second name of another lane: with partitions, that lane may be in
        // another one, which the caller routes to (enqueueRouted).
        if (this.settings.LEASE_OPS_PARTITIONS > 1) throw new LaneRedirect(enqueued.movedTo);
        laneId = enqueued.movedTo;
        continue;
      }
      return enqueued;
    }
  }

  /**
   * One try at enqueue into `laneId` (by default the lane the lease's name is known to name,
   * or its own); null when a request with the same key took the job back meanwhile, movedTo
   * when the lease turned out to be a second name of another lane (nothing of it was kept).
   */
  private async enqueueOnce(request: EnqueueRequest, routed: string | undefined): Promise<EnqueuedHere | { movedTo: string } | null> {
    const now = Date.now();
    const data = buildJobData(request, now, this.settings.LEASE_OPS_DEADLINES_MS);
    const own = laneIdOf(data.lease);
    let laneId = routed ?? this.names.cached(own) ?? own;
    const sandbox = targetSandbox(data);
    if (sandbox !== null && sandbox !== data.lease.leaseId) {
      // Named by one name with the other's sandbox (the acquire's id, say, and the sandbox's):
      // both must name one lease, whose lane it then joins.
      laneId = routed ?? (await this.names.resolve(own));
      const sandboxLane = await this.names.resolve(laneIdOf({ ...data.lease, leaseId: sandbox }));
      if (sandboxLane !== laneId) throw notTheLeasesSandbox(sandbox, data.lease.leaseId);
    }
    if (data.op !== 'acquire' && (laneId !== own || (sandbox !== null && sandbox !== data.lease.leaseId))) {
      // A sandbox id names its lease only while it is the lease's sandbox: after a destroy and
      // a new acquire, the old id (and the lease's name with the old sandbox) would act on the
      // lease's new sandbox, or point its record back at the old one and let a third be made.
      const [current, acquiredAs] = await this.connection.hmget(leaseRecordKey(this.settings.LEASE_OPS_PREFIX, laneId), 'providerLeaseId', 'acquiredAs');
      // The name, when it is a sandbox's (a second name of the lane, and not the id the lane's
      // last acquire was enqueued under: an old sandbox's id reused for an acquire names the
      // lease it joined), and the sandbox it targets.
      const nameIsSandboxes = laneId !== own && data.lease.leaseId !== acquiredAs;
      for (const named of [nameIsSandboxes ? data.lease.leaseId : null, sandbox]) {
        if (named !== null && current && current !== named) throw notTheLeasesSandbox(named, data.lease.leaseId, current);
      }
    }
    let jobId = `${laneId}.${randomBytes(12).toString('base64url')}`;
    let idem: { key: string; fingerprint: string } | null = null;
    if (request.idempotencyKey !== undefined) {
      idem = { key: this.idempotencyKey(data.lease, request.idempotencyKey), fingerprint: fingerprintOf(data) };
      const claimed = await this.claimIdempotencyKey(idem.key, idem.fingerprint, jobId);
      await faultPoint('enqueue-after-key');
      if (claimed.kind === 'accepted') return { jobId: claimed.jobId, laneId: laneIdOfJobId(claimed.jobId) ?? laneId, deduplicated: 'idempotency-key', joinedHere: false };
      if (claimed.kind === 'pending') {
        // An earlier request with this key was cut short before its job joined its lane:
        // finish it, under its job id. Its job may exist already (then it joins its lane here).
        jobId = claimed.jobId;
        laneId = laneIdOfJobId(jobId) ?? laneId;
        const existing = await Job.fromId(this.queue, jobId);
        if (existing) {
          // Its data is this request's: the key's fingerprint matched.
          // Accepted when it was first stored: the history says the time its data holds.
          const adopted = await this.joinLane(laneId, jobId, { ...data, acceptedAt: (existing.data as OperationJobData).acceptedAt ?? data.acceptedAt }, '', idem, true, request.note, request.claim);
          return adopted && ('movedTo' in adopted ? adopted : { ...adopted, deduplicated: 'idempotency-key' });
        }
      }
    }
    if (data.op === 'acquire') {
      // One lease, one sandbox: a lease whose acquire handed out a sandbox that lives is not
      // acquired again (its record, its watchdog and its views would follow one of the two).
      const [kind, providerLeaseId, acquiredSandbox] = await this.connection.hmget(leaseRecordKey(this.settings.LEASE_OPS_PREFIX, laneId), 'kind', 'providerLeaseId', 'acquiredSandbox');
      if (hasAcquiredSandbox({ kind: kind as LeaseRecord['kind'], providerLeaseId: providerLeaseId ?? '', acquiredSandbox: acquiredSandbox ?? null })) {
        const sandbox = providerLeaseId!;
        if (idem) await this.deleteIfEqual(idem.key, pendingValue(jobId, idem.fingerprint));
        throw new LeaseHasSandboxError(sandbox);
      }
    }
    const coalesceAs = coalescingKey(data);
    if (data.op === 'force-stop' && data.params.ifStoppingSince === undefined) {
      // A force-stop absorbs a stop of the same sandbox that has not started yet (a
      // conditional one, which may force nothing, must not stand in for a stop).
      // The key is marked accepted, naming the stop's job, in the same step.
      const upgraded = await this.lanes.upgradeQueuedStop(laneId, stopKey(data.params.providerLeaseId, false, data.instance === true), data, idem);
      if (upgraded) {
        return { jobId: upgraded, laneId, deduplicated: 'absorbed-stop', joinedHere: false };
      }
    }
    // Counted against the company's bytes before it is stored (a force-stop is counted, never
    // refused); on the queue's connection once it is ready, as BullMQ's add would wait for it.
    await this.queue.waitUntilReady();
    await this.bytes.admit(data.lease.companyId, jobId, Buffer.byteLength(JSON.stringify(data)) + ACCEPTED_ALLOWANCE_BYTES, data.op === 'force-stop' ? 0 : this.bytesBudgetFor(data.lease));
    await this.queue.add(data.op, data, { ...this.jobOptions, jobId, delay: parkDelay(data, now) });
    return this.joinLane(laneId, jobId, data, coalesceAs, idem, false, request.note, request.claim);
  }

  /**
   * Puts a stored job into its lane, within the limits, and answers for it; refused, nothing
   * of it stays behind. With an idempotency key, the job joins its lane only while the key
   * still names it as pending (lane-push.lua), and a refusal takes the key back before the job:
   * so of two requests with one key, either the job joined (and both answer with it) or it was
   * taken back (and neither does). Null: another request took it back first.
   */
  private async joinLane(
    laneId: string,
    jobId: string,
    data: OperationJobData,
    coalesceAs: string,
    idem: { key: string; fingerprint: string } | null,
    adopt: boolean,
    note?: HistoryNote,
    claim?: EnqueueRequest['claim'],
  ): Promise<EnqueuedHere | { movedTo: string } | null> {
    // Until it ends, an acquire is known here with its lease: if its job vanishes (an operator
    // removed it), the sweep still knows what to clean up after it (reconcileAcquires).
    if (data.op === 'acquire') await this.connection.hset(this.acquiresKey, jobId, JSON.stringify(data.lease));
    // The sanctioned exception: a force-stop goes ahead of queued and backing-off
    // operations of its lease, never alongside an executing one.
    // The claim is on the record of its lane, which may not be this one (a sandbox with a lane
    // of its own): held here as long as that record is in this partition (one script's keys
    // share a hash tag); across partitions the force-stop joins as it would without one.
    const partitions = this.settings.LEASE_OPS_PARTITIONS;
    const onRecord =
      claim && partitionOfLane(claim.laneId, partitions) === partitionOfLane(laneId, partitions)
        ? { recordKey: leaseRecordKey(this.settings.LEASE_OPS_PREFIX, claim.laneId), since: claim.since, forceStops: claim.forceStops }
        : null;
    const pushed = await this.lanes.push(laneId, jobId, data.op === 'force-stop' ? 'front' : 'tail', coalesceAs, data.lease, this.limitsFor(data.lease), adopt, idem, note ?? null, data, false, onRecord);
    if (pushed.kind === 'claim-over') {
      // Nothing of it stays: neither its job nor its key (a later claim is another force-stop).
      await this.queue.remove(jobId);
      if (idem) await this.deleteIfEqual(idem.key, pendingValue(jobId, idem.fingerprint));
      throw new ForceStopClaimOver();
    }
    if (pushed.kind === 'gone') {
      // Its key no longer names it: no request can put this job in a lane any more, and this
      // request may have stored it again after the one that took it back removed it.
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      await this.queue.remove(jobId);
      return null;
    }
    if (pushed.kind === 'alias') {
      // The lease is a second name of another lane: nothing of this try stays (its key is
      // taken back while it still names this job, for the retry into that lane to take).
      this.names.learn(laneId, pushed.laneId);
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      await this.queue.remove(jobId);
      if (idem) await this.deleteIfEqual(idem.key, pendingValue(jobId, idem.fingerprint));
      return { movedTo: pushed.laneId };
    }
    if (pushed.kind === 'removed') {
      // An operator removed the job before it joined its lane: accepted, then removed.
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      return { jobId, laneId, joinedHere: false };
    }
    if (pushed.kind === 'absorbed') {
      // An identical request got in first: ours never joined the lane, so drop its job
      // (forgotten as an acquire first: the sweep must never take it for one that vanished).
      // (lane-push marked the key accepted, naming the job that absorbed it.)
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      await this.queue.remove(jobId);
      return { jobId: pushed.by, laneId, deduplicated: 'coalesced', joinedHere: false };
    }
    if (pushed.kind === 'layout') {
      // The partition count changed since this process started: nothing of it stays.
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      await this.queue.remove(jobId);
      if (idem) await this.deleteIfEqual(idem.key, pendingValue(jobId, idem.fingerprint));
      throw new PartitionLayoutError(pushed.held, this.settings.LEASE_OPS_PARTITIONS, this.settings.LEASE_OPS_PREFIX);
    }
    if (pushed.kind === 'full') {
      // The key becomes the refusal for a moment, so concurrent retries of this request get
      // the same answer; then it goes, and a later retry is a new request.
      const refusal = refusedValue(idem?.fingerprint ?? '', pushed.limit, pushed.count);
      if (idem && (await this.replaceIfEqual(idem.key, pendingValue(jobId, idem.fingerprint), refusal, REFUSAL_KEPT_MS)) === 0) {
        // The key no longer names this job as pending: another request with it got the job
        // into its lane meanwhile (the key says accepted), or took it back.
        const now = parseIdempotencyValue(await this.connection.get(idem.key));
        if (now?.state === 'accepted') return { jobId: now.jobId, laneId: laneIdOfJobId(now.jobId) ?? laneId, deduplicated: 'idempotency-key', joinedHere: false };
      }
      // Refused: nothing of this request may stay behind, neither its job nor its key.
      if (data.op === 'acquire') await this.connection.hdel(this.acquiresKey, jobId);
      await this.queue.remove(jobId);
      throw new QueueFullError(pushed.limit, pushed.count, FULL_RETRY_AFTER_MS);
    }
    // Already in its lane: another request with the same key (a retry, or a watchdog finishing
    // a claim beside the one that made it) put it there.
    if (pushed.kind === 'present') return { jobId, laneId, deduplicated: 'idempotency-key', joinedHere: false };
    return { jobId, laneId, joinedHere: true };
  }

  /**
   * Queues the clean-up of an acquire that failed for good (see processors/abandon-acquire.ts)
   * in the acquire's own lane, ahead of what waits there. Never refused by queue limits, and
   * queued once per acquire however often its failure is handled (a crash may repeat it).
   * `checkpoint` is what the acquire's attempts saved, or null when its job is gone.
   */
  /** A worker says which providers it serves, and what each can do (at start, and every sweep interval). */
  async announceProviders(providers: readonly { name: string; capabilities: ProviderCapabilities }[]): Promise<void> {
    if (providers.length === 0) return;
    const at = Date.now();
    await this.connection.hset(this.providersKey, Object.fromEntries(providers.map(({ name, capabilities }) => [name, JSON.stringify({ at, capabilities })])));
  }

  /**
   * What the workers judge "stuck stopping" by: each worker says it (the last one wins), so
   * the API, the CLI and the pages call a lease stuck when the watchdog does, whatever their
   * own LEASE_OPS_STUCK_STOPPING_MS.
   */
  async announceStuckBudget(stuckStoppingMs: number): Promise<void> {
    await this.connection.hset(this.deploymentKey, 'stuckStoppingMs', String(stuckStoppingMs));
  }

  /** The stuck-stopping budget a worker announced, or null before any did. */
  async announcedStuckBudget(): Promise<number | null> {
    const text = await this.connection.hget(this.deploymentKey, 'stuckStoppingMs');
    return text !== null && /^\d+$/.test(text) ? Number(text) : null;
  }

  /** Every provider some worker served, when it last said so, and what it can do (null if it did not say). */
  async providerDetails(): Promise<AnnouncedProvider[]> {
    const all = await this.connection.hgetall(this.providersKey);
    return Object.entries(all)
      .map(([name, value]) => ({ name, ...parseAnnouncement(value) }))
      .sort((a, b) => a.name.localeCompare(b.name));
  }

  /** Whether a request came under this idempotency key already (its receipt is then repeated). */
  async idempotencyKeyUsed(lease: LeaseIdentity, key: string): Promise<boolean> {
    return (await this.connection.exists(this.idempotencyKey(lease, key))) === 1;
  }

  /** The names of the last read of the announced providers, and when it was made. */
  private announcedRead: { names: string[]; at: number } | null = null;

  /**
   * Provider names some worker has served: what the API accepts. A read of the last
   * ANNOUNCED_REUSE_MS that names `expected` answers for it (an enqueue of a served provider
   * costs no read); a name it does not hold is read again (a worker may have announced it since).
   * Names go only with Redis' data (or an operator's DEL), and the workers announce theirs again
   * within a sweep: an operation accepted meanwhile for a provider no worker serves any more
   * waits for one within its deadline, as in a rolling change of LEASE_OPS_PROVIDERS.
   */
  async announcedProviders(expected?: string): Promise<string[]> {
    const last = this.announcedRead;
    // The monotonic clock: a step of the wall clock neither stretches nor ends the reuse.
    if (expected !== undefined && last && performance.now() - last.at < ANNOUNCED_REUSE_MS && last.names.includes(expected)) return last.names;
    const names = await this.connection.hkeys(this.providersKey);
    this.announcedRead = { names, at: performance.now() };
    return names;
  }

  /** Queues the clean-up of an acquire; `companyInstance`: the acquire's own (its data's `instance`). */
  async enqueueAbandon(lease: LeaseIdentity, acquireJobId: string, checkpoint: Record<string, unknown> | null, companyInstance = false): Promise<Enqueued> {
    // The lane the acquire ran in: the lease's, whichever of its names the acquire was enqueued under.
    const laneId = laneIdOfJobId(acquireJobId) ?? laneIdOf(lease);
    const now = Date.now();
    const strings = checkpoint && Object.fromEntries(Object.entries(checkpoint).filter((e): e is [string, string] => typeof e[1] === 'string'));
    const data = OperationJobDataSchema.parse({
      op: 'abandon-acquire',
      lease,
      params: { acquireJobId, checkpoint: strings },
      acceptedAt: now,
      deadlineAt: now + (this.settings.LEASE_OPS_DEADLINES_MS['abandon-acquire'] ?? DEFAULT_DEADLINE_MS['abandon-acquire']),
      ...(companyInstance ? { instance: true } : {}),
    });
    const jobId = `${laneId}.${createHash('sha256').update(`abandon:${acquireJobId}`).digest('base64url').slice(0, 16)}`;
    await this.queue.add(data.op, data, { ...this.jobOptions, jobId, delay: parkDelay(data, now) });
    const pushed = await this.lanes.push(laneId, jobId, 'front', '', lease, NO_LIMITS, true, null, null, data);
    await this.connection.hdel(this.acquiresKey, acquireJobId);
    return { jobId, laneId, ...(pushed.kind === 'present' ? { deduplicated: 'idempotency-key' as const } : {}) };
  }

  /**
   * Acquires whose job vanished before they ended (removed by an operator) get their
   * clean-up queued, as if they had failed; ended ones are forgotten. Looks at up to `count`
   * acquires per call, continuing where the last call stopped. Returns how many it queued.
   *
   * A job is taken for vanished only when a later call still finds its entry and still no
   * job, at least `graceMs` after the first: an acquire's release forgets it in the same step
   * that records its end (lane-release.lua), before BullMQ completes (and perhaps removes)
   * its job, but this call's listing of entries can be older than its look at a job's state.
   */
  async reconcileAcquires(count = 200, graceMs = 1_000, holdsInstance: (lease: LeaseIdentity) => Promise<boolean> = async () => false): Promise<number> {
    const [next, flat] = await this.connection.hscan(this.acquiresKey, this.acquiresCursor, 'COUNT', count);
    this.acquiresCursor = next;
    const now = Date.now();
    let queued = 0;
    for (let i = 0; i + 1 < flat.length; i += 2) {
      const jobId = flat[i]!;
      const completedAt = completedAcquireAt(flat[i + 1]!);
      if (completedAt !== null) {
        if (now - completedAt > COMPLETED_ACQUIRE_KEPT_MS) await this.connection.hdel(this.acquiresKey, jobId);
        continue;
      }
      const state = await this.queue.getJobState(jobId);
      if (state === 'completed' || state === 'failed') await this.connection.hdel(this.acquiresKey, jobId);
      if (state !== 'unknown') {
        this.vanishedSince.delete(jobId);
        continue;
      }
      const since = this.vanishedSince.get(jobId);
      if (since === undefined || now - since < graceMs) {
        this.vanishedSince.set(jobId, since ?? now);
        continue;
      }
      this.vanishedSince.delete(jobId);
      const lease = LeaseIdentitySchema.safeParse(JSON.parse(flat[i + 1]!));
      if (!lease.success) {
        await this.connection.hdel(this.acquiresKey, jobId);
        continue;
      }
      // Read again, after the look at its job: the listing may be older than the acquire's end
      // (its release marks it completed, in the step before BullMQ removes the job), and another
      // replica may have queued its clean-up meanwhile (and that may have ended).
      const current = await this.connection.hget(this.acquiresKey, jobId);
      if (current === null || completedAcquireAt(current) !== null) continue;
      // Its job's data (and whether it was for the company's instance) went with it: decided as
      // an enqueue would be now (`holdsInstance`, the worker's registry: instances live under the
      // deployment's prefix, not a partition's; helper-61, helper-62: the clean-up went to a
      // configured provider of the name, its sandbox was left). An instance deleted since counts
      // as none (helper-63: an acquire accepted for the configured provider after the deletion
      // had its clean-up failed provider_deleted); one accepted for it has nothing to clean with.
      await this.enqueueAbandon(lease.data, jobId, null, await holdsInstance(lease.data));
      queued++;
    }
    // Candidates whose entries went (their release came) are not kept for ever.
    if (this.vanishedSince.size > 10_000) this.vanishedSince.clear();
    return queued;
  }

  /**
   * Whether an acquire completed: its recorded outcome, or (once BullMQ removed its job) the
   * mark its release left in the acquires index for COMPLETED_ACQUIRE_KEPT_MS.
   */
  async acquireCompleted(jobId: string): Promise<boolean> {
    if ((await this.outcomeOf(jobId))?.status === 'completed') return true;
    return completedAcquireAt((await this.connection.hget(this.acquiresKey, jobId)) ?? '') !== null;
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

  /**
   * Takes an idempotency key for a new request, or says what an earlier request with it
   * holds: `accepted` (its job joined its lane: the same job), `pending` (it was cut short
   * before that: finish it under its job id), or `new` (this request took the key).
   * The same key with another request is refused.
   */
  private async claimIdempotencyKey(key: string, fingerprint: string, jobId: string): Promise<{ kind: 'new' } | { kind: 'pending' | 'accepted'; jobId: string }> {
    for (;;) {
      if ((await this.connection.set(key, pendingValue(jobId, fingerprint), 'EX', IDEMPOTENCY_TTL_S, 'NX')) === 'OK') return { kind: 'new' };
      const earlier = parseIdempotencyValue(await this.connection.get(key));
      if (!earlier) continue; // it expired (or held junk) in between: take it now
      // A key written before requests were fingerprinted names its job only: taken as the same request.
      if (earlier.fingerprint && earlier.fingerprint !== fingerprint) throw new IdempotencyKeyReusedError(earlier.jobId);
      if (earlier.state === 'refused') throw new QueueFullError(earlier.limit, earlier.count, FULL_RETRY_AFTER_MS);
      return { kind: earlier.state, jobId: earlier.jobId };
    }
  }

  /**
   * The limits a request of this lease is held to (LEASE_OPS_QUEUE_LIMITS overrides the
   * company's). A partition counts only its own lanes, so it holds each limit above one lane
   * to its share (1/LEASE_OPS_PARTITIONS, rounded up): the partitions together stay within it.
   */
  /** The Redis bytes the lease's company may hold in this partition (0: no limit). */
  bytesBudgetFor(lease: LeaseIdentity): number {
    const budget = this.settings.LEASE_OPS_QUEUE_LIMITS[lease.companyId]?.maxBytes ?? this.settings.LEASE_OPS_MAX_BYTES_PER_COMPANY;
    return budget === 0 ? 0 : Math.ceil(budget / this.settings.LEASE_OPS_PARTITIONS);
  }

  limitsFor(lease: LeaseIdentity): QueueLimits {
    const own = this.settings.LEASE_OPS_QUEUE_LIMITS[lease.companyId];
    const share = (limit: number) => (limit === 0 ? 0 : Math.ceil(limit / this.settings.LEASE_OPS_PARTITIONS));
    return {
      perLane: this.settings.LEASE_OPS_MAX_QUEUED_PER_LEASE,
      perEnvironment: share(own?.environments?.[lease.environmentId] ?? own?.maxQueuedPerEnvironment ?? this.settings.LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT),
      perCompany: share(own?.maxQueued ?? this.settings.LEASE_OPS_MAX_QUEUED_PER_COMPANY),
      queued: share(this.settings.LEASE_OPS_MAX_QUEUED),
    };
  }

  /** One key per company, environment and caller's key: JSON keeps `acme:eu`+`k9` and `acme`+`eu:k9` apart. */
  private idempotencyKey(lease: LeaseIdentity, key: string, prefix = this.settings.LEASE_OPS_PREFIX): string {
    const scoped = JSON.stringify([lease.companyId, lease.environmentId, key]);
    return `${prefix}:idem:${createHash('sha256').update(scoped).digest('base64url')}`;
  }

  /**
   * With several partitions, a key's requests may name leases of different partitions, each
   * of which keeps its own keys: the key is first pinned to its request's fingerprint under
   * the deployment's prefix (for as long as keys last), and another request with it is
   * refused there (IdempotencyKeyReusedError). The request itself then goes on as usual in
   * its lease's partition, which answers a repeat with its job. The pin is `pending` until its
   * request is accepted (`settled(true)`: kept its 24 h); refused (`settled(false)`: a full
   * queue, say), a pending pin goes after a moment, as the partition's own key does.
   */
  async pinIdempotencyKey(request: EnqueueRequest, deploymentPrefix: string): Promise<{ settled(accepted: boolean): Promise<void> } | null> {
    if (request.idempotencyKey === undefined) return null;
    const data = buildJobData(request, Date.now(), this.settings.LEASE_OPS_DEADLINES_MS);
    const fingerprint = fingerprintOf(data);
    const key = this.idempotencyKey(data.lease, request.idempotencyKey, deploymentPrefix);
    const pending = `${fingerprint} pending`;
    const held = await this.connection.set(key, pending, 'EX', IDEMPOTENCY_TTL_S, 'NX', 'GET');
    if (held !== null && held.split(' ')[0] !== fingerprint) {
      // The operation the key names, where this partition keeps it (its lease's partition).
      const earlier = parseIdempotencyValue(await this.connection.get(this.idempotencyKey(data.lease, request.idempotencyKey)));
      throw new IdempotencyKeyReusedError(earlier?.jobId ?? '');
    }
    return {
      settled: async (accepted) => {
        if (accepted) await this.connection.set(key, `${fingerprint} accepted`, 'EX', IDEMPOTENCY_TTL_S);
        else await this.replaceIfEqual(key, pending, pending, REFUSAL_KEPT_MS);
      },
    };
  }

  /**
   * The lane a lease's operations run in: its own, or the lane its id is a second name of (a
   * sandbox's id after its acquire). With several partitions, ask through a router that knows
   * them all (LeaseOpsClient.laneOf).
   */
  laneOf(lease: LeaseIdentity): Promise<string> {
    return this.names.resolve(laneIdOf(lease));
  }

  /** The lanes of this queue, spoken to over another connection. */
  lanesOn(connection: RedisClient): Lanes {
    return new Lanes(connection, this.settings.LEASE_OPS_PREFIX, this.queue.toKey(''), this.settings.LEASE_OPS_KEEP_FAILED_S * 1_000, this.settings.LEASE_OPS_PARTITIONS);
  }

  async close(): Promise<void> {
    await this.queue.close();
  }
}

/** A provider as the workers announced it. */
export interface AnnouncedProvider {
  name: string;
  /** Epoch ms a worker last said it serves it. */
  lastSeenAt: number;
  capabilities: ProviderCapabilities | null;
}

const CapabilitiesSchema = z.object({
  stop: z.boolean(),
  pause: z.boolean(),
  forceStop: z.boolean(),
  expiry: z.boolean().optional(),
  resources: z.boolean().optional(),
  archive: z.boolean().optional(),
});

/** A providers-index entry: `{at, capabilities}`, or (from workers before capabilities were said) a bare time. */
function parseAnnouncement(value: string): { lastSeenAt: number; capabilities: ProviderCapabilities | null } {
  if (/^\d+$/.test(value)) return { lastSeenAt: Number(value), capabilities: null };
  try {
    const parsed = z.object({ at: z.number(), capabilities: CapabilitiesSchema }).safeParse(JSON.parse(value));
    if (parsed.success) return { lastSeenAt: parsed.data.at, capabilities: parsed.data.capabilities };
  } catch {
    // not JSON: unknown
  }
  return { lastSeenAt: 0, capabilities: null };
}

/**
 * How long a job waits parked: until its deadline, when a worker takes it and, if it is
 * still waiting in its lane, fails it; at most PARK_MS, after which it is looked at again.
 */
export function parkDelay(data: { deadlineAt: number }, now: number): number {
  return Math.max(1, Math.min(PARK_MS, data.deadlineAt - now + 1));
}

/** What identifies a request for its idempotency key: its lease, operation and parameters (object keys in any order). */
function fingerprintOf(data: OperationJobData): string {
  const canonical = (v: unknown): unknown =>
    v && typeof v === 'object' && !Array.isArray(v)
      ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, canonical((v as Record<string, unknown>)[k])]))
      : Array.isArray(v)
        ? v.map(canonical)
        : v;
  return createHash('sha256').update(JSON.stringify(canonical({ lease: data.lease, op: data.op, params: data.params }))).digest('base64url');
}

function pendingValue(jobId: string, fingerprint: string): string {
  return JSON.stringify({ jobId, fingerprint, state: 'pending' });
}

/**
 * How long a completed acquire stays marked in the acquires index: longer than any clean-up
 * queued for it can wait (its deadline, 30 min by default) before it asks.
 */
const COMPLETED_ACQUIRE_KEPT_MS = 2 * 3_600_000;

/** When an acquires-index entry says its acquire completed, or null (it names a lease). */
function completedAcquireAt(value: string): number | null {
  const m = /^completed (\d+)$/.exec(value);
  return m ? Number(m[1]) : null;
}

type IdempotencyValue =
  | { state: 'pending' | 'accepted'; jobId: string; fingerprint: string }
  | { state: 'refused'; jobId: ''; fingerprint: string; limit: QueueLimit; count: number };

function parseIdempotencyValue(text: string | null): IdempotencyValue | null {
  if (!text) return null;
  try {
    const v = JSON.parse(text) as { jobId?: unknown; fingerprint?: unknown; state?: unknown; limit?: unknown; count?: unknown };
    if (v.state === 'refused' && typeof v.fingerprint === 'string' && typeof v.count === 'number' && isQueueLimit(v.limit)) {
      return { state: 'refused', jobId: '', fingerprint: v.fingerprint, limit: v.limit, count: v.count };
    }
    if (typeof v.jobId === 'string' && typeof v.fingerprint === 'string' && (v.state === 'pending' || v.state === 'accepted')) {
      return { jobId: v.jobId, fingerprint: v.fingerprint, state: v.state };
    }
  } catch {
    // a key from before fingerprints: a bare job id
  }
  return { jobId: text, fingerprint: '', state: 'accepted' };
}

function isQueueLimit(value: unknown): value is QueueLimit {
  return value === 'lease' || value === 'environment' || value === 'company' || value === 'queue';
}

/** A refused request's key, for REFUSAL_KEPT_MS: its retries meanwhile get the same refusal. */
function refusedValue(fingerprint: string, limit: QueueLimit, count: number): string {
  return JSON.stringify({ state: 'refused', fingerprint, limit, count });
}
const REFUSAL_KEPT_MS = 1_000;

let bullmqChecked = false;
/** Producers, workers and the API all write BullMQ's keys through the lanes: each refuses an untested BullMQ. */
function assertTestedBullmqOnce(): void {
  if (bullmqChecked) return;
  assertTestedBullmq();
  bullmqChecked = true;
}

/** The sandbox an operation touches, or null for one that names none yet (an acquire). */
export function targetSandbox(data: OperationJobData): string | null {
  return data.op === 'acquire' || data.op === 'abandon-acquire' ? null : data.params.providerLeaseId;
}

/**
 * A lane serialises one sandbox: an operation's sandbox must be its lease's, named by the
 * lease's id or by the other name of the same lease (its acquire's id, its sandbox's id).
 */
function notTheLeasesSandbox(sandbox: string, leaseId: string, current?: string): z.ZodError {
  return new z.ZodError([
    {
      code: 'custom',
      path: ['params', 'providerLeaseId'],
      message: current
        ? `sandbox ${sandbox} is not the sandbox of lease ${leaseId} any more (its sandbox is ${current}): name the sandbox it has now`
        : `sandbox ${sandbox} is not the sandbox of lease ${leaseId}: name the lease by its sandbox id, or by the id its acquire was enqueued under once that acquire made this sandbox`,
      input: sandbox,
    },
  ]);
}

/** Turns a request into validated job data; throws a ZodError naming every bad field. */
export function buildJobData(
  request: EnqueueRequest,
  now = Date.now(),
  deadlines: Partial<Record<OperationName, number>> = {},
): OperationJobData {
  const op = OperationNameSchema.parse(request.op);
  const params = OperationParamsSchemas[op].parse(request.params);
  const deadlineMs = request.deadlineMs ?? deadlines[op] ?? DEFAULT_DEADLINE_MS[op];
  return OperationJobDataSchema.parse({ op, lease: request.lease, params, acceptedAt: now, deadlineAt: now + deadlineMs, ...(request.companyInstance ? { instance: true } : {}) });
}

/**
 * Enqueues through the partition that holds the lease's lane (`queueOf` maps a lane id to its
 * partition's queue), following a second name of a lane to that lane wherever it is.
 */
export async function enqueueRouted(queueOf: (laneId: string) => OperationsQueue, names: LaneNames, request: EnqueueRequest): Promise<EnqueuedHere> {
  const own = laneIdOf(LeaseIdentitySchema.parse(request.lease));
  for (let hops = 0; ; hops++) {
    const laneId = names.cached(own) ?? own;
    try {
      return await queueOf(laneId).enqueueHere(request, { laneId });
    } catch (err) {
      // Learnt meanwhile (LaneNames.learn): the next try goes to that lane. A name points at its
      // acquire's lane, which has none of its own, so one hop is all there is.
      if (err instanceof LaneRedirect && hops < 2) continue;
      throw err;
    }
  }
}
