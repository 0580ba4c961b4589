import { randomBytes } from 'node:crypto';
import { companyBytesKeys, ENDED_ALLOWANCE_BYTES } from './company-bytes.ts';
import { layoutKey } from './layout.ts';
import { historyKey, type HistoryNote } from './lease-history.ts';
import { leaseRecordKey, RECORD_TTL_S } from './lease-records.ts';
import { luaCommand, luaCommandName, type LuaCommand } from './lua-scripts.ts';
import type { RedisClient } from './redis.ts';
import type { QueueLimit } from '../errors.ts';
import { LeaseIdentitySchema, type LeaseIdentity } from '../lease.ts';

// Every lane script takes the lane key layout of includes/lane.lua (18 keys), and some
// the job's hash (and the request's idempotency key, and the lease's history) after it.
const SCRIPTS = {
  'lane-push': 26,
  'lane-alias': 3,
  'lane-acquire': 22,
  'lane-release': 26,
  'lane-yield': 19,
  'lane-repair': 18,
  'lane-upgrade': 20,
  'lane-drop': 22,
  'lane-forget': 18,
  'failures-ack': 2,
  'deadline-forget': 2,
} as const;
type ScriptName = keyof typeof SCRIPTS;

/** The outcome a lane records for its finished head, replayed if the job ever re-runs. */
export type LaneOutcome = { status: 'completed'; result: unknown } | { status: 'failed'; error: string; code: string };

export type AcquireResult =
  | { kind: 'run'; token: string }
  | { kind: 'park' }
  | { kind: 'done'; outcome: LaneOutcome }
  | { kind: 'orphan' }
  | { kind: 'gone' }
  | { kind: 'stale' };

/** How a hand-off went: promoted to the wait list, or the job was already elsewhere. */
export type HandOff = { jobId: string; result: 'promoted' | 'elsewhere' | 'held' };

export type PushResult =
  | { kind: 'queued' }
  | { kind: 'present' }
  | { kind: 'gone' }
  | { kind: 'removed' }
  | { kind: 'next'; handOff: HandOff }
  | { kind: 'absorbed'; by: string }
  | { kind: 'full'; limit: QueueLimit; count: number }
  | { kind: 'layout'; held: number }
  | { kind: 'alias'; laneId: string }
  | { kind: 'claim-over' };

/** A watchdog's force-stop, claimed on the lease's record (lease-force-claim.lua): it joins its lane only while the record shows the claim. */
export interface ForceStopClaim {
  recordKey: string;
  since: number;
  forceStops: number;
}

/**
 * How long a sandbox id stays a second name of its acquire's lane without use: as long as
 * the lease's record (a week without news).
 */
export const ALIAS_TTL_MS = 7 * 24 * 3_600_000;

/** How naming a sandbox after its acquire's lane went (see lane-alias.lua): `new`, or `named` already. */
export type AliasResult = 'new' | 'named' | 'busy' | 'taken';

/** The company and environment a lane belongs to: what its operations count against. */
export type LaneScope = { companyId: string; environmentId: string };

/** Most operations a lane, an environment, a company and the queue may hold (0: no limit). */
/** A pause asked for: done (`paused`), already so, refused at the company's limit (`full`), or done past it by an admin (`over`). */
export type PauseOutcome = { outcome: 'paused' | 'already' | 'full' | 'over'; count: number };

export type QueueLimits = { perLane: number; perEnvironment: number; perCompany: number; queued: number };
export const NO_LIMITS: QueueLimits = { perLane: 0, perEnvironment: 0, perCompany: 0, queued: 0 };

function toQueueLimit(reply: string | undefined): QueueLimit {
  if (reply === 'lease' || reply === 'environment' || reply === 'company') return reply;
  return 'queue';
}

export type ReleaseResult = { kind: 'stale' } | { kind: 'cancelled' } | { kind: 'next'; handOff: HandOff } | { kind: 'idle' };

export type DropResult = { kind: 'stale' } | { kind: 'executing' } | { kind: 'absent' } | { kind: 'dropped'; next: HandOff | null };

export type RepairResult =
  | { kind: 'forgotten' }
  | { kind: 'healthy' }
  | { kind: 'paused'; jobId: string }
  | { kind: 'dropped'; jobId: string; next: HandOff | null }
  | { kind: 'handed'; jobId: string; result: string };

/**
 * The per-lease lanes: which job of a lease may run, in what order, and who holds it.
 * All bookkeeping is done by the Lua scripts in ./lua, each one atomic, each taking the
 * keys it touches (the layout is in includes/lane.lua).
 *
 * Keys (all under the one hash-tagged prefix, so a Redis Cluster keeps them in one slot
 * with the BullMQ queue they refer to):
 *   <prefix>:lane:<laneId>     list of job ids, head first; gone when the lane is idle
 *   <prefix>:lane:<laneId>:x   hash {job, token} of the lane's holder; gone when none
 *   <prefix>:lane:<laneId>:c   coalescing keys of queued jobs; gone when none
 *   <prefix>:alias:<laneId>    the lane a sandbox's operations join (its acquire's), when
 *                              laneId is the sandbox's own; a week after its last use
 *   <prefix>:lanes             zset laneId -> last progress (ms), read by the sweep
 *   <prefix>:fence             counter behind every fencing token
 *   <prefix>:failures          hash laneId -> JSON {op: {at, job}} of the kinds of operation that failed
 *   <prefix>:failures:at       zset laneId -> that ms (newest first, trimmed to BullMQ's retention)
 *   <prefix>:backing-off       zset jobId -> when its retry comes due
 *   <prefix>:counted           hash laneId -> what the lane adds to the two counts below
 *   <prefix>:queued:company    hash companyId -> operations in its lanes (executing ones included)
 *   <prefix>:queued:environment hash "<companyId>\n<environmentId>" -> the same per environment
 *   <prefix>:paused            hash laneId -> who paused the lane, since when, the lease (JSON)
 *   <prefix>:paused:company    hash companyId -> its paused lanes (lane-pause.lua, lane-unpause.lua)
 */
export class Lanes {
  readonly lanesKey: string;
  readonly fenceKey: string;
  readonly failuresKey: string;
  readonly failuresAtKey: string;
  readonly backingOffKey: string;
  readonly countedKey: string;
  readonly byCompanyKey: string;
  readonly byEnvironmentKey: string;
  /** Lanes an operator paused: nothing new starts there until unpaused. */
  readonly pausedKey: string;
  readonly pausedByCompanyKey: string;
  /** Lanes that may need attention, by company and environment (see indexScope in includes/lane.lua). */
  readonly attentionScopeKey: string;
  /** Acquires that have not ended, with their lease (see OperationsQueue.reconcileAcquires). */
  readonly acquiresKey: string;
  /** Where a request without an idempotency key points lane-push's key slot (never written). */
  private readonly noIdempotencyKey: string;
  private readonly scripts: Record<ScriptName, LuaCommand>;

  constructor(
    private readonly client: RedisClient,
    readonly prefix: string,
    /**
     * The BullMQ queue's key prefix (`<prefix>:<queue>:`): a job's hash is this plus its
     * id, and BullMQ's own keys (wait, delayed, marker...) are this plus their names.
     */
    private readonly queueKeyPrefix: string,
    /** How long BullMQ keeps failed jobs (ms): failure entries older than that are trimmed. */
    private readonly keepFailedMs: number,
    /** The deployment's partition count as this process has it (lane-push refuses another). */
    private readonly partitions = 1,
  ) {
    this.lanesKey = `${prefix}:lanes`;
    this.fenceKey = `${prefix}:fence`;
    this.failuresKey = `${prefix}:failures`;
    this.failuresAtKey = `${prefix}:failures:at`;
    this.backingOffKey = `${prefix}:backing-off`;
    this.countedKey = `${prefix}:counted`;
    this.byCompanyKey = `${prefix}:queued:company`;
    this.byEnvironmentKey = `${prefix}:queued:environment`;
    this.pausedKey = `${prefix}:paused`;
    this.pausedByCompanyKey = `${prefix}:paused:company`;
    this.attentionScopeKey = `${prefix}:attention:scope`;
    this.acquiresKey = `${prefix}:acquires`;
    this.noIdempotencyKey = `${prefix}:idem:-`;
    this.scripts = Object.fromEntries(
      Object.entries(SCRIPTS).map(([script, numberOfKeys]) => [script, luaCommand(client, script, numberOfKeys, prefix)]),
    ) as Record<ScriptName, LuaCommand>;
  }

  listKey(laneId: string): string {
    return `${this.prefix}:lane:${laneId}`;
  }

  execKey(laneId: string): string {
    return `${this.prefix}:lane:${laneId}:x`;
  }

  /** Coalescing keys of the lane's jobs that may still absorb an identical request. */
  private coalesceKey(laneId: string): string {
    return `${this.listKey(laneId)}:c`;
  }

  /** Set when a lane's id is a sandbox's whose operations join its acquire's lane: that lane's id. */
  aliasKey(laneId: string): string {
    return `${this.prefix}:alias:${laneId}`;
  }

  /**
   * Makes the sandbox whose own lane is `sandboxLaneId` a second name of `laneId`, the lane
   * of the acquire that made it (lane-alias.lua). Runs in the sandbox lane's partition.
   */
  async alias(sandboxLaneId: string, laneId: string): Promise<AliasResult> {
    const r = await this.run('lane-alias', this.aliasKey(sandboxLaneId), this.listKey(sandboxLaneId), this.execKey(sandboxLaneId), laneId, ALIAS_TTL_MS);
    return r === 'new' || r === 'busy' || r === 'taken' ? r : 'named';
  }

  /** The lane a lease's own lane id is a second name of, or null when it names its own. A look-up renews the name. */
  async aliasOf(laneId: string): Promise<string | null> {
    return this.client.getex(this.aliasKey(laneId), 'PX', ALIAS_TTL_MS);
  }

  private jobKey(jobId: string): string {
    return this.queueKeyPrefix + jobId;
  }

  /** BullMQ's lock of a job: holds the token of the worker that runs it (pinned by test/bullmq-contract.test.ts). */
  lockKey(jobId: string): string {
    return `${this.jobKey(jobId)}:lock`;
  }

  /** The 18 keys every lane script takes (includes/lane.lua), for one lane. */
  private keys(laneId: string): string[] {
    const q = this.queueKeyPrefix;
    return [
      this.listKey(laneId),
      this.execKey(laneId),
      this.coalesceKey(laneId),
      this.lanesKey,
      this.fenceKey,
      this.failuresKey,
      this.failuresAtKey,
      this.backingOffKey,
      `${q}delayed`,
      `${q}wait`,
      `${q}meta`,
      `${q}active`,
      `${q}marker`,
      `${q}events`,
      this.countedKey,
      this.byCompanyKey,
      this.byEnvironmentKey,
      this.pausedKey,
    ];
  }

  private run(script: ScriptName, ...args: (string | number)[]): Promise<unknown> {
    return this.scripts[script](...args);
  }

  /**
   * Adds a job to its lane. `coalesceAs`: an identical request (same key) queued last and
   * not yet started absorbs this one, and its id comes back as `absorbedBy`. With
   * `idempotency`, the request's key is set to `accepted` in the same step (lane-push.lua).
   */
  async push(
    laneId: string,
    jobId: string,
    position: 'tail' | 'front' = 'tail',
    coalesceAs = '',
    scope: LaneScope,
    limits: QueueLimits = NO_LIMITS,
    adopt = false,
    idempotency: { key: string; fingerprint: string } | null = null,
    note: HistoryNote | null = null,
    /** The operation's acceptance and deadline (its data's): the history's time, and the coalescing rule's. */
    times: { acceptedAt: number; deadlineAt: number } | null = null,
    /** A failed job an operator runs again, back in BullMQ's wait list: it joins now (lane-push.lua). */
    rerun = false,
    claim: ForceStopClaim | null = null,
  ): Promise<PushResult> {
    const r = (await this.run(
      'lane-push',
      ...this.keys(laneId),
      this.jobKey(jobId),
      idempotency?.key ?? this.noIdempotencyKey,
      historyKey(this.prefix, laneId),
      layoutKey(this.prefix),
      this.aliasKey(laneId),
      this.rerunsKey(scope.companyId),
      claim?.recordKey ?? this.noIdempotencyKey,
      this.deadlinesKey(scope.companyId),
      jobId,
      laneId,
      Date.now(),
      position,
      this.queueKeyPrefix,
      coalesceAs,
      limits.perLane,
      limits.queued,
      adopt ? '1' : '0',
      idempotency?.fingerprint ?? '',
      idempotency ? '1' : '0',
      scope.companyId,
      scope.environmentId,
      limits.perCompany,
      limits.perEnvironment,
      this.partitions,
      ALIAS_TTL_MS,
      note?.kind ?? '',
      note?.fields ?? '',
      times?.acceptedAt ?? '',
      times?.deadlineAt ?? '',
      rerun ? '1' : '0',
      claim?.since ?? '',
      claim?.forceStops ?? '',
      // This call's own mark: a resend of it (a reply lost) answers as the one that joined.
      randomBytes(9).toString('base64url'),
    )) as string[];
    if (r[0] === 'claim-over') return { kind: 'claim-over' };
    if (r[0] === 'joined') return { kind: 'queued' };
    if (r[0] === 'alias') return { kind: 'alias', laneId: String(r[1]) };
    if (r[0] === 'layout') return { kind: 'layout', held: Number(r[1]) };
    if (r[0] === 'present') return { kind: 'present' };
    if (r[0] === 'gone') return { kind: 'gone' };
    if (r[0] === 'removed') return { kind: 'removed' };
    if (r[0] === 'absorbed') return { kind: 'absorbed', by: String(r[1]) };
    if (r[0] === 'full') return { kind: 'full', limit: toQueueLimit(r[1]), count: Number(r[2]) };
    return r[0] === 'next' ? { kind: 'next', handOff: toHandOff(r[1], r[2]) } : { kind: 'queued' };
  }

  /**
   * Turns the stop queued under `stopCoalesceKey` (not yet started) into a force-stop with
   * `data` and moves it to the front. Returns its job id, or null when there is none.
   */
  async upgradeQueuedStop(
    laneId: string,
    stopCoalesceKey: string,
    data: { deadlineAt: number; acceptedAt: number },
    idempotency: { key: string; fingerprint: string } | null = null,
  ): Promise<string | null> {
    // The job keeps the stop's acceptance (its view and its timeline say one time): read it
    // first; the script absorbs only while the key still names that stop, and only when the
    // two deadlines are close (the force-stop's no sooner, nor much later).
    const stopJob = await this.client.hget(this.coalesceKey(laneId), stopCoalesceKey);
    if (!stopJob) return null;
    const stopData = await this.client.hget(this.jobKey(stopJob), 'data');
    const acceptedAt = stopData ? Number((JSON.parse(stopData) as { acceptedAt?: unknown }).acceptedAt) : NaN;
    if (!Number.isFinite(acceptedAt)) return null;
    const r = (await this.run(
      'lane-upgrade',
      ...this.keys(laneId),
      idempotency?.key ?? this.noIdempotencyKey,
      historyKey(this.prefix, laneId),
      stopCoalesceKey,
      JSON.stringify({ ...data, acceptedAt }),
      laneId,
      Date.now(),
      this.queueKeyPrefix,
      data.deadlineAt,
      idempotency?.fingerprint ?? '',
      idempotency ? '1' : '0',
      stopJob,
      Math.min(5_000, Math.floor((data.deadlineAt - data.acceptedAt) / 10)),
    )) as string[];
    return r[0] === 'none' ? null : String(r[1]);
  }

  /**
   * Takes jobs an operator removed from BullMQ out of the lane's waiting part (lane-forget.lua):
   * the one named, or with none named every one. Returns how many.
   */
  async forgetRemoved(laneId: string, jobId = ''): Promise<number> {
    return Number(await this.run('lane-forget', ...this.keys(laneId), laneId, this.queueKeyPrefix, jobId));
  }

  /** A company's reruns on their way to their lanes (rerun-admit.lua): "<environment>\n<jobId>" -> when asked. */
  rerunsKey(companyId: string): string {
    return `${this.prefix}:reruns:${companyId}`;
  }

  /**
   * The company's operations in their lanes, by deadline: each joins at its push and leaves at
   * its release or drop, so the company's attention finds its own running past their deadline
   * without reading any other company's (Inspector's blockedItems).
   */
  deadlinesKey(companyId: string): string {
    return `${this.prefix}:deadlines:${companyId}`;
  }

  /**
   * Whose each lane is, as its count record says (see recount in lua/includes/lane.lua): null
   * for a lane with none (empty, or not yet counted). One read for all of them.
   */
  async scopesOf(laneIds: readonly string[]): Promise<({ companyId: string; environmentId: string } | null)[]> {
    if (!laneIds.length) return [];
    const records = await this.client.hmget(this.countedKey, ...laneIds);
    return records.map((record) => {
      const [, companyId, environmentId] = record?.split('\n') ?? [];
      return companyId !== undefined && environmentId !== undefined ? { companyId, environmentId } : null;
    });
  }

  /**
   * The company's jobs in their lanes whose deadline is at `now` or before, oldest deadline
   * first: all their ids in one read, so that entries another walk or a release takes out
   * meanwhile shift no page of this one (helper-33: paged by offset, a walk skipped a live one).
   */
  pastDeadlineIds(companyId: string, now: number): Promise<string[]> {
    return this.client.zrangebyscore(this.deadlinesKey(companyId), '-inf', now);
  }

  /**
   * What the jobs named are now: each with its data, when it started, and whether it runs;
   * `ended`: jobs that ended or went (their entries outlived them). It runs while its BullMQ
   * lock is held (a worker holds it from its fetch and renews it), as runningJobs judges the
   * admin's list: O(1) a job, where a look in BullMQ's active list, which holds every company's
   * running jobs, cost a walk 17.5 ms beside 2,000 of another's (helper-33), and 144-170 ms for
   * 2,000 of its own waiting for a worker (helper-35).
   */
  async jobsNow(jobIds: readonly string[]): Promise<{ jobs: { jobId: string; data: string; processedOn: number | null; active: boolean }[]; ended: string[] }> {
    const replies = await this.readEach(jobIds, (pipeline, jobId) => pipeline.hmget(this.jobKey(jobId), 'data', 'processedOn', 'finishedOn').exists(this.lockKey(jobId)));
    const jobs: { jobId: string; data: string; processedOn: number | null; active: boolean }[] = [];
    const ended: string[] = [];
    jobIds.forEach((jobId, i) => {
      const [data, processedOn, finishedOn] = replies[i * 2] as [string | null, string | null, string | null];
      if (data === null || finishedOn !== null) return void ended.push(jobId);
      jobs.push({ jobId, data, processedOn: processedOn === null ? null : Number(processedOn), active: replies[i * 2 + 1] === 1 });
    });
    return { jobs, ended };
  }

  /**
   * Which of BullMQ's active jobs run: those whose lock is held. One whose worker died stays in
   * BullMQ's active list, lockless, until a stall check puts it back to wait; it runs nowhere.
   */
  async locksHeld(jobIds: readonly string[]): Promise<boolean[]> {
    return (await this.readEach(jobIds, (pipeline, jobId) => pipeline.exists(this.lockKey(jobId)))).map((held) => held === 1);
  }

  /** The replies to the reads `queue` adds for each id, in one round trip; a failed one fails them all (nothing is taken for gone). */
  private async readEach(ids: readonly string[], queue: (pipeline: ReturnType<RedisClient['pipeline']>, id: string) => void): Promise<unknown[]> {
    const pipeline = this.client.pipeline();
    for (const id of ids) queue(pipeline, id);
    const results = (await pipeline.exec()) ?? [];
    const readError = results.find(([err]) => err)?.[0];
    if (readError) throw readError;
    return results.map(([, value]) => value);
  }

  /** Takes entries of the company's deadline index out whose jobs ended or went (deadline-forget.lua). */
  async forgetEnded(companyId: string, jobIds: readonly string[]): Promise<void> {
    await Promise.all(jobIds.map((jobId) => this.run('deadline-forget', this.deadlinesKey(companyId), this.jobKey(jobId), jobId)));
  }

  /**
   * Entries of deadline indexes whose jobs ended or went without their lane's release or drop
   * (an operator removed them in Bull Board, a head dropped as removed): up to `perCompany` of
   * each company's entries at random, for up to `companies` companies drawn at random, in turn
   * from those with work in their lanes and those holding bytes, are looked at and taken out if
   * so. The sweep runs it, so such entries go whether or not anyone reads a company's list.
   * Returns how many went.
   */
  async tidyDeadlines(bytesHeldKey: string, companies = 20, perCompany = 200): Promise<number> {
    const [working, holding] = await Promise.all([this.client.hrandfield(this.byCompanyKey, companies), this.client.hrandfield(bytesHeldKey, companies)]);
    // One of each in turn: with 20 companies at work, one that only holds bytes (its lanes
    // emptied after its jobs were removed: the leftovers this is for) still gets its turns (helper-34).
    // Each shuffled first: HRANDFIELD answers a small hash's fields in the hash's own order.
    const [w, h] = [shuffled(working as string[]), shuffled(holding as string[])];
    const chosen = [...new Set(Array.from({ length: Math.max(w.length, h.length) }, (_, i) => [w[i], h[i]]).flat().filter((c): c is string => c !== undefined))].slice(0, companies);
    // Every company's sample in one round trip, every sampled job's in another (one a company, in turn, took 3 each).
    const samples = (await this.readEach(chosen, (pipeline, companyId) => pipeline.zrandmember(this.deadlinesKey(companyId), perCompany))) as string[][];
    const sampled = chosen.flatMap((companyId, i) => samples[i]!.map((jobId) => ({ companyId, jobId })));
    if (!sampled.length) return 0;
    const replies = await this.readEach(
      sampled.map(({ jobId }) => jobId),
      (pipeline, jobId) => pipeline.hexists(this.jobKey(jobId), 'finishedOn').exists(this.jobKey(jobId)),
    );
    const ended = sampled.filter((_, i) => replies[i * 2] === 1 || replies[i * 2 + 1] === 0);
    await Promise.all(ended.map(({ companyId, jobId }) => this.forgetEnded(companyId, [jobId])));
    return ended.length;
  }

  /**
   * An attempt asks to start; `lockToken` is the BullMQ lock it holds the job with, `companyId`
   * the job's (a rerun joining its lane leaves its company's reruns on their way).
   */
  async acquire(laneId: string, jobId: string, lockToken: string, companyId = ''): Promise<AcquireResult> {
    const r = (await this.run('lane-acquire', ...this.keys(laneId), this.jobKey(jobId), this.lockKey(jobId), this.rerunsKey(companyId), this.deadlinesKey(companyId), jobId, laneId, Date.now(), lockToken)) as [string, string?];
    switch (r[0]) {
      case 'run':
        return { kind: 'run', token: String(r[1]) };
      case 'park':
        return { kind: 'park' };
      case 'done':
        return { kind: 'done', outcome: JSON.parse(String(r[1])) as LaneOutcome };
      case 'gone':
        return { kind: 'gone' };
      case 'stale':
        return { kind: 'stale' };
      default:
        return { kind: 'orphan' };
    }
  }

  /**
   * Ends the holder's turn and hands off the next job. `fetchFollows`: this worker's own
   * fetch of its next job follows on the same connection (see handOff in includes/lane.lua).
   * `historyEntry` (from historyEntry in lease-history.ts) goes into the lease's history in
   * the same step.
   */
  /** `ownIdSandbox`: an acquire's sandbox whose id is its lease's own, to note as the lease's acquired one (lane-release.lua). */
  async release(laneId: string, jobId: string, token: string, outcome: LaneOutcome, fetchFollows = false, acquire = false, historyEntry = '', companyId = '', ownIdSandbox = ''): Promise<ReleaseResult> {
    const [bytesHeld, bytesOfCompany] = companyBytesKeys(this.prefix, companyId);
    const r = (await this.run(
      'lane-release',
      ...this.keys(laneId),
      this.jobKey(jobId),
      this.acquiresKey,
      historyKey(this.prefix, laneId),
      this.attentionScopeKey,
      bytesHeld,
      bytesOfCompany,
      leaseRecordKey(this.prefix, laneId),
      this.deadlinesKey(companyId),
      jobId,
      token,
      JSON.stringify(outcome),
      laneId,
      Date.now(),
      this.queueKeyPrefix,
      fetchFollows ? '1' : '0',
      outcome.status === 'failed' ? '1' : '0',
      this.keepFailedMs,
      acquire && outcome.status === 'completed' ? '1' : '0',
      historyEntry,
      companyId,
      ENDED_ALLOWANCE_BYTES,
      ownIdSandbox,
      RECORD_TTL_S,
    )) as string[];
    if (r[0] === 'stale') return { kind: 'stale' };
    if (r[0] === 'cancelled') return { kind: 'cancelled' };
    if (r[0] === 'next') return { kind: 'next', handOff: toHandOff(r[1], r[2]) };
    return { kind: 'idle' };
  }

  /**
   * Whether a release recorded this job's completion in the run of it BullMQ has not finished
   * (`attemptsMade` as its attempt read it), as lane-acquire reads a recorded outcome: then it
   * ended, whatever a later run of the same release answered (a second run, sent again after
   * a lost reply, finds the lane moved on and answers stale).
   */
  async releasedCompleted(jobId: string, attemptsMade: number): Promise<boolean> {
    const [outcome, atm] = await this.client.hmget(this.jobKey(jobId), 'lo:outcome', 'lo:released-atm');
    if (typeof outcome !== 'string' || atm !== String(attemptsMade)) return false;
    try {
      return (JSON.parse(outcome) as { status?: unknown }).status === 'completed';
    } catch {
      return false;
    }
  }

  /** Before a retry's backoff: keep the head, stop being the holder. False if stale. `historyEntry` as for release. */
  async yield(laneId: string, jobId: string, token: string, retryAt: number, historyEntry = ''): Promise<boolean> {
    return (await this.run('lane-yield', ...this.keys(laneId), historyKey(this.prefix, laneId), jobId, token, this.queueKeyPrefix, retryAt, laneId, Date.now(), historyEntry)) === 1;
  }

  /**
   * Takes a job that is not executing out of its lane, recording the outcome the caller
   * decided. `lockToken`: the attempt dropping its own job, refused if it lost the job's lock.
   */
  async drop(laneId: string, jobId: string, outcome: LaneOutcome, refuseActive = false, lockToken = '', companyId = ''): Promise<DropResult> {
    const r = (await this.run(
      'lane-drop',
      ...this.keys(laneId),
      this.jobKey(jobId),
      this.lockKey(jobId),
      this.attentionScopeKey,
      this.deadlinesKey(companyId),
      jobId,
      laneId,
      Date.now(),
      this.queueKeyPrefix,
      JSON.stringify(outcome),
      this.keepFailedMs,
      refuseActive ? '1' : '0',
      lockToken,
    )) as string[];
    if (r[0] === 'stale') return { kind: 'stale' };
    if (r[0] === 'executing') return { kind: 'executing' };
    if (r[0] === 'absent') return { kind: 'absent' };
    return { kind: 'dropped', next: r[1] === 'next' ? toHandOff(r[2], r[3]) : null };
  }

  /** The one recovery step (see lane-repair.lua); `parked`: a job that just parked itself. */
  async repair(laneId: string, parked = ''): Promise<RepairResult> {
    return toRepairResult((await this.run('lane-repair', ...this.keys(laneId), laneId, Date.now(), this.queueKeyPrefix, parked)) as string[]);
  }

  /** `repair` for many lanes, in one round trip; each repair is still its own atomic step. */
  async repairMany(laneIds: string[]): Promise<RepairResult[]> {
    const pipeline = this.client.pipeline() as unknown as Record<string, (...args: (string | number)[]) => unknown> & { exec(): Promise<[Error | null, unknown][] | null> };
    const command = luaCommandName('lane-repair');
    const now = Date.now();
    for (const laneId of laneIds) pipeline[command]!(...this.keys(laneId), laneId, now, this.queueKeyPrefix, '');
    const replies = (await pipeline.exec()) ?? [];
    return replies.map(([err, reply]) => {
      if (err) throw err;
      return toRepairResult(reply as string[]);
    });
  }

  async quietLaneCount(olderThan: number): Promise<number> {
    return this.client.zcount(this.lanesKey, '-inf', olderThan);
  }

  /** Lanes that showed no progress since `olderThan` (epoch ms), oldest first. */
  /** Every lane with work (its id), in one read. */
  async allLanes(): Promise<string[]> {
    return this.client.zrange(this.lanesKey, 0, -1);
  }

  async quietLanes(olderThan: number, limit = 500, offset = 0): Promise<string[]> {
    return this.client.zrangebyscore(this.lanesKey, '-inf', olderThan, 'LIMIT', offset, limit);
  }

  async view(laneId: string): Promise<{ jobs: string[]; holder: { job: string; token: string } | null }> {
    const [jobs, exec] = await Promise.all([this.client.lrange(this.listKey(laneId), 0, -1), this.client.hgetall(this.execKey(laneId))]);
    return { jobs, holder: exec.job && exec.token ? { job: exec.job, token: exec.token } : null };
  }

  /**
   * Pauses a lane: the executing operation (if any) finishes, nothing new starts, and
   * operations keep being accepted and queued (a queued one whose deadline passes fails as
   * usual). False when it was paused already.
   */
  async pause(laneId: string, by: string, at: number, lease: LeaseIdentity, budget: { max: number; enforce: boolean } = { max: 0, enforce: false }): Promise<PauseOutcome> {
    // The lease goes with it: attention names a paused lane's lease when nothing of it is queued or seen yet.
    const [outcome, count] = (await luaCommand(this.client, 'lane-pause', 3, this.prefix)(this.pausedKey, this.pausedByCompanyKey, this.attentionScopeKey, laneId, JSON.stringify({ by, since: at, lease }), lease.companyId, budget.max, budget.enforce ? '1' : '0', `${lease.companyId}\n${lease.environmentId}\n${laneId}`)) as [PauseOutcome['outcome'], number];
    return { outcome, count: Number(count) };
  }

  /** Paused lanes by company (a company's count against LEASE_OPS_MAX_PAUSED_PER_COMPANY). */
  async pausedByCompany(companyId: string): Promise<number> {
    return Number((await this.client.hget(this.pausedByCompanyKey, companyId)) ?? 0);
  }

  /** Unpauses a lane and hands its head to the workers. False when it was not paused. */
  async unpause(laneId: string): Promise<boolean> {
    const was = Number(await luaCommand(this.client, 'lane-unpause', 2, this.prefix)(this.pausedKey, this.pausedByCompanyKey, laneId)) === 1;
    await this.repair(laneId);
    return was;
  }

  /** Paused lanes, a page at a time (HSCAN: a cursor, `'0'` when done), with who paused each and since when. */
  async pausedLanes(cursor: string, count: number): Promise<{ next: string; lanes: { laneId: string; by: string; since: number; lease: LeaseIdentity | null }[] }> {
    const [next, flat] = await this.client.hscan(this.pausedKey, cursor, 'COUNT', count);
    const lanes: { laneId: string; by: string; since: number; lease: LeaseIdentity | null }[] = [];
    for (let i = 0; i + 1 < flat.length; i += 2) lanes.push({ laneId: flat[i]!, ...parsePause(flat[i + 1]!), lease: pausedLease(flat[i + 1]!) });
    return { next, lanes };
  }

  /**
   * Operations waiting in paused lanes, by where BullMQ holds them: parked (queued) or backing
   * off, both in its delayed set. A head handed off before the pause (the holder), or a rerun
   * no worker has taken yet, is in its wait list: ready, as its own view says.
   */
  async waitingInPausedLanes(): Promise<{ parked: number; backingOff: number }> {
    let cursor = '0';
    let parked = 0;
    let backingOff = 0;
    do {
      const [next, flat] = await this.client.hscan(this.pausedKey, cursor, 'COUNT', 500);
      cursor = next;
      const laneIds = flat.filter((_, i) => i % 2 === 0);
      if (!laneIds.length) continue;
      const lanes = this.client.pipeline();
      for (const laneId of laneIds) lanes.lrange(this.listKey(laneId), 0, -1).hget(this.execKey(laneId), 'job');
      const replies = ((await lanes.exec()) ?? []).map(([, value]) => value);
      // Every job of the lane but its holder: a retry that a force-stop went ahead of still backs off behind it.
      const waiting: string[] = [];
      for (let i = 0; i < laneIds.length; i++) {
        const [jobs, holder] = [replies[2 * i], replies[2 * i + 1]];
        if (Array.isArray(jobs)) waiting.push(...(jobs as string[]).filter((jobId) => jobId !== holder));
      }
      if (!waiting.length) continue;
      const scores = this.client.pipeline();
      for (const jobId of waiting) scores.zscore(`${this.queueKeyPrefix}delayed`, jobId).zscore(this.backingOffKey, jobId);
      const held = ((await scores.exec()) ?? []).map(([, score]) => score);
      for (let i = 0; i < waiting.length; i++) {
        if (held[2 * i] === null) continue;
        if (held[2 * i + 1] === null) parked++;
        else backingOff++;
      }
    } while (cursor !== '0');
    return { parked, backingOff };
  }

  async pausedCount(): Promise<number> {
    return this.client.hlen(this.pausedKey);
  }

  /** Who paused the lane and since when (epoch ms), or null. */
  async pausedBy(laneId: string): Promise<{ by: string; since: number } | null> {
    const text = await this.client.hget(this.pausedKey, laneId);
    return text ? parsePause(text) : null;
  }

  /** The lane's newest failure not yet made good (or acknowledged): when, which job; null if none. */
  async lastFailure(laneId: string): Promise<{ jobId: string; at: number } | null> {
    return parseFailures(await this.client.hget(this.failuresKey, laneId))[0] ?? null;
  }

  /**
   * Lanes with failures to attend to, newest first: `limit` of them from `offset`, each with
   * every kind of operation that failed (newest first) since that kind last succeeded.
   */
  async failures(limit = 200, offset = 0): Promise<{ laneId: string; jobId: string; at: number; kinds: Failure[] }[]> {
    const lanes = await this.client.zrevrange(this.failuresAtKey, offset, offset + limit - 1);
    if (!lanes.length) return [];
    const entries = await this.client.hmget(this.failuresKey, ...lanes);
    return lanes.flatMap((laneId, i) => {
      const kinds = parseFailures(entries[i] ?? null);
      return kinds.length ? [{ laneId, jobId: kinds[0]!.jobId, at: kinds[0]!.at, kinds }] : [];
    });
  }

  /** Takes a lane's failures off the attention list (an operator saw them); what was acknowledged. */
  async acknowledgeFailures(laneId: string): Promise<Failure[]> {
    const text = (await this.run('failures-ack', this.failuresKey, this.failuresAtKey, laneId)) as string | null;
    return parseFailures(text);
  }

  async failureCount(): Promise<number> {
    return this.client.zcard(this.failuresAtKey);
  }

  /** Jobs backing off before a retry (kept by lane-yield, cleared when their next attempt starts). */
  async backingOffCount(): Promise<number> {
    return this.client.zcard(this.backingOffKey);
  }

  async openLaneCount(): Promise<number> {
    return this.client.zcard(this.lanesKey);
  }
}

/** A failure of one kind of operation, not yet made good by a success of that kind. */
export interface Failure {
  op: string;
  jobId: string;
  at: number;
}

/** A failures entry (JSON kinds, or the older '<ms> <jobId>'), newest first. */
export function parseFailures(entry: string | null | undefined): Failure[] {
  if (!entry) return [];
  const space = /^(\d+) (.+)$/.exec(entry);
  if (space) return [{ op: '?', at: Number(space[1]), jobId: space[2]! }];
  try {
    const kinds = JSON.parse(entry) as Record<string, { at?: unknown; job?: unknown }>;
    return Object.entries(kinds)
      .filter(([, v]) => typeof v?.at === 'number' && typeof v?.job === 'string')
      .map(([op, v]) => ({ op, at: v.at as number, jobId: v.job as string }))
      .sort((a, b) => b.at - a.at);
  } catch {
    return [];
  }
}

/** A pause as the paused hash holds it (JSON `{by, since}`); what cannot be read says so. */
export function parsePause(text: string): { by: string; since: number } {
  try {
    const parsed = JSON.parse(text) as { by?: unknown; since?: unknown };
    return { by: typeof parsed.by === 'string' ? parsed.by : 'unknown', since: typeof parsed.since === 'number' ? parsed.since : 0 };
  } catch {
    return { by: 'unknown', since: 0 };
  }
}

/** The lease a pause was asked for, when its entry records it (pauses from before it did do not). */
export function pausedLease(text: string): LeaseIdentity | null {
  try {
    const parsed = LeaseIdentitySchema.safeParse((JSON.parse(text) as { lease?: unknown }).lease);
    return parsed.success ? parsed.data : null;
  } catch {
    return null;
  }
}

function toRepairResult(r: string[]): RepairResult {
  switch (r[0]) {
    case 'forgotten':
      return { kind: 'forgotten' };
    case 'dropped':
      return { kind: 'dropped', jobId: String(r[1]), next: r[2] === 'next' ? toHandOff(r[3], r[4]) : null };
    case 'handed':
      return { kind: 'handed', jobId: String(r[1]), result: String(r[2]) };
    case 'paused':
      return { kind: 'paused', jobId: String(r[1]) };
    default:
      return { kind: 'healthy' };
  }
}

function toHandOff(jobId: unknown, result: unknown): HandOff {
  return { jobId: String(jobId), result: result === 'promoted' || result === 'held' ? result : 'elsewhere' };
}

/** The same items in an order drawn at random (Fisher-Yates). */
function shuffled<T>(items: readonly T[]): T[] {
  const out = [...items];
  for (let i = out.length - 1; i > 0; i--) {
    const j = Math.floor(Math.random() * (i + 1));
    [out[i], out[j]] = [out[j]!, out[i]!];
  }
  return out;
}
