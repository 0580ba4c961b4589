import { Job, type Queue } from 'bullmq';
import { laneIdOfJobId, type LeaseIdentity } from '../lease.ts';
import { OperationJobDataSchema, type OperationName } from '../operations.ts';
import { parseFailures, parsePause, pausedLease } from './lane.ts';
import { HISTORY_CAPACITY, type HistoryEvent, placeStart } from './lease-history.ts';
import type { LeaseRecord, LeaseRecords } from './lease-records.ts';
import type { OperationsQueue } from './operations-queue.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import { withoutInfrastructure } from '../secrets.ts';

/**
 * Where an operation is:
 *   queued       in its lease's lane, waiting for the operations ahead of it
 *   ready        its turn came; waiting for a worker to pick it up
 *   running      a worker is executing it
 *   backing-off  it hit a settling or transient error and retries at `retryAt`
 *   paused       waiting in a lane an operator paused (`paused` says who, since when)
 *   completed / failed   it ended (kept for LEASE_OPS_KEEP_COMPLETED_S / _FAILED_S)
 */
export type OperationState = 'queued' | 'ready' | 'running' | 'backing-off' | 'paused' | 'completed' | 'failed';

export interface OperationView {
  jobId: string;
  laneId: string;
  op: OperationName | string;
  /** Null only when the job's data in Redis is not valid lease-ops job data. */
  lease: LeaseIdentity | null;
  state: OperationState;
  /** Attempts that ended (failed and were retried, or the final one). */
  attempts: number;
  acceptedAt: number | null;
  deadlineAt: number | null;
  startedAt: number | null;
  finishedAt: number | null;
  retryAt: number | null;
  /** In a paused lane (state `paused`): who paused it, and since when. */
  paused?: { by: string; since: number };
  result?: unknown;
  error?: { code: string; message: string };
}

export interface LeaseView {
  /** The lease as asked for: by either of its names, the view is the same. */
  lease: LeaseIdentity;
  laneId: string;
  /** The sandbox's id as last seen (null before any operation saw it): a second name of this lease. */
  sandboxId: string | null;
  /** The id the lease's acquire was enqueued under, when that is not the sandbox's. */
  acquiredAs: string | null;
  /** The lane's head while a worker holds it (ready or running). */
  executing: OperationView | null;
  /** The lane's head while it waits out a retry delay. */
  backingOff: OperationView | null;
  /** Operations behind the head, in the order they will run (the first `limit`). */
  queued: OperationView[];
  queuedTotal: number;
  /** What lease-ops last saw of the sandbox, and since when it has been in that state. */
  observed: Omit<LeaseRecord, 'lease' | 'acquiredAs' | 'acquiredSandbox' | 'companyInstance'> | null;
  /** The newest failure not made good: an operation that failed for good, until that kind next succeeds or it is acknowledged. */
  lastFailure: { jobId: string; at: number; code: string; message: string } | null;
  /** An operator paused the lane (nothing new starts): who, and since when. */
  paused: { by: string; since: number } | null;
  /**
   * The sandbox has been on its way to stopped for longer than LEASE_OPS_STUCK_STOPPING_MS
   * (`budgetMs`): the watchdog's and attention's own test, read from the same index.
   */
  stuck: { since: number; budgetMs: number } | null;
}

/** A lease's lane now, with its history and the operations the history names. */
export interface LeaseTimeline extends LeaseView {
  /** Redis' clock when read (ms): the events' clock. */
  now: number;
  events: HistoryEvent[];
  /** The history holds as many entries as it keeps: older events were dropped. */
  historyFull: boolean;
  operations: OperationView[];
}

export type AttentionReason = 'stuck_stopping' | 'operation_failed' | 'paused' | 'blocked';

/** One reason a lease needs someone, before the reasons of a lease are put together. */
type ReasonItem = Omit<AttentionItem, 'reasons'>;

/** A scoped token's company (and environments): its attention is read from its own entries of the scope index. */
export interface AttentionScope {
  companyId: string;
  environmentIds?: readonly string[] | undefined;
}

/** Redis' answer to a read of a key of another type: an id naming a key that is no job's (`<id>:lock`, the queue's `events`). */
const isWrongType = (err: unknown) => err instanceof Error && err.message.startsWith('WRONGTYPE');

/**
 * A job as BullMQ reads it, or undefined when there is none, or none that is a job: its hash
 * holds what is not JSON (only a writer of Redis makes one), or its id names a key of another
 * type. Not found, as for a missing id: a 500 would tell another company that the id exists.
 */
export function jobOrNone(queue: Queue, jobId: string): Promise<Job | undefined> {
  return Job.fromId(queue, jobId).catch((err: unknown) => (err instanceof SyntaxError || isWrongType(err) ? undefined : Promise.reject(err)));
}

/** The scope index's entries of a scope begin with one of these (see indexScope in includes/lane.lua). */
const scopePrefixes = (scope: AttentionScope) => (scope.environmentIds ? scope.environmentIds.map((env) => `${scope.companyId}\n${env}\n`) : [`${scope.companyId}\n`]);
/** Where a prefix's entries end: the byte 0xff, above every byte of UTF-8 (a string "\xff" would be sent as C3 BF, below a name in Japanese). */
const scopeRangeEnd = (prefix: string) => Buffer.concat([Buffer.from(`(${prefix}`), Buffer.from([0xff])]);
const inScope = (owner: { companyId: string; environmentId: string }, scope: AttentionScope) =>
  owner.companyId === scope.companyId && (!scope.environmentIds || scope.environmentIds.includes(owner.environmentId));

/**
 * One item per lease, with every reason it has, in the order the reasons came (each kind
 * was read `limit` deep, so the leases read are at least `limit`, or all there are).
 */
function groupByLease(items: ReasonItem[], limit: number): AttentionItem[] {
  const byLane = new Map<string, AttentionItem>();
  for (const item of items) {
    const seen = byLane.get(item.laneId);
    if (!seen) byLane.set(item.laneId, { ...item, reasons: [item.reason] });
    else if (!seen.reasons.includes(item.reason)) {
      seen.reasons.push(item.reason);
      seen.since = Math.min(seen.since, item.since);
      seen.detail = `${seen.detail}; ${item.detail}`;
      seen.lease ??= item.lease;
    }
  }
  return [...byLane.values()].slice(0, limit);
}

/** A lease that needs someone: one item per lease, with every reason it has (`reason` is the first of them). */
export interface AttentionItem {
  laneId: string;
  lease: LeaseIdentity | null;
  reason: AttentionReason;
  reasons: AttentionReason[];
  /** Epoch ms since when the condition holds, as far as lease-ops knows. */
  since: number;
  detail: string;
}

export interface QueueOverview {
  /** By BullMQ's counts and the lanes': each operation in the state its own view says. */
  counts: Record<OperationState, number>;
  openLanes: number;
  /** The first 200 leases needing attention. */
  attention: AttentionItem[];
  /** Leases needing attention, each once (blocked ones among the first 200 looked at). */
  attentionLeases: number;
  /** Redis bytes each company's operations are counted as holding (LEASE_OPS_MAX_BYTES_PER_COMPANY). */
  bytesByCompany: Record<string, number>;
}

/** The overview's counts without its list, and the attention counted by reason: what /metrics reports. */
export interface QueueGauges extends Omit<QueueOverview, 'attention'> {
  attentionByReason: Record<AttentionReason, number>;
}

/**
 * Whether a failure was decided before the attempt that ended it ran (no provider call):
 * cancelled or removed while it waited, never in its lane, or out of time before its turn.
 * BullMQ counts that last fetch as an attempt; the views do not.
 */
export function failedBeforeItRan(code: string | null | undefined, message: string | null | undefined): boolean {
  if (code === 'removed' || code === 'orphaned') return true;
  if (code === 'cancelled') return !/while it ran/.test(message ?? '');
  if (code === 'deadline_exceeded') return /while it waited in its lane|before the operation could start/.test(message ?? '');
  return false;
}

/** The message of an error without the `<code>: ` it may start with: the code is beside it. */
export function withoutCode(code: string, message: string): string {
  return message.startsWith(`${code}: `) ? message.slice(code.length + 2) : message;
}

/** The code a failure's message starts with (`removed: ...`), when it does. */
export const codeOf = (message: string | null | undefined): string | null => /^([a-z][a-z0-9_]*): /.exec(message ?? '')?.[1] ?? null;

/** A finished job keeps the lane's outcome (with the failure code) in its hash. */
interface StoredOutcome {
  status: 'completed' | 'failed';
  code?: string;
  error?: string;
}

/** Read-only views of operations, leases and the queue, for the client, the API and the CLI. */
export class Inspector {
  private readonly countLeases: LuaCommand;

  constructor(
    private readonly ops: OperationsQueue,
    private readonly records: LeaseRecords,
    private readonly limits: { stuckStoppingMs: number; blockedAfterMs: number },
  ) {
    this.countLeases = luaCommand(ops.connection, 'attention-leases', 3);
  }

  async operation(jobId: string): Promise<OperationView | null> {
    const laneId = laneIdOfJobId(jobId);
    if (!laneId) return null;
    return this.viewOf(jobId, laneId);
  }

  private async viewOf(jobId: string, laneId: string): Promise<OperationView | null> {
    // The state first, then the job: a job that finishes in between then shows its old
    // state with its new data, never "completed" without its result.
    const bullState = await this.ops.queue.getJobState(jobId);
    const reads = await Promise.all([
      jobOrNone(this.ops.queue, jobId),
      this.ops.connection.hmget(this.ops.queue.toKey(jobId), 'lo:outcome', 'lo:parked'),
      this.ops.connection.zscore(this.ops.queue.toKey('delayed'), jobId),
      this.ops.lanes.pausedBy(laneId),
    ]).catch((err: unknown) => (isWrongType(err) ? null : Promise.reject(err)));
    if (!reads) return null;
    const [job, [outcomeText, parked], delayedScore, lanePause] = reads;
    if (!job) return null;
    const parsed = OperationJobDataSchema.safeParse(job.data);
    const data = parsed.success ? parsed.data : null;
    let state: OperationState;
    let retryAt: number | null = null;
    switch (bullState) {
      case 'completed':
      case 'failed':
        state = bullState;
        break;
      case 'active':
        state = 'running';
        break;
      case 'delayed':
        // Waiting in its lane (parked), or its retry's backoff.
        if (parked) state = 'queued';
        else {
          state = 'backing-off';
          // BullMQ scores delayed jobs as timestamp * 4096 + a tie-breaking counter.
          retryAt = delayedScore === null ? null : Math.floor(Number(delayedScore) / 4096);
        }
        break;
      default:
        state = 'ready';
    }
    // Waiting in a lane an operator paused: it starts when the lane is unpaused, not at any retry time.
    const paused = state === 'queued' || state === 'backing-off' ? lanePause : null;
    if (paused) {
      state = 'paused';
      retryAt = null;
    }
    const view: OperationView = {
      jobId,
      laneId,
      op: data?.op ?? job.name,
      lease: data?.lease ?? null,
      state,
      attempts: job.attemptsMade,
      acceptedAt: data?.acceptedAt ?? null,
      deadlineAt: data?.deadlineAt ?? null,
      startedAt: job.processedOn ?? null,
      finishedAt: job.finishedOn ?? null,
      retryAt,
      ...(paused ? { paused } : {}),
    };
    if (state === 'completed') view.result = job.returnvalue;
    if (state === 'failed') {
      const outcome = parseOutcome(outcomeText ?? null);
      // Callers (tenants among them) read it: no addresses or server paths.
      const code = outcome?.code ?? codeOf(job.failedReason) ?? 'failed';
      view.error = { code, message: withoutCode(code, withoutInfrastructure(job.failedReason || outcome?.error || 'failed')) };
      if (failedBeforeItRan(code, view.error.message)) {
        view.attempts = Math.max(0, job.attemptsMade - 1);
        if (view.attempts === 0) view.startedAt = null;
      }
    }
    return view;
  }

  /** A lease's lane, by either of its names (the id its acquire was enqueued under, or its sandbox's). */
  /** `resolved`: the lease's lane when the caller has resolved its name already (one read less). */
  async lease(lease: LeaseIdentity, limit = 50, resolved?: string): Promise<LeaseView> {
    const laneId = resolved ?? (await this.ops.laneOf(lease));
    // The stuck budget in the same round of reads, not one after it.
    const [lane, record, failure, paused, stoppingSince, now, budgetMs] = await Promise.all([
      this.ops.lanes.view(laneId),
      this.records.get(laneId),
      this.ops.lanes.lastFailure(laneId),
      this.ops.lanes.pausedBy(laneId),
      this.records.stoppingSince(laneId),
      this.records.now(),
      this.stuckBudget(),
    ]);
    const views = (await Promise.all(lane.jobs.slice(0, limit + 1).map((jobId) => this.viewOf(jobId, laneId)))).filter(
      (v): v is OperationView => v !== null,
    );
    const head = views[0]?.jobId === lane.jobs[0] ? views[0] : undefined;
    const executing = head && lane.holder?.job === head.jobId ? head : null;
    const backingOff = head && !executing && head.state === 'backing-off' ? head : null;
    const queued = views.filter((v) => v !== executing && v !== backingOff).slice(0, limit);
    let lastFailure: LeaseView['lastFailure'] = null;
    if (failure) {
      const failed = await this.operation(failure.jobId);
      lastFailure = {
        jobId: failure.jobId,
        at: failure.at,
        code: failed?.error?.code ?? 'failed',
        message: failed?.error?.message ?? 'the failed operation was already removed',
      };
    }
    const observed = record ? (({ lease: _lease, acquiredAs: _acquiredAs, acquiredSandbox: _acquiredSandbox, companyInstance: _companyInstance, ...rest }) => rest)(record) : null;
    return {
      lease,
      laneId,
      sandboxId: record?.providerLeaseId || null,
      acquiredAs: record?.acquiredAs ?? null,
      executing,
      backingOff,
      queued,
      queuedTotal: lane.jobs.length - (executing || backingOff ? 1 : 0),
      observed,
      lastFailure,
      paused,
      stuck: stoppingSince !== null && now - stoppingSince >= budgetMs ? { since: stoppingSince, budgetMs } : null,
    };
  }

  /**
   * A lease's story: its events (oldest first, about the last 200), its lane now, and a view
   * of each operation the events name (the newest `limit`; the rest BullMQ may have removed).
   */
  async timeline(lease: LeaseIdentity, limit = 40, resolved?: string): Promise<LeaseTimeline> {
    const laneId = resolved ?? (await this.ops.laneOf(lease));
    const [now, events, entries, view] = await Promise.all([this.records.now(), this.ops.history.read(laneId), this.ops.history.entries(laneId), this.lease(lease, 50, laneId)]);
    // An attempt's start is kept with its end (see LeaseHistory); a running one's is its job's.
    const running = view.executing;
    if (running?.state === 'running' && running.startedAt !== null) {
      placeStart(events, { at: running.startedAt, kind: 'started', jobId: running.jobId, op: running.op, attempt: running.attempts + 1 });
      events.sort((a, b) => a.at - b.at);
    }
    const named = [...new Set(events.map((e) => e.jobId).filter((id): id is string => id !== null))].slice(-limit);
    const views = await Promise.all(named.map((jobId) => this.viewOf(jobId, laneId)));
    return { ...view, now, events, historyFull: entries >= HISTORY_CAPACITY, operations: views.filter((v): v is OperationView => v !== null) };
  }

  /**
   * Leases that need a person or the watchdog: sandboxes stuck in `stopping`, leases with an
   * operation that failed (until that kind next succeeds, or an operator acknowledges it),
   * paused lanes, and lanes whose head has made no progress for too long.
   *
   * `visible` keeps a caller to its own leases (a scoped token): each kind is read a page at
   * a time until `limit` of its items are visible or it has no more, so no other company's
   * items, however many, hide a caller's own.
   */
  async attention(limit = 200, visible: (lease: LeaseIdentity | null) => boolean = () => true, scope?: AttentionScope): Promise<AttentionItem[]> {
    return (await this.attentionPage(0, limit, visible, scope)).items;
  }

  /**
   * One page of `attention`: the items from `offset` on, at most `limit`, and the offset of
   * the next page (null when there is none). Items come in a fixed order (stuck, failed,
   * blocked), so paging walks every item a caller may see; a page costs a read of the items
   * before it.
   */
  async attentionPage(
    offset: number,
    limit: number,
    visible: (lease: LeaseIdentity | null) => boolean = () => true,
    scope?: AttentionScope,
  ): Promise<{ items: AttentionItem[]; next: number | null }> {
    const all = await this.attentionUpTo(offset + limit + 1, visible, scope);
    return { items: all.slice(offset, offset + limit), next: all.length > offset + limit ? offset + limit : null };
  }

  /** The budget the workers judge "stuck stopping" by (they announce it); this process' own before any did. */
  private async stuckBudget(): Promise<number> {
    return (await this.ops.announcedStuckBudget()) ?? this.limits.stuckStoppingMs;
  }

  /**
   * Lanes blocked now (their heads should have moved), `limit` visible ones of each source at
   * most. Quiet lanes are read page by page, a scoped list's heads its own only. The sweep marks a lane whose head runs as
   * seen, so a head running past its deadline is found among the running jobs (as many as the
   * workers' concurrency; running: holding its BullMQ lock), not among the quiet lanes: every
   * one for an unscoped walk, the company's own past their deadline (from its index) for a
   * scoped one. One item per lane.
   */
  private async blockedItems(limit: number, visible: (lease: LeaseIdentity | null) => boolean, scope?: AttentionScope): Promise<ReasonItem[]> {
    const now = Date.now();
    const page = Math.max(limit, ATTENTION_PAGE);
    const [quiet, running] = await Promise.all([
      this.pagedVisible(page, limit, visible, async (offset) => {
        const laneIds = await this.ops.lanes.quietLanes(now - this.limits.blockedAfterMs, page, offset);
        // A scoped list reads the heads of its own lanes only: another company's quiet lanes
        // cost it a field of their count record each (one read for the page), not their heads.
        const owners = scope ? await this.ops.lanes.scopesOf(laneIds) : [];
        const others = (i: number) => scope !== undefined && owners[i] != null && !inScope(owners[i], scope);
        return { read: laneIds.length, items: await Promise.all(laneIds.map((laneId, i) => (others(i) ? null : this.blockedHead(laneId, now)))) };
      }),
      scope ? this.overdueOfCompany(scope.companyId, page, limit, visible, now) : this.pagedVisible(page, limit, visible, async (offset) => {
        const jobs = await this.ops.queue.getActive(offset, offset + page - 1);
        // Running is holding its lock, for this list as for a company's (Lanes.jobsNow).
        const held = jobs.length ? await this.ops.lanes.locksHeld(jobs.map((job) => job.id ?? '')) : [];
        return { read: jobs.length, items: jobs.map((job, i) => (held[i] ? overdueItem(job, now) : null)) };
      }),
    ]);
    const quietLanes = new Set(quiet.map((item) => item.laneId));
    return [...quiet, ...running.filter((item) => !quietLanes.has(item.laneId))];
  }

  /**
   * A company's operations running past their deadline, from its own index of operations by
   * deadline (Lanes.deadlinesKey): what a scoped walk reads, whatever other companies have
   * running. Entries whose job ended or went are taken out after the walk.
   */
  private async overdueOfCompany(companyId: string, page: number, limit: number, visible: (lease: LeaseIdentity | null) => boolean, now: number): Promise<ReasonItem[]> {
    const ended: string[] = [];
    const jobIds = await this.ops.lanes.pastDeadlineIds(companyId, now);
    const items = await this.pagedVisible(page, limit, visible, async (offset) => {
      const slice = jobIds.slice(offset, offset + page);
      if (!slice.length) return { read: 0, items: [] };
      const read = await this.ops.lanes.jobsNow(slice);
      ended.push(...read.ended);
      return {
        read: slice.length,
        items: read.jobs.map(({ jobId, data, processedOn, active }) => (active ? overdueItem({ id: jobId, data: parseData(data), processedOn: processedOn ?? undefined }, now) : null)),
      };
    });
    if (ended.length) await this.ops.lanes.forgetEnded(companyId, ended);
    return items;
  }

  private async attentionUpTo(limit: number, visible: (lease: LeaseIdentity | null) => boolean, scope?: AttentionScope, stalledRead?: ReasonItem[]): Promise<AttentionItem[]> {
    // How long a sandbox has been stopping is counted in Redis' clock, the one it was recorded in.
    const [redisNow, stuckBudget] = await Promise.all([this.records.now(), this.stuckBudget()]);
    const page = Math.max(limit, ATTENTION_PAGE);
    // Each kind is read for all its lanes at once: a scrape of /metrics asks for this too.
    const blocked = async () => stalledRead?.filter((item) => visible(item.lease)) ?? this.blockedItems(limit, visible, scope);
    if (scope) {
      // A company's own: its entries of the scope index, then the lanes blocked now (its own
      // operations running past their deadline among them).
      const [own, stalled] = await Promise.all([this.scopedItems(scope, limit, redisNow, stuckBudget), blocked()]);
      return this.namedByAcquire(groupByLease([...own.filter((item) => visible(item.lease)), ...stalled], limit));
    }
    const [stuck, failures, paused, stalled] = await Promise.all([
      this.pagedVisible(page, limit, visible, async (offset) => {
        const pairs = await this.records.stoppingSinceWithScores(redisNow - stuckBudget, page, offset);
        return { read: pairs.length, items: await Promise.all(pairs.map(([laneId, since]) => this.stuckItem(laneId, since, redisNow))) };
      }),
      this.pagedVisible(page, limit, visible, async (offset) => {
        const entries = await this.ops.lanes.failures(page, offset);
        return { read: entries.length, items: await Promise.all(entries.map((entry) => this.failureItem(entry))) };
      }),
      this.pausedItems(limit, visible),
      blocked(),
    ]);
    return this.namedByAcquire(groupByLease([...stuck, ...failures, ...paused, ...stalled], limit));
  }

  /**
   * Each item named as its lease was acquired (the id its acquire was enqueued under), not by
   * whichever name the operation or pause behind a reason used: one lease, one name.
   */
  private async namedByAcquire(items: AttentionItem[]): Promise<AttentionItem[]> {
    if (!items.length) return items;
    const names = await this.records.acquiredAs(items.map((item) => item.laneId));
    return items.map((item, i) => (item.lease && names[i] && names[i] !== item.lease.leaseId ? { ...item, lease: { ...item.lease, leaseId: names[i]! } } : item));
  }

  /**
   * How many leases need attention, by reason: stuck, failed and paused ones counted exactly
   * from their indexes; blocked ones among the first `limit` quiet lanes and running jobs
   * (each needs a look at its head).
   */
  async attentionCounts(limit = 200): Promise<Record<AttentionReason, number>> {
    return this.countsByReason(await this.blockedItems(limit, () => true));
  }

  private async countsByReason(blocked: ReasonItem[]): Promise<Record<AttentionReason, number>> {
    const [redisNow, stuckBudget] = await Promise.all([this.records.now(), this.stuckBudget()]);
    const [stuck, failed, paused] = await Promise.all([this.records.stoppingCount(redisNow - stuckBudget), this.ops.lanes.failureCount(), this.ops.lanes.pausedCount()]);
    return { stuck_stopping: stuck, operation_failed: failed, paused, blocked: blocked.length };
  }

  /**
   * Leases needing attention, each once whatever its reasons: stuck, failed and paused ones
   * exactly (one script over their three indexes), and the `blocked` lanes (as blockedItems
   * reads them) that are none of those.
   */
  private async attentionLeaseCount(blocked: string[]): Promise<number> {
    const [redisNow, stuckBudget] = await Promise.all([this.records.now(), this.stuckBudget()]);
    return Number(await this.countLeases(this.ops.lanes.failuresAtKey, this.records.stoppingKey, this.ops.lanes.pausedKey, redisNow - stuckBudget, ...blocked));
  }

  /** Reads pages of one kind of attention item until `limit` are visible or there are no more. */
  private async pagedVisible(
    page: number,
    limit: number,
    visible: (lease: LeaseIdentity | null) => boolean,
    read: (offset: number) => Promise<{ read: number; items: (ReasonItem | null)[] }>,
  ): Promise<ReasonItem[]> {
    const found: ReasonItem[] = [];
    for (let offset = 0; found.length < limit; offset += page) {
      const { read: count, items } = await read(offset);
      for (const item of items) if (item && visible(item.lease)) found.push(item);
      if (count < page) break;
    }
    return found.slice(0, limit);
  }

  private async stuckItem(laneId: string, since: number, redisNow: number): Promise<ReasonItem> {
    const record = await this.records.get(laneId);
    return {
      laneId,
      lease: record?.lease ?? null,
      reason: 'stuck_stopping',
      since,
      detail: `sandbox ${record?.providerLeaseId ?? '?'} has been ${record?.providerState ?? 'stopping'} for ${Math.round((redisNow - since) / 1000)} s`,
    };
  }

  /** One item per lease: every kind of operation that failed since it last succeeded, newest first. */
  private async failureItem({ laneId, at, kinds }: { laneId: string; jobId: string; at: number; kinds: { op: string; jobId: string; at: number }[] }): Promise<ReasonItem> {
    const views = await Promise.all(kinds.map((kind) => this.operation(kind.jobId)));
    const lease = views.find((v) => v?.lease)?.lease ?? (await this.records.get(laneId))?.lease ?? null;
    const detail = kinds
      .map((kind, i) => {
        const failed = views[i];
        const op = failed?.op ?? kind.op;
        return failed?.error ? `${op} failed: ${failed.error.code}: ${failed.error.message.replace(`${failed.error.code}: `, '')}` : `${op} ${kind.jobId} failed`;
      })
      .join('; ');
    // Since the oldest failure it lists (each kind's newest), as the item's `since` promises.
    const since = Math.min(at, ...kinds.map((kind) => kind.at));
    return { laneId, lease, reason: 'operation_failed', since, detail: `${detail} (acknowledge to clear, or it clears when that kind of operation next succeeds)` };
  }

  /**
   * Lanes an operator paused, with who and since when, a page of the paused hash at a time
   * until `limit` are visible: a paused lane needs someone to unpause it, whether or not
   * anything waits in it yet.
   */
  private async pausedItems(limit: number, visible: (lease: LeaseIdentity | null) => boolean): Promise<ReasonItem[]> {
    const found: ReasonItem[] = [];
    let cursor = '0';
    do {
      const page = await this.ops.lanes.pausedLanes(cursor, ATTENTION_PAGE);
      cursor = page.next;
      const items = await Promise.all(
        page.lanes.map(({ laneId, by, since, lease }) => this.pausedItem(laneId, by, since, lease)),
      );
      for (const item of items) if (visible(item.lease)) found.push(item);
    } while (cursor !== '0' && found.length < limit);
    return found.sort((a, b) => a.since - b.since).slice(0, limit);
  }

  private async pausedItem(laneId: string, by: string, since: number, pausedFor: LeaseIdentity | null): Promise<ReasonItem> {
    const lane = await this.ops.lanes.view(laneId);
    const head = lane.jobs[0] ? await this.operation(lane.jobs[0]) : null;
    const lease = head?.lease ?? (await this.records.get(laneId))?.lease ?? pausedFor;
    const waiting = lane.jobs.length === 0 ? 'nothing waits in it yet' : `${lane.jobs.length} operation${lane.jobs.length === 1 ? '' : 's'} wait${lane.jobs.length === 1 ? 's' : ''}${head ? ` (${head.op} ${head.jobId} first)` : ''}`;
    return { laneId, lease, reason: 'paused', since, detail: `paused by ${by}: ${waiting}; unpause the lane to let them run` };
  }

  /** How many entries a scoped walk of its attention reads from the scope index (what it will cost, before it runs). */
  async scopeEntries(scope: AttentionScope): Promise<number> {
    const counts = await Promise.all(scopePrefixes(scope).map((prefix) => this.ops.connection.zlexcount(this.ops.lanes.attentionScopeKey, `[${prefix}`, scopeRangeEnd(prefix))));
    return counts.reduce((sum, n) => sum + n, 0);
  }

  /**
   * A company's (or its environments') stuck, failed and paused leases, read from the scope
   * index (see indexScope in includes/lane.lua): what it costs grows with the company's own
   * entries, not with other companies'. Entries whose reason ended are taken out on the way.
   */
  private async scopedItems(scope: AttentionScope, limit: number, redisNow: number, stuckBudget: number): Promise<ReasonItem[]> {
    const key = this.ops.lanes.attentionScopeKey;
    const prefixes = scopePrefixes(scope);
    // First what each lane has, three cheap reads a lane; then items (several reads each) only
    // for the first `limit` leases in the list's order: a company's long list costs its page.
    const stuck: { laneId: string; since: number }[] = [];
    const failed: { laneId: string; kinds: ReturnType<typeof parseFailures> }[] = [];
    const paused: { laneId: string; entry: string }[] = [];
    for (const prefix of prefixes) {
      // Each page starts after the last entry of the one before (a lex cursor), not at an
      // offset: entries taken out meanwhile, by this walk or another of the company's (one of
      // another replica, or after an acknowledgement), shifted an offset past live entries
      // (helper-23, helper-24: a page skipped for each page taken out; 1-4 live items missed).
      for (let from = `[${prefix}`; ; ) {
        const members = await this.ops.connection.zrangebylex(key, from, scopeRangeEnd(prefix), 'LIMIT', 0, ATTENTION_PAGE);
        if (members.length === 0) break;
        const laneIds = members.map((m) => m.slice(m.lastIndexOf('\n') + 1));
        const pipeline = this.ops.connection.pipeline();
        for (const laneId of laneIds) pipeline.hget(this.ops.lanes.failuresKey, laneId).zscore(this.records.stoppingKey, laneId).hget(this.ops.lanes.pausedKey, laneId);
        const results = (await pipeline.exec()) ?? [];
        // A failed read is not "no reason left": the walk fails (a stalled Redis: 503) and no
        // entry is taken out (helper-15: a stall mid-walk took 500 out of the index).
        const readError = results.find(([err]) => err)?.[0];
        if (readError) throw readError;
        const replies = results.map(([, value]) => value);
        const gone: string[] = [];
        laneIds.forEach((laneId, i) => {
          const [failures, stopping, pause] = replies.slice(i * 3, i * 3 + 3) as [string | null, string | null, string | null];
          const kinds = parseFailures(failures);
          if (!kinds.length && stopping === null && pause === null) return void gone.push(members[i]!);
          if (stopping !== null && Number(stopping) <= redisNow - stuckBudget) stuck.push({ laneId, since: Number(stopping) });
          if (kinds.length) failed.push({ laneId, kinds });
          if (pause !== null) paused.push({ laneId, entry: pause });
        });
        if (gone.length) await this.ops.connection.zrem(key, ...gone);
        if (members.length < ATTENTION_PAGE) break;
        from = `(${members.at(-1)!}`;
      }
    }
    // The same order as the walk over every lease's: stuck (oldest first), failed (newest first), paused (oldest first).
    stuck.sort((x, y) => x.since - y.since);
    failed.sort((x, y) => y.kinds[0]!.at - x.kinds[0]!.at);
    paused.sort((x, y) => parsePause(x.entry).since - parsePause(y.entry).since);
    const shown = new Set<string>();
    for (const { laneId } of [...stuck, ...failed, ...paused]) {
      if (shown.size >= limit) break;
      shown.add(laneId);
    }
    const items = await Promise.all([
      ...stuck.filter((x) => shown.has(x.laneId)).map((x) => this.stuckItem(x.laneId, x.since, redisNow)),
      ...failed.filter((x) => shown.has(x.laneId)).map((x) => this.failureItem({ laneId: x.laneId, jobId: x.kinds[0]!.jobId, at: x.kinds[0]!.at, kinds: x.kinds })),
      ...paused.filter((x) => shown.has(x.laneId)).map((x) => {
        const pause = parsePause(x.entry);
        return this.pausedItem(x.laneId, pause.by, pause.since, pausedLease(x.entry));
      }),
    ]);
    return items;
  }

  /** A lane's head that should have moved by now: not picked up, left parked, or past its deadline. */
  private async blockedHead(laneId: string, now: number): Promise<ReasonItem | null> {
    const lane = await this.ops.lanes.view(laneId);
    const headId = lane.jobs[0];
    if (!headId) return null;
    const head = await this.operation(headId);
    const lease = head?.lease ?? null;
    const since = head?.startedAt ?? head?.acceptedAt ?? now;
    if (!head) return { laneId, lease, reason: 'blocked', since: now, detail: `head ${headId} is gone; the lane sweep will drop it` };
    if (head.state === 'ready' && now - (head.acceptedAt ?? now) > this.limits.blockedAfterMs) {
      return { laneId, lease, reason: 'blocked', since, detail: `${head.op} ${headId} is ready but no worker has picked it up` };
    }
    // A paused lane is listed as paused (attention's own reason), not as blocked.
    if (head.state === 'queued') return { laneId, lease, reason: 'blocked', since, detail: `${head.op} ${headId} is at the head but still parked` };
    if (head.state === 'running' && head.deadlineAt !== null && now > head.deadlineAt) {
      return { laneId, lease, reason: 'blocked', since, detail: `${head.op} ${headId} is still running past its deadline` };
    }
    return null;
  }

  async overview(): Promise<QueueOverview> {
    const stalled = await this.blockedItems(200, () => true);
    const [counts, attention] = await Promise.all([this.countsWith(stalled), this.attentionUpTo(200, () => true, undefined, stalled)]);
    return { counts: counts.counts, openLanes: counts.openLanes, attention, attentionLeases: counts.attentionLeases, bytesByCompany: counts.bytesByCompany };
  }

  /**
   * The overview without its list of items, and the attention by reason: each read from an
   * index or a count, so a scrape of /metrics costs the same whatever the number of failures
   * (reading the list's 200 items held the API's event loop 157 ms at 600 of one company's).
   */
  async gauges(): Promise<QueueGauges> {
    const stalled = await this.blockedItems(200, () => true);
    const [counts, attentionByReason] = await Promise.all([this.countsWith(stalled), this.countsByReason(stalled)]);
    return { ...counts, attentionByReason };
  }

  /** Operations by state, open lanes, leases needing attention and bytes by company, given the lanes blocked now. */
  private async countsWith(stalled: ReasonItem[]): Promise<Omit<QueueOverview, 'attention'>> {
    const c = await this.ops.queue.getJobCounts('waiting', 'prioritized', 'active', 'delayed', 'completed', 'failed');
    // Delayed jobs are parked (queued in a lane) or backing off; the lanes list the latter.
    // Those of paused lanes are paused, as each one's view says.
    const [backingOff, inPaused] = await Promise.all([this.ops.lanes.backingOffCount(), this.ops.lanes.waitingInPausedLanes()]);
    const parked = Math.max(0, (c.delayed ?? 0) - backingOff);
    const [openLanes, attentionLeases, bytesByCompany] = await Promise.all([
      this.ops.lanes.openLaneCount(),
      this.attentionLeaseCount(stalled.map((item) => item.laneId)),
      this.ops.bytes.held(),
    ]);
    return {
      counts: {
        queued: Math.max(0, parked - inPaused.parked),
        ready: (c.waiting ?? 0) + (c.prioritized ?? 0),
        running: c.active ?? 0,
        'backing-off': Math.max(0, (c.delayed ?? 0) - parked - inPaused.backingOff),
        paused: inPaused.parked + inPaused.backingOff,
        completed: c.completed ?? 0,
        failed: c.failed ?? 0,
      },
      openLanes,
      attentionLeases,
      bytesByCompany,
    };
  }
}

/** A running job past its deadline, as an attention item; null for any other. */
function overdueItem(job: Pick<Job, 'id' | 'data' | 'processedOn'>, now: number): ReasonItem | null {
  const parsed = OperationJobDataSchema.safeParse(job.data);
  const laneId = job.id ? laneIdOfJobId(job.id) : null;
  if (!parsed.success || !laneId || now <= parsed.data.deadlineAt) return null;
  const { op, lease, deadlineAt } = parsed.data;
  return { laneId, lease, reason: 'blocked', since: job.processedOn ?? deadlineAt, detail: `${op} ${job.id} is still running past its deadline` };
}

/** A job's data as BullMQ stores it (JSON); what is not JSON is no operation's. */
function parseData(text: string): unknown {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    return null;
  }
}

/** Attention items are read this many at a time per kind. */
const ATTENTION_PAGE = 500;

function parseOutcome(text: string | null): StoredOutcome | null {
  if (!text) return null;
  try {
    return JSON.parse(text) as StoredOutcome;
  } catch {
    return null;
  }
}
