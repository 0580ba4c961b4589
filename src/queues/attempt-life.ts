import { DelayedError, UnrecoverableError, type Job } from 'bullmq';
import { z } from 'zod';
import { faultPoint, faultPointArmed } from '../fault-points.ts';
import { laneIdOf, laneIdOfJobId, type LeaseIdentity } from '../lease.ts';
import type { Logger } from '../logger.ts';
import { attemptEnded, settleWaitBegan, settleWaitEnded } from '../metrics.ts';
import { CHECKPOINT_KEY_MAX, CHECKPOINT_VALUE_MAX, OperationJobDataSchema, type OperationJobData } from '../operations.ts';
import { runOperation } from '../processors/index.ts';
import { TerminationReceiptSchema } from '../processors/results.ts';
import { isProviderError, PermanentError, SettlingError, TransientError } from '../providers/errors.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import type { LeaseProvider, OperationContext, SandboxState } from '../providers/types.ts';
import * as telemetry from '../telemetry.ts';
import { isoUtc } from '../time-format.ts';
import { Attempt, type Fencing, StaleAttemptError } from './fencing.ts';
import type { Lanes, LaneOutcome } from './lane.ts';
import { historyEntry, type LeaseHistory } from './lease-history.ts';
import { hasAcquiredSandbox, isStopping, type LaneHold, type LeaseRecord, type LeaseRecords } from './lease-records.ts';
import { parkDelay, targetSandbox, type OperationsQueue } from './operations-queue.ts';
import type { RedisClient } from './redis.ts';
import { type BackoffSettings, decideRetry, DeadlineExceededError, OperationFailedError, RetryLaterError } from './retry-policy.ts';

/** What an attempt needs from its worker replica. */
export interface AttemptDeps {
  ops: OperationsQueue;
  /** The lanes on the BullMQ worker's own connection: a release there lands just ahead of BullMQ's completion. */
  releaseLanes: Lanes;
  fencing: Fencing;
  records: LeaseRecords;
  /** The same records on the releases' connection: an attempt's last observation goes just ahead of its release, in one write. */
  releaseRecords: LeaseRecords;
  /** Each lease's events, for its timeline (written without waiting). */
  history: LeaseHistory;
  providers: ProviderRegistry;
  backoff: BackoffSettings;
  backoffByOp: Partial<Record<string, Partial<BackoffSettings>>>;
  maxStalled: number;
  /** How long the lane waits after a request that may still be running at the cloud (see ProviderError.requestMayBeInFlight). */
  inFlightGraceMs: number;
  /** How long an attempt waits for a settling sandbox's pushed state change before it backs off (0: never). */
  settleWaitMs: number;
  /** The worker's waits now, and how many may wait at once (each holds a worker slot): past it, an attempt backs off. */
  settleWaits: { active: number; readonly max: number };
  /** Aborted when the worker begins to close: an attempt waiting for a state change stops waiting. */
  closing: AbortSignal;
  log: Logger;
  redis: RedisClient;
  checkpointOf(jobId: string): OperationContext['checkpoint'];
  /** Sends this tick's writes on the worker connection together (the release and BullMQ's completion). */
  coalesceWrites(): void;
  /**
   * Where BullMQ's completion refuses an acquire whose release has not recorded its outcome
   * (quiet-fetch.ts), what the worker runs then, registered by the attempt: it settles when
   * the job is to be completed after all, and rejects with how it ends otherwise. Null where
   * the completion is not so rewritten, and an acquire's end waits for its release.
   */
  refusedEnd: ((job: Job, end: () => Promise<void>) => void) | null;
  /** Whether this worker will fetch its next job right after completing this one (not closing, not paused). */
  fetchesNext(): boolean;
  /** Whether a lane belongs to the partition this worker serves, as the deployment's partition count maps it. */
  ownsLane(laneId: string): boolean;
  /** An operation saw a sandbox begin a stopping episode (see Watchdog); both times in Redis' clock. */
  stoppingBegan(laneId: string, since: number, now: number): void;
}

/**
 * Runs of an operation within one attempt, each after a pushed state change: a bound against
 * a gateway that keeps pushing changes that are none (an attempt then reads at most this many
 * times before it backs off, where without pushes it would read once).
 */
const MAX_RUNS_PER_ATTEMPT = 4;

/** A lane step that met a Redis error: the attempt is retried, never failed for it (BullMQ's own steps would fail too). */
class LaneUnavailableError extends RetryLaterError {
  override name = 'LaneUnavailableError';
}

/**
 * One attempt of one operation, from the moment BullMQ hands the job to this worker to
 * the moment the lane hears how it ended:
 *
 *   admit   the lane says whether it is this job's turn (or repeats an outcome it recorded,
 *           or parks the job again, failing it if its deadline passed while it waited);
 *           the job's data, provider, stall count and deadline are checked
 *   run     the provider call, fenced, with what it observes of the sandbox kept
 *   end     completed: the lane is released (handing off the next job) just ahead of
 *           BullMQ's completion; settling or transient: the lane keeps its head and BullMQ
 *           retries after the chosen delay; failed: an acquire's clean-up is queued and the
 *           lane is released with the failure
 *
 * A Redis error in a lane step retries the attempt rather than failing the operation.
 * Named fault points (../fault-points.ts) let the crash tests stop a worker between steps.
 */
export class AttemptLife {
  private readonly jobId: string;
  private readonly startedAt = performance.now();
  /** When the attempt proper began (its provider call), for the history: null before. */
  private ranFrom: number | null = null;
  private logger: Logger | undefined;
  /** This attempt's fencing token, once it has its turn: its writes to the lease's record are fenced with it. */
  private fence = '';
  /** This attempt got as far as its provider call (an acquire's may then have made something). */
  private providerReached = false;
  /** A first start handed off by a release, which does not look for a cancel at its start (see live). */
  private cancelLookSkipped = false;
  /** The read a settle wait kept last (the very tuple `observe` made), and what keeping it gave. */
  private kept: { read: [string, SandboxState]; observed: [string, SandboxState] | null } | null = null;

  constructor(
    private readonly deps: AttemptDeps,
    private readonly job: Job,
    /** The BullMQ lock token this worker holds the job with. */
    private readonly lockToken: string,
  ) {
    this.jobId = job.id ?? '';
  }

  async live(): Promise<unknown> {
    const laneId = laneIdOfJobId(this.jobId);
    if (!laneId) throw new UnrecoverableError(`no_lane: job ${this.jobId} has no lane: only lease-ops' enqueue may add jobs`);
    // A job of the partition count before a change (run again by an operator, say): its lease
    // has its lane in another partition now, and two lanes would run it beside that one.
    if (!this.deps.ownsLane(laneId)) throw new UnrecoverableError(`wrong_partition: the partition count changed since this operation was accepted; its lease belongs to another partition now: enqueue it again`);
    const parsed = OperationJobDataSchema.safeParse(this.job.data);

    let fence = handedOffFence(this.job);
    /** What the release that handed this job off copied from the lease's record (see handOff in includes/lane.lua). */
    const copied = fence === null ? null : recordAtHandOff(this.job);
    if (fence === null) {
      const acquired = await this.laneStep(async () => {
        await faultPoint('lane-acquire', this.deps.redis);
        return this.deps.ops.lanes.acquire(laneId, this.jobId, this.lockToken, parsed.success ? parsed.data.lease.companyId : '');
      });
      switch (acquired.kind) {
        case 'stale':
          throw this.staleStart(parsed.success ? parsed.data.op : 'unknown');
        case 'park':
          return this.park(laneId, parsed.success ? parsed.data : null);
        case 'done':
          // A re-run after a crash between the lane's release and BullMQ's completion.
          if (acquired.outcome.status === 'completed') return acquired.outcome.result;
          throw new UnrecoverableError(acquired.outcome.error);
        case 'gone':
          throw new UnrecoverableError('removed: an operator removed the operation before it started');
        case 'orphan':
          throw new UnrecoverableError('orphaned: the operation never joined its lane (its enqueue was cut short, and no retry with its idempotency key finished it)');
        case 'run':
          fence = acquired.token;
      }
    }
    this.fence = fence;
    await faultPoint('after-lane-acquire');

    if (!parsed.success) return this.fail(laneId, fence, 'unknown', 'invalid_job_data', `invalid job data: ${z.prettifyError(parsed.error)}`);
    const data = parsed.data;
    this.cancelLookSkipped = copied !== null && data.op === 'acquire';
    const log = () => (this.logger ??= this.deps.log.child({ leaseId: data.lease.leaseId, provider: data.lease.provider, jobId: this.jobId, op: data.op, attempt: this.job.attemptsMade + 1 }));

    const resolved = await this.laneStep(() => this.deps.providers.resolve(data.lease, data.instance === true));
    if (!('provider' in resolved)) {
      // Deleted, unreadable or not for this environment: that ends it. Not served here:
      // another replica may serve it (a rolling change of LEASE_OPS_PROVIDERS), so it is
      // retried like a transient error and fails only at its deadline.
      if (resolved.forGood) return this.failForGood(laneId, fence, data, resolved.code, resolved.message, log);
      return this.endFailed(laneId, fence, data, new TransientError(resolved.code, resolved.message), null, log);
    }
    const provider = resolved.provider;
    if (data.op === 'abandon-acquire' && (await this.laneStep(() => this.deps.ops.acquireCompleted(data.params.acquireJobId)))) {
      // The acquire completed after all (a crash came between queueing this and recording
      // its failure, and a re-run succeeded): its sandbox is a lease now, not debris.
      return this.complete(laneId, fence, data, { providerLeaseId: null, state: 'none' }, null, log);
    }
    if (data.op === 'acquire') {
      // Cancelled while an earlier attempt ran (which then died): that is what ends it. A
      // first attempt handed off by a release had none; a cancel that came since is seen
      // at its provider calls' fence, at its release, and before any refusal here
      // (failForGood), so it does not look now.
      // One lease, one sandbox: an acquire that reaches the head of a lease whose acquire
      // handed out a sandbox that lives (accepted before that one ended) makes nothing.
      // Both looks in one round trip, or none: a lane's hand-offs wait on them.
      const [cancelledBy, record] = await this.laneStep(() => Promise.all([this.cancelLookSkipped ? null : this.cancelledBy(), copied ? copied.record : this.deps.records.get(laneId)]));
      if (cancelledBy !== null) return this.failForGood(laneId, fence, data, 'cancelled', `cancelled by ${cancelledBy} while it ran; what it made is destroyed`, log);
      if (record && hasAcquiredSandbox(record)) {
        return this.failForGood(laneId, fence, data, 'lease_has_sandbox', `this lease has sandbox ${record.providerLeaseId} already: destroy it first, or acquire under another id`, log);
      }
    }
    // One lease, one sandbox, checked again at its turn: an operation on a sandbox accepted
    // while that was still the lease's, behind an acquire that has since made another, would
    // act on the old one and point the lease's record back at it (a third acquire would then
    // make a second live sandbox). It does nothing, and says why.
    const sandbox = targetSandbox(data);
    if (sandbox !== null) {
      const current = copied ? copied.providerLeaseId || null : await this.laneStep(() => this.deps.records.currentSandbox(laneId));
      if (current && current !== sandbox) {
        return this.failForGood(laneId, fence, data, 'sandbox_replaced', `sandbox ${sandbox} is not the sandbox of lease ${data.lease.leaseId} any more (its sandbox is ${current}): nothing was done`, log);
      }
    }
    // A clean-up's own deadline bounds it; a stall limit would leave the sandbox behind.
    if (this.job.stalledCounter > this.deps.maxStalled && data.op !== 'abandon-acquire') {
      // Its attempts keep dying with their workers (a poison operation, or a crash loop).
      return this.failForGood(laneId, fence, data, 'stalled_too_often', `its attempts stalled ${this.job.stalledCounter} times (LEASE_OPS_MAX_STALLED=${this.deps.maxStalled}): each one's worker died or froze past its lock`, log);
    }
    if (Date.now() >= data.deadlineAt) {
      // A retry can come due just past the deadline; name the error that caused it.
      const last =
        this.job.attemptsMade > 0 && this.job.failedReason
          ? `last provider error: ${this.job.failedReason}`
          : this.job.stalledCounter > 0
            ? 'the deadline passed before an attempt could end: the worker of an earlier one was lost'
            : 'the deadline passed before the operation could start';
      return this.failForGood(laneId, fence, data, 'deadline_exceeded', last, log);
    }
    return this.run(laneId, fence, data, provider, log);
  }

  /** The provider call, fenced; what it saw of its sandbox is kept either way. */
  private async run(laneId: string, fence: string, data: OperationJobData, provider: LeaseProvider, log: () => Logger): Promise<unknown> {
    const held = new Attempt(this.jobId, laneId, fence, this.lockToken);
    const untrack = this.deps.fencing.track(held);
    let observed: [string, SandboxState] | null = null;
    /** What the current run of the operation read, for a wait on its sandbox. */
    let seen: [string, SandboxState] | null = null;
    const ctx: OperationContext = {
      lease: data.lease,
      jobId: this.jobId,
      attempt: this.job.attemptsMade + 1,
      attemptId: `${this.jobId}:${fence}`,
      get signal() {
        return held.signal;
      },
      deadlineAt: data.deadlineAt,
      // An acquire also stops at its next step once someone cancelled it while it ran.
      fence: data.op === 'acquire' ? () => this.deps.fencing.check(held).then(() => this.refuseIfCancelled()) : () => this.deps.fencing.check(held),
      fenceIsFresh: () => held.fresh(),
      observe: (providerLeaseId, state) => {
        observed = [providerLeaseId, state];
        seen = observed;
      },
      get log() {
        return log();
      },
      checkpoint: this.deps.checkpointOf(this.jobId),
    };
    this.ranFrom = performance.now();
    let result: unknown;
    try {
      await faultPoint('before-provider-call');
      this.providerReached = true;
      // Stale already (its worker closed without waiting while its lane step was out, say):
      // the provider is not called at all, not even to be refused by its first fence.
      if (held.stale) throw held.staleError();
      await this.waitForActivities(laneId, data);
      const spanAttributes = { 'lease.op': data.op, 'lease.provider': data.lease.provider, 'lease.job_id': this.jobId, 'lease.attempt': ctx.attempt };
      // A clean-up leaves alone the lease's live sandbox that another acquire handed out: a
      // provider that finds by the lease's own id would find that one (helper-22).
      let spare: string | null = null;
      if (data.op === 'abandon-acquire') {
        const live = await this.laneStep(() => this.deps.records.acquiredLive(laneId));
        if (live && live.by !== data.params.acquireJobId) spare = live.sandbox;
      }
      const runOnce = () =>
        data.op === 'force-stop' ? telemetry.forceStopSpan(spanAttributes, () => runOperation(provider, ctx, data)) : runOperation(provider, ctx, data, spare);
      result = await telemetry.processSpan(this.deps.ops.queue.name, this.jobId, spanAttributes, async () => {
        const waitUntil = Math.min(data.deadlineAt, Date.now() + this.deps.settleWaitMs);
        for (let runs = 1; ; runs++) {
          const since = performance.now();
          seen = null;
          try {
            return await runOnce();
          } catch (err) {
            if (runs >= MAX_RUNS_PER_ATTEMPT || !(await this.waitedForChange(err, seen, provider, ctx, laneId, data, since, waitUntil, log))) throw err;
          }
        }
      });
      if (data.op === 'force-stop') telemetry.forceStop('succeeded', { 'lease.provider': data.lease.provider });
      await faultPoint('after-provider-call');
    } catch (err) {
      untrack();
      if (err instanceof StaleAttemptError || held.stale) {
        // Not this attempt's lane any more: touch nothing, let the current attempt finish.
        if (held.abandoned) log().warn('the worker closed without waiting for this attempt: it stops, its end is not recorded, and it runs again elsewhere');
        else log().warn({ err }, 'stale attempt refused a provider call');
        attemptEnded(data.op, 'stale', this.seconds());
        throw staleEnd(held.staleError(), this.deps.backoff.baseMs);
      }
      return this.endFailed(laneId, fence, data, err, observed, log);
    }
    untrack();
    if (held.abandoned) {
      // Its worker closed without it (and disconnected): nothing of it is written.
      log().warn('the worker closed while this attempt ran: its result is not recorded, and it runs again elsewhere');
      throw staleEnd(held.staleError(), this.deps.backoff.baseMs);
    }
    return this.complete(laneId, fence, data, result, ENDS_IN_RECEIPT.has(data.op) ? withReceipt(observed, result) : observed, log);
  }

  /**
   * A settling error from a provider that can push state changes: the attempt keeps its lane
   * and waits (bounded by LEASE_OPS_SETTLE_WAIT_MS and the deadline, stopped by a lost lock or
   * the worker closing) for the sandbox's next state, then runs the operation again at once,
   * fenced as every run is. What it read is recorded first, as a backoff would, so the
   * watchdog and every view see the sandbox's state while it waits. False: back off as usual.
   */
  private async waitedForChange(
    err: unknown,
    seen: [string, SandboxState] | null,
    provider: LeaseProvider,
    ctx: OperationContext,
    laneId: string,
    data: OperationJobData,
    since: number,
    waitUntil: number,
    log: () => Logger,
  ): Promise<boolean> {
    if (!provider.waitForChange || !seen || !isProviderError(err) || err.kind !== 'settling' || err.requestMayBeInFlight) return false;
    // Only a transition ends with a push: a 409 on a sandbox at rest (its state change not
    // begun, or not visible yet) is waited out by backing off.
    if (seen[1].kind !== 'transitioning') return false;
    const timeoutMs = waitUntil - Date.now();
    if (timeoutMs <= 0 || ctx.signal.aborted || this.deps.closing.aborted) return false;
    // Waits hold worker slots: past their share, an attempt backs off and leaves its slot to other leases' work.
    const waits = this.deps.settleWaits;
    if (waits.active >= waits.max) return false;
    waits.active++;
    try {
      return await this.waitForPush(provider.waitForChange.bind(provider), { ctx, seen, laneId, data, since, waitUntil, log });
    } finally {
      waits.active--;
    }
  }

  /** The wait itself, in its slot: what was read is kept first, then the provider is asked. */
  private async waitForPush(
    waitForChange: NonNullable<LeaseProvider['waitForChange']>,
    w: { ctx: OperationContext; seen: [string, SandboxState]; laneId: string; data: OperationJobData; since: number; waitUntil: number; log: () => Logger },
  ): Promise<boolean> {
    const { ctx, seen, laneId, data, since, waitUntil, log } = w;
    await this.keepObserved(laneId, data, seen, log);
    // A crash test stops the worker here: the lane held, the sandbox read, the wait not begun.
    await faultPoint('settle-wait');
    const started = performance.now();
    // One controller per wait, unhooked after it: a listener left on the worker's long-lived
    // close signal per wait would pile up.
    const stop = new AbortController();
    const abort = () => stop.abort();
    const sources = [ctx.signal, this.deps.closing];
    for (const source of sources) source.addEventListener('abort', abort, { once: true });
    if (sources.some((source) => source.aborted)) stop.abort();
    const signal = stop.signal;
    settleWaitBegan();
    const outcome = await waitForChange(ctx, seen[0], seen[1], { since, timeoutMs: Math.max(0, waitUntil - Date.now()), signal })
      .catch((waitErr: unknown) => {
        log().warn({ err: waitErr }, 'waiting for a pushed state change failed: backing off instead');
        return 'unchanged' as const;
      })
      .finally(() => {
        for (const source of sources) source.removeEventListener('abort', abort);
      });
    const changed = outcome === 'changed';
    settleWaitEnded(data.op, outcome === 'cannot_push' ? outcome : changed ? 'changed' : signal.aborted ? 'stopped' : 'timed_out');
    if (outcome === 'cannot_push') return false;
    log().debug({ waitedMs: Math.round(performance.now() - started), changed, state: seen[1] }, 'waited for the sandbox to settle');
    return changed && !ctx.signal.aborted;
  }

  /** What the attempt read of its lease's sandbox is kept (an acquire names its lease by the sandbox first). */
  private async keepObserved(laneId: string, data: OperationJobData, attemptSaw: [string, SandboxState] | null, log: () => Logger): Promise<[string, SandboxState] | null> {
    // A wait that ended without a run after it kept this same read already: not written twice.
    if (attemptSaw && this.kept?.read === attemptSaw) return this.kept.observed;
    const observed = await this.theLeases(laneId, data, attemptSaw);
    // An acquire that learnt its sandbox's id names the lease by it before anything shows it.
    if (observed && observed[0] !== data.lease.leaseId) await this.nameSandbox(laneId, data.lease, observed[0], log, false);
    await this.record(laneId, data, observed, log);
    if (attemptSaw) this.kept = { read: attemptSaw, observed };
    return observed;
  }

  /**
   * Completed: the observation is recorded, then the release (which hands off the next job)
   * is queued on the worker's connection just ahead of BullMQ's completion, so the next job
   * of the lane starts one round trip sooner. A stale release (superseded meanwhile) changes
   * nothing, and BullMQ refuses to complete the job too: the superseding start took its lock.
   */
  private async complete(laneId: string, fence: string, data: OperationJobData, result: unknown, attemptSaw: [string, SandboxState] | null, log: () => Logger): Promise<unknown> {
    const observed = await this.theLeases(laneId, data, attemptSaw);
    const sandbox = data.op === 'acquire' ? (result as { providerLeaseId?: unknown } | null)?.providerLeaseId : undefined;
    if (data.op === 'acquire') {
      // Cancelled while it ran, and it made its sandbox anyway: the clean-up destroys it, and
      // the sandbox is not named first. With nothing to name, the release's own look (below)
      // is enough, and a lane's hand-off waits on one round trip less.
      if (typeof sandbox === 'string' && sandbox !== data.lease.leaseId) {
        const cancelledBy = await this.laneStep(() => this.cancelledBy());
        if (cancelledBy !== null) return this.failForGood(laneId, fence, data, 'cancelled', `cancelled by ${cancelledBy} while it ran; what it made is destroyed`, log);
        await this.nameSandbox(laneId, data.lease, sandbox, log, true);
      }
    } else if (observed && observed[0] !== data.lease.leaseId) {
      // Named by its other id (an operation by the run id): the sandbox's name is renewed.
      await this.nameSandbox(laneId, data.lease, observed[0], log, false);
    }
    this.deps.coalesceWrites();
    attemptEnded(data.op, 'completed', this.seconds());
    // Sent on the releases' connection just ahead of the release (Redis runs one connection's
    // commands in order), not awaited first: the record is written before the lane moves on
    // (the release copies it for the next job), in the same round trip.
    // It never rejects (record says what failed), so nothing waits for it.
    void this.record(laneId, data, observed, log, this.deps.releaseRecords);
    const entry = this.historyEntry({ kind: 'completed', jobId: this.jobId, op: data.op, attempt: this.job.attemptsMade + 1 });
    if (data.op === 'acquire') await faultPoint('before-acquire-release');
    // A sandbox with the lease's own id was not named (nothing to name): the release notes it.
    const ownIdSandbox = sandbox === data.lease.leaseId ? sandbox : '';
    const releasing = this.deps.releaseLanes.release(laneId, this.jobId, fence, { status: 'completed', result }, this.deps.fetchesNext(), data.op === 'acquire', entry, data.lease.companyId, ownIdSandbox);
    if (data.op === 'acquire') {
      // Cancelled after the look above and before this release: the release refused to record
      // a completion, and the acquire fails with its sandbox cleaned up, as the cancel said.
      const failCancelled = async (): Promise<never> => {
        const by = (await this.laneStep(() => this.cancelledBy())) ?? 'someone';
        return this.failForGood(laneId, fence, data, 'cancelled', `cancelled by ${by} while it ran; what it made is destroyed`, log);
      };
      if (this.deps.refusedEnd) {
        // BullMQ's completion, sent right behind the release, refuses in that same case (and
        // where the release ran after it); the worker then runs this. A stale attempt's release
        // refuses too (its lock passed on), and it ends as a stale attempt does, unless a run of
        // that release did end the job (it ran twice: sent again after its reply was lost).
        this.deps.refusedEnd(this.job, async () => {
          await faultPoint('refused-end');
          const ended = await this.laneStep(() => releasing);
          if (ended.kind === 'cancelled') return failCancelled();
          if (ended.kind === 'stale' && !(await this.laneStep(() => this.deps.releaseLanes.releasedCompleted(this.jobId, this.job.attemptsMade)))) {
            log().warn('attempt was superseded while it ran (or Redis lost its data); its result is discarded');
            throw staleEnd(new StaleAttemptError(`attempt of ${this.jobId} is stale: its release was refused`), this.deps.backoff.baseMs);
          }
        });
      } else if ((await this.laneStep(() => releasing)).kind === 'cancelled') {
        return failCancelled();
      }
    }
    // An acquire whose completion was refused says it where it is decided (above): its release
    // may have answered stale only because it ran twice, and then the acquire completes.
    const staleSaidAbove = data.op === 'acquire' && this.deps.refusedEnd !== null;
    const released = releasing.then(
      (r) => {
        if (r.kind === 'stale' && !staleSaidAbove) log().warn('attempt was superseded while it ran (or Redis lost its data); its result is discarded');
      },
      (err: unknown) => log().error({ err }, 'lane release failed; the lane sweep will repair the lane'),
    );
    // A crash test stops the worker here: released, and BullMQ not yet told.
    if (faultPointArmed('after-release')) {
      await released;
      await faultPoint('after-release');
    }
    return result;
  }

  /**
   * Activity gates: a stop, release or destroy does not touch the sandbox while work in it is
   * open (asking it to cancel first with cancelActiveWork), and a resume not while work of
   * the episode the last stop ended is; it waits as for a settling sandbox, in its lane and
   * within its deadline, and its timeline says for what.
   */
  private async waitForActivities(laneId: string, data: OperationJobData): Promise<void> {
    const mode = gateModeOf(data);
    if (!mode) return;
    const cancel = 'cancelActiveWork' in data.params && data.params.cancelActiveWork === true;
    const gate = await this.laneStep(() => this.deps.ops.activities.gate(laneId, mode, cancel));
    // A force-stop kills what runs: it waits for nothing, but what was open belongs to the episode it ends.
    if (gate.waiting === 0 || data.op === 'force-stop') return;
    const what = `${gate.waiting} ${gate.waiting === 1 ? 'activity' : 'activities'} in the sandbox (${gate.kinds.join(', ')}${gate.waiting > gate.kinds.length ? ', ...' : ''}; the oldest open ${Math.round((gate.now - gate.oldestSince) / 100) / 10} s)`;
    throw new SettlingError('activities_open', mode === 'close' ? `waiting for ${what} to end${cancel ? ': asked to cancel' : ''}` : `waiting for ${what} of the stopped episode to end`);
  }

  /** Who cancelled this (executing) acquire, or null (OperatorActions.cancel marks the job). */
  private async cancelledBy(): Promise<string | null> {
    return this.deps.redis.hget(this.deps.ops.queue.toKey(this.jobId), 'lo:cancel');
  }

  private async refuseIfCancelled(): Promise<void> {
    const by = await this.cancelledBy();
    if (by !== null) throw new PermanentError('cancelled', `cancelled by ${by} while it ran`);
  }

  /**
   * A lease's sandbox id is a second name of its lane (lane-alias.lua): named by the acquire's
   * attempt as soon as it learns the id (its result, or what it observed while the sandbox was
   * still being made), before anything it writes can show the id to anyone; and renewed by any
   * later operation of the lane that names the lease by its other id. An id that has a lane of
   * its own already (someone named the sandbox before its acquire learnt it) keeps it, and the
   * acquire's end says so. `acquired`: the acquire completed with this sandbox.
   */
  private async nameSandbox(laneId: string, lease: LeaseIdentity, sandbox: string, log: () => Logger, acquired: boolean): Promise<void> {
    if (sandbox === lease.leaseId) return;
    const named = await this.laneStep(() => this.deps.ops.names.name(laneIdOf({ ...lease, leaseId: sandbox }), laneId));
    if (acquired && (named === 'new' || named === 'named')) {
      const noted = await this.laneStep(() => this.deps.records.noteAcquired(laneId, lease.leaseId, sandbox, this.hold(laneId), this.jobId));
      // Fenced: the attempt that holds the lane now (a re-run of this acquire) notes its own.
      if (!noted) log().warn({ sandbox }, 'attempt no longer holds its lane (superseded, or Redis lost its data): the sandbox it acquired is not noted as the lease\'s');
    }
    if (named === 'new') {
      this.deps.history.append(laneId, { kind: 'named', jobId: this.jobId, op: 'acquire', sandbox, message: `sandbox ${sandbox} names this lease from now on` });
      return;
    }
    if (named === 'named' || !acquired) return;
    const why = named === 'busy' ? 'it has a lane of its own with work in it' : 'it names another lease already';
    log().warn({ sandbox }, `the acquired sandbox does not name this lease: ${why}; its operations run in the sandbox's own lane`);
    this.deps.history.append(laneId, { kind: 'named', jobId: this.jobId, op: 'acquire', sandbox, message: `sandbox ${sandbox} keeps a lane of its own: ${why}` });
  }

  /** The provider call failed: retry it after a delay, keeping the lane's head, or fail it for good. */
  private async endFailed(laneId: string, fence: string, data: OperationJobData, err: unknown, attemptSaw: [string, SandboxState] | null, log: () => Logger): Promise<never> {
    const observed = await this.keepObserved(laneId, data, attemptSaw, log);
    const decision = decideRetry(err, this.job.attemptsMade, data.deadlineAt, Date.now(), {
      ...this.deps.backoff,
      ...this.deps.backoffByOp[data.op],
    });
    if (isProviderError(err) && err.requestMayBeInFlight && this.deps.inFlightGraceMs > 0) {
      // The cloud may still be running the request that timed out or was cut: this attempt
      // keeps the lane (and its lock) a while, so the next call to the sandbox, this
      // operation's retry or the next operation, does not overlap it.
      log().info({ err, graceMs: this.deps.inFlightGraceMs }, 'a request may still be running at the cloud; holding the lane before the next call');
      await new Promise((resolve) => setTimeout(resolve, this.deps.inFlightGraceMs));
    }
    if (data.op === 'force-stop' && isProviderError(err) && err.code === 'state_change_in_progress') {
      telemetry.forceStop('refused', { 'lease.provider': data.lease.provider });
    }
    if (decision.retry) {
      if (isProviderError(err) && err.kind === 'settling') {
        const seen = observed as [string, SandboxState] | null;
        telemetry.waitTransition({
          'lease.op': data.op,
          'lease.provider': data.lease.provider,
          'lease.state': seen ? seen[1].kind : 'unknown',
          'lease.provider_state': seen && 'providerState' in seen[1] ? seen[1].providerState : (seen?.[1].kind ?? 'unknown'),
        });
      }
      log().info({ err, delayMs: decision.delayMs }, 'operation will be retried');
      const entry = this.historyEntry({
        kind: 'backing-off',
        jobId: this.jobId,
        op: data.op,
        attempt: this.job.attemptsMade + 1,
        until: Date.now() + decision.delayMs,
        code: errorCode(err),
        message: messageOf(err),
      });
      // A failed yield leaves this job the holder: its next attempt takes the lane again.
      await (async () => {
        await faultPoint('lane-yield', this.deps.redis);
        await this.deps.ops.lanes.yield(laneId, this.jobId, fence, Date.now() + decision.delayMs, entry);
      })().catch((yieldErr: unknown) => log().warn({ err: yieldErr }, 'could not yield the lane before a retry'));
      // A crash test stops the worker here: the lane yielded, BullMQ still holds the job active.
      await faultPoint('after-lane-yield');
      attemptEnded(data.op, 'retry', this.seconds(), isProviderError(err) ? err.kind : 'unexpected');
      throw new RetryLaterError(decision.delayMs, err);
    }
    const message = messageOf(err);
    log().warn({ err, reason: decision.reason }, 'operation failed');
    // No replica served its provider before its deadline: that, not the deadline, is the news.
    if (decision.reason === 'deadline' && errorCode(err) !== 'unknown_provider') {
      // This attempt sent nothing (the deadline passed while it waited to send): the news is
      // what the provider said last, which the previous attempt's failure kept, if one did.
      if (errorCode(err) === 'deadline_passed' && !this.job.failedReason) {
        const why = this.job.stalledCounter > 0 ? 'the deadline passed before an attempt could end: the worker of an earlier one was lost' : `the deadline passed while a request waited to be sent (${message})`;
        return this.failForGood(laneId, fence, data, 'deadline_exceeded', why, log);
      }
      const last = errorCode(err) === 'deadline_passed' ? this.job.failedReason : message;
      return this.failForGood(laneId, fence, data, 'deadline_exceeded', `last provider error: ${last}`, log);
    }
    return this.failForGood(laneId, fence, data, errorCode(err), message, log);
  }

  /**
   * Fails an operation for good; an acquire's clean-up is queued first (never a failure
   * recorded without it), and only by the attempt that still holds the lane: a stale one
   * (frozen past its lock while a successor re-ran the acquire) must not clean up after an
   * acquire that may have handed its sandbox out.
   */
  private async failForGood(laneId: string, fence: string, data: OperationJobData, code: string, message: string, log: () => Logger): Promise<never> {
    if (data.op === 'acquire' && this.cancelLookSkipped && code !== 'cancelled') {
      // A cancel taken before this start, which did not look for one: it is what ends it.
      this.cancelLookSkipped = false;
      const by = await this.laneStep(() => this.cancelledBy());
      if (by !== null) return this.failForGood(laneId, fence, data, 'cancelled', `cancelled by ${by} while it ran; what it made is destroyed`, log);
    }
    if (data.op === 'acquire') {
      const held = new Attempt(this.jobId, laneId, fence, this.lockToken);
      const stale = await this.laneStep(() => this.deps.fencing.check(held).then(() => null, (err: unknown) => (err instanceof StaleAttemptError ? err : Promise.reject(err))));
      if (stale) {
        log().warn({ err: stale }, 'stale attempt: the acquire is not failed, nor cleaned up after, by it');
        attemptEnded(data.op, 'stale', this.seconds());
        throw staleEnd(stale, this.deps.backoff.baseMs);
      }
      // Refused before any attempt of it reached its provider (its first, no stall): it made
      // nothing, and a clean-up would only look for what it made. A provider that finds by
      // the lease's own id would find the lease's live sandbox there and destroy it.
      const madeNothing = !this.providerReached && this.job.attemptsMade === 0 && this.job.stalledCounter === 0;
      if (!madeNothing) await this.abandon(data, log);
    }
    return this.fail(laneId, fence, data.op, code, message);
  }

  /** Records a final failure in the lane (which hands off the next job) and fails this job for good. */
  private async fail(laneId: string, fence: string, op: string, code: string, message: string): Promise<never> {
    attemptEnded(op, 'failed', this.seconds());
    const err = code === 'deadline_exceeded' ? new DeadlineExceededError(message) : new OperationFailedError(code, message);
    if (code === 'deadline_exceeded') telemetry.deadlineFailure({ 'lease.op': op });
    const entry = this.historyEntry({ kind: 'failed', jobId: this.jobId, op, attempt: this.job.attemptsMade + 1, code, message: err.message });
    const company = (this.job.data as { lease?: { companyId?: unknown } } | null)?.lease?.companyId;
    await this.laneStep(() => this.deps.releaseLanes.release(laneId, this.jobId, fence, { status: 'failed', code, error: err.message }, this.deps.fetchesNext(), false, entry, typeof company === 'string' ? company : ''));
    throw err;
  }

  /**
   * Not this job's turn (promoted by hand, or a force-stop went ahead of its backoff): back
   * to waiting, until its deadline at most. The lane may have reached it meanwhile, so the
   * lane's repair step hands it off if it is now the head. Past its deadline, it leaves its
   * lane and fails: a caller waiting on it hears at its deadline, not when it reaches the head.
   */
  private async park(laneId: string, data: OperationJobData | null): Promise<never> {
    await faultPoint('before-park');
    const now = Date.now();
    if (data && now >= data.deadlineAt) {
      // An acquire that already tried (then a force-stop went ahead of its backoff) may have
      // made a sandbox: its clean-up is queued before it leaves the lane, as for any failure.
      // Only while this worker still holds the job: a stale attempt leaves that to the current one.
      if (data.op === 'acquire' && this.job.attemptsMade > 0 && (await this.laneStep(() => this.deps.fencing.holdsLock(this.jobId, this.lockToken)))) {
        await this.abandon(data, () => this.deps.log.child({ jobId: this.jobId, op: data.op }));
      }
      // In a paused lane, the pause is why it never ran: say so, and who paused it.
      const paused = await this.laneStep(() => this.deps.ops.lanes.pausedBy(laneId));
      const why = `the deadline passed while it waited in its lane${paused ? ` (paused by ${paused.by} since ${isoUtc(paused.since)})` : ''}`;
      const outcome: LaneOutcome = { status: 'failed', code: 'deadline_exceeded', error: `deadline_exceeded: ${why}` };
      const dropped = await this.laneStep(() => this.deps.ops.lanes.drop(laneId, this.jobId, outcome, false, this.lockToken, data.lease.companyId));
      if (dropped.kind === 'stale') throw this.staleStart(data.op);
      if (dropped.kind !== 'executing') {
        telemetry.deadlineFailure({ 'lease.op': data.op });
        this.deps.history.append(laneId, { kind: 'failed', jobId: this.jobId, op: data.op, code: 'deadline_exceeded', message: why });
        attemptEnded(data.op, 'failed', this.seconds());
        throw new DeadlineExceededError(why);
      }
    }
    await this.laneStep(async () => {
      await faultPoint('lane-park', this.deps.redis);
      await this.job.moveToDelayed(now + (data ? parkDelay(data, now) : 60_000), this.lockToken);
      await faultPoint('after-park-move');
      await this.deps.ops.lanes.repair(laneId, this.jobId);
    });
    throw new DelayedError();
  }

  /**
   * An acquire failed for good: its clean-up (find what its attempts made, destroy it) is
   * queued as an operation of its own in the acquire's lane, where it is retried through a
   * cloud outage or a sandbox still creating, within its own deadline. If even queueing it
   * fails (Redis away), the acquire is retried instead of failed, so that its next attempt
   * queues it again.
   */
  private async abandon(data: OperationJobData & { op: 'acquire' }, log: () => Logger): Promise<void> {
    try {
      const { kept: checkpoint, dropped } = cleanUpCheckpoint(await this.deps.checkpointOf(this.jobId).read());
      // A provider's checkpoint is not validated as it writes it: what the clean-up cannot
      // carry is left out (it still finds a sandbox named after the job), never a clean-up
      // refused and the acquire retried for ever.
      if (dropped.length) log().warn({ dropped }, 'checkpoint entries the clean-up cannot carry (keys up to 128 characters, string values up to 256) are left out');
      const { jobId: cleanUp } = await this.deps.ops.enqueueAbandon(data.lease, this.jobId, checkpoint, data.instance === true);
      log().warn({ cleanUpJobId: cleanUp }, 'acquire failed for good; the clean-up of what it made is queued');
    } catch (err) {
      log().error({ err }, 'could not queue the clean-up of a failed acquire; the acquire will be retried');
      throw new LaneUnavailableError(this.deps.backoff.capMs, err);
    }
  }

  /** Keeps what the attempt last saw of its sandbox (before the lane moves on, so in order). */
  /**
   * What an attempt saw, if it is of the lease's sandbox. A clean-up of an acquire that a later
   * acquire of the lease has followed (its job removed, its clean-up queued late) sees the
   * sandbox that acquire left, not the lease's: recorded, or made a name of the lane, it would
   * point the lease back at it, lock the lease out of its real sandbox and let a third acquire
   * make a second live one.
   */
  private async theLeases(laneId: string, data: OperationJobData, observed: [string, SandboxState] | null): Promise<[string, SandboxState] | null> {
    if (data.op !== 'abandon-acquire' || !observed) return observed;
    const record = await this.laneStep(() => this.deps.records.get(laneId));
    return record?.acquiredSandbox && record.acquiredSandbox !== observed[0] ? null : observed;
  }

  private async record(laneId: string, data: OperationJobData, observed: [string, SandboxState] | null, log: () => Logger, records = this.deps.records): Promise<void> {
    if (!observed) return;
    try {
      const kept = await records.observe(laneId, data.lease, observed[0], observed[1], this.jobId, this.hold(laneId), data.instance === true);
      if (!kept) {
        log().warn('attempt no longer holds its lane (superseded, or Redis lost its data): what it saw is not recorded');
        return;
      }
      if (kept.began && isStopping(observed[1])) this.deps.stoppingBegan(laneId, kept.since, kept.now);
    } catch (err) {
      log().warn({ err }, 'could not record the observed sandbox state');
    }
  }

  /** This attempt's hold on its lane, which fences its writes to the lease's record. */
  private hold(laneId: string): LaneHold {
    return { holderKey: this.deps.ops.lanes.execKey(laneId), token: this.fence };
  }

  /** Runs a lane step; a Redis error (not a decision) retries the attempt after a backoff. */
  private async laneStep<T>(step: () => Promise<T>): Promise<T> {
    try {
      return await step();
    } catch (err) {
      if (err instanceof DelayedError || err instanceof UnrecoverableError || err instanceof RetryLaterError) throw err;
      this.deps.log.warn({ err, jobId: this.jobId }, 'a lane step failed; the attempt will be retried');
      throw new LaneUnavailableError(Math.min(this.deps.backoff.capMs, this.deps.backoff.baseMs * 2 ** Math.min(10, this.job.attemptsMade)), err);
    }
  }

  /** The history entry of this attempt's end: with how long it ran, if it got as far as its provider call. */
  private historyEntry(event: Parameters<typeof historyEntry>[0]): string {
    return historyEntry(this.ranFrom === null ? event : { ...event, ran: performance.now() - this.ranFrom });
  }

  /**
   * A lane step refused this attempt: its worker froze after BullMQ handed it the job, past
   * the job's lock, so another worker may run the job (or will, once BullMQ sees it stalled).
   * It changes nothing and ends as a stale attempt does.
   */
  private staleStart(op = 'unknown'): RetryLaterError {
    this.deps.log.warn({ jobId: this.jobId }, 'attempt started after its lock lapsed; it changes nothing, and the job runs in its next start');
    attemptEnded(op, 'stale', this.seconds());
    return staleEnd(new StaleAttemptError(`attempt of ${this.jobId} is stale: it no longer holds the job's lock`), this.deps.backoff.baseMs);
  }

  private seconds(): number {
    return (performance.now() - this.startedAt) / 1000;
  }
}

/**
 * How a stale attempt ends: as a retry, never a failure. If its BullMQ lock is gone (a
 * successor runs the job), BullMQ refuses the retry and nothing changes; if BullMQ still
 * counts it the job's runner (only the lane's token moved on), a plain error would fail the
 * operation with no code (seen 3 times in 9,392 in a chaos run), while a retry asks the lane
 * again, which repeats a recorded outcome or runs the operation.
 */
function staleEnd(stale: StaleAttemptError, delayMs: number): RetryLaterError {
  return new RetryLaterError(delayMs, stale);
}

/**
 * The fencing token a lane hand-off left in the job's progress field. Trusted only on the
 * job's first start: any later start (a retry, a re-run after a stall, a start after
 * parking) asks the lane for a fresh token, so no two attempts ever share one.
 */
function handedOffFence(job: Job): string | null {
  if (job.attemptsStarted !== 1 || job.attemptsMade !== 0) return null;
  const progress = job.progress as unknown;
  if (progress && typeof progress === 'object' && 'fence' in progress && typeof progress.fence === 'string') return progress.fence;
  return null;
}

/** The entries of an acquire's checkpoint its clean-up can carry (AbandonAcquireParamsSchema), and the keys of the rest. */
export function cleanUpCheckpoint(checkpoint: Record<string, unknown>): { kept: Record<string, string>; dropped: string[] } {
  const kept: Record<string, string> = {};
  const dropped: string[] = [];
  for (const [key, value] of Object.entries(checkpoint)) {
    if (key.length <= CHECKPOINT_KEY_MAX && typeof value === 'string' && value.length <= CHECKPOINT_VALUE_MAX) kept[key] = value;
    else dropped.push(key.slice(0, CHECKPOINT_KEY_MAX));
  }
  return { kept, dropped };
}

/**
 * The operations whose result can be a termination receipt (a release that kept its sandbox
 * running returns null; a clean-up that found nothing, `state: 'none'`): acquires and resumes
 * never, so their hot path parses nothing more.
 */
const ENDS_IN_RECEIPT: ReadonlySet<OperationJobData['op']> = new Set(['stop', 'force-stop', 'destroy', 'release', 'abandon-acquire']);

/**
 * What an attempt saw, with its termination receipt as the last word: a provider that says it
 * stopped or destroyed the sandbox (TerminationReceiptSchema) has seen it so, whether or not
 * it read it again. Without this, a destroy that did not read again left the record saying
 * `running`, and the lease's next acquire was refused (helper-21). A receipt for another
 * sandbox than the one seen changes nothing.
 */
export function withReceipt(observed: [string, SandboxState] | null, result: unknown): [string, SandboxState] | null {
  const receipt = TerminationReceiptSchema.safeParse(result);
  if (!receipt.success || (observed && observed[0] !== receipt.data.providerLeaseId)) return observed;
  const id = receipt.data.providerLeaseId;
  if (receipt.data.state === 'destroyed') return observed?.[1].kind === 'gone' ? observed : [id, { kind: 'gone' }];
  return observed?.[1].kind === 'stopped' || observed?.[1].kind === 'gone' ? observed : [id, { kind: 'stopped', providerState: 'stopped' }];
}

/** What an attempt's start looks at in the lease's record. */
type RecordAtStart = Pick<LeaseRecord, 'providerLeaseId' | 'acquiredSandbox' | 'kind'>;

const RecordCopySchema = z.object({ sandbox: z.string(), acquired: z.string(), kind: z.string(), present: z.boolean() });

/**
 * The record's fields the release that handed this job off copied into its progress, for
 * its first start only (as the fence: handedOffFence); null when there is no copy (another
 * kind of hand-off), and the attempt reads the record. `providerLeaseId` is '' when the
 * record names no sandbox; a record without a lease or kind is none, as LeaseRecords.get says.
 */
function recordAtHandOff(job: Job): { providerLeaseId: string; record: RecordAtStart | null } | null {
  const progress = job.progress as unknown;
  if (!progress || typeof progress !== 'object' || !('record' in progress)) return null;
  const copy = RecordCopySchema.safeParse(progress.record);
  if (!copy.success) return null;
  const { sandbox, acquired, kind, present } = copy.data;
  return { providerLeaseId: sandbox, record: present ? { providerLeaseId: sandbox, acquiredSandbox: acquired || null, kind: kind as SandboxState['kind'] } : null };
}

/** A provider's message, for people: bounded, as it is kept with the job and shown to callers. */
export function messageOf(err: unknown): string {
  const text = err instanceof Error ? err.message : String(err);
  return text.length > MESSAGE_MAX ? `${text.slice(0, MESSAGE_MAX)}...` : text;
}
const MESSAGE_MAX = 1_000;

/**
 * The error's code as callers, the history and the lane's record see it: a provider's code
 * is an identifier, so anything else in it goes, and it is at most 100 characters.
 */
function errorCode(err: unknown): string {
  if (err && typeof err === 'object' && 'code' in err && typeof err.code === 'string') {
    const code = err.code.replace(/[^\w.:-]+/g, '_').slice(0, 100);
    if (code) return code;
  }
  return 'provider_error';
}

/** Which activity gate an operation passes (see Activities): none for a keep_running release, an acquire or a clean-up. */
function gateModeOf(data: OperationJobData): 'close' | 'resume' | null {
  switch (data.op) {
    case 'stop':
    case 'force-stop':
    case 'destroy':
      return 'close';
    case 'release':
      return data.params.resourceDisposition === 'keep_running' ? null : 'close';
    case 'resume':
      return 'resume';
    default:
      return null;
  }
}
