import type { RedisClient } from './redis.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { SandboxState } from '../providers/types.ts';
import { historyKey, historyValue } from './lease-history.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';

/**
 * A sandbox on its way to stopped: what the watchdog forces once it has lasted too long, and
 * attention shows as stuck where the provider cannot force it. A provider module that does
 * not say where a transition goes still counts `stopping` as one.
 */
export function isStopping(state: SandboxState): state is Extract<SandboxState, { kind: 'transitioning' }> {
  return state.kind === 'transitioning' && (state.toward === 'stopped' || (state.toward === undefined && state.providerState === 'stopping'));
}

/** What lease-ops last saw of a lease's sandbox. */
export interface LeaseRecord {
  lease: LeaseIdentity;
  providerLeaseId: string;
  kind: SandboxState['kind'];
  providerState: string;
  /** Epoch ms since the sandbox has been in this state (as far as lease-ops saw). */
  since: number;
  observedAt: number;
  /** Force-stops the watchdog queued for the current stuck episode, and the last one's job. */
  forceStops: number;
  forceJob: string | null;
  /** The id the lease's acquire was enqueued under, once that acquire named its sandbox (a second name of the lease). */
  acquiredAs: string | null;
  /** The sandbox the lease's last completed acquire handed out. */
  acquiredSandbox: string | null;
  /** What saw it last was accepted for the company's provider instance (an operation's `instance`). */
  companyInstance: boolean;
}

/** Whether a lease has a live sandbox its acquire handed out: then it is not acquired again. */
export function hasAcquiredSandbox(record: Pick<LeaseRecord, 'acquiredSandbox' | 'providerLeaseId' | 'kind'> | null): boolean {
  return !!record?.acquiredSandbox && record.acquiredSandbox === record.providerLeaseId && record.kind !== 'gone';
}

/** An attempt's hold on its lane, for fenced writes: the lane's holder hash and the attempt's token. */
export interface LaneHold {
  holderKey: string;
  token: string;
}

/** A week without news and the record goes: it is a cache of observations, not a source of truth. */
export const RECORD_TTL_S = 7 * 24 * 3_600;

/** A lease's record: what lease-ops last saw of its sandbox (one hash per lane). */
export function leaseRecordKey(prefix: string, laneId: string): string {
  return `${prefix}:lease:${laneId}`;
}

/**
 * Per-lease records of the observed provider state and since when, updated by every
 * operation that reads its sandbox, and an index of leases seen `stopping` for the
 * watchdog. Keys: <prefix>:lease:<laneId> (hash), <prefix>:stopping (zset).
 */
export class LeaseRecords {
  readonly stoppingKey: string;
  private readonly observeScript: LuaCommand;
  private readonly forceClaimScript: LuaCommand;
  private readonly forceJobScript: LuaCommand;
  private readonly forceUnclaimScript: LuaCommand;
  private readonly acquiredScript: LuaCommand;

  constructor(
    private readonly redis: RedisClient,
    private readonly prefix: string,
  ) {
    this.stoppingKey = `${prefix}:stopping`;
    this.observeScript = luaCommand(redis, 'lease-observe', 5);
    this.acquiredScript = luaCommand(redis, 'lease-acquired', 2);
    this.forceClaimScript = luaCommand(redis, 'lease-force-claim', 1, prefix);
    this.forceJobScript = luaCommand(redis, 'lease-force-job', 1);
    this.forceUnclaimScript = luaCommand(redis, 'lease-force-unclaim', 1, prefix);
  }

  recordKey(laneId: string): string {
    return leaseRecordKey(this.prefix, laneId);
  }

  /**
   * Records an observation; returns since when the sandbox has been in that state, and
   * whether this observation began it (a new stopping episode gets its own stuck check).
   * An attempt's observation is fenced (`held`: its lane's holder key and its token): one
   * that no longer holds the lane records nothing, and gets null.
   */
  async observe(laneId: string, lease: LeaseIdentity, providerLeaseId: string, state: SandboxState, jobId = '', held: LaneHold | null = null, companyInstance = false): Promise<{ since: number; began: boolean; now: number } | null> {
    // A provider's word for the state, bounded: it is kept per lease and shown to callers.
    const providerState = historyValue(('providerState' in state ? state.providerState : state.kind).slice(0, 100));
    const [since, now] = (await this.observeScript(
      this.recordKey(laneId),
      this.stoppingKey,
      historyKey(this.prefix, laneId),
      `${this.prefix}:attention:scope`,
      held?.holderKey ?? this.recordKey(laneId),
      laneId,
      state.kind,
      providerState,
      JSON.stringify(lease),
      providerLeaseId,
      RECORD_TTL_S,
      isStopping(state) ? '1' : '0',
      jobId,
      `${lease.companyId}\n${lease.environmentId}\n${laneId}`,
      held?.token ?? '',
      companyInstance ? '1' : '0',
    )) as [string, string];
    if (since === 'stale') return null;
    return { since: Number(since), began: since === now, now: Number(now) };
  }

  /** Redis' clock (ms): the one `since` is kept in, whatever this process' clock says. */
  async now(): Promise<number> {
    const [seconds, micros] = await this.redis.time();
    return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  }

  async get(laneId: string): Promise<LeaseRecord | null> {
    const h = await this.redis.hgetall(this.recordKey(laneId));
    if (!h.lease || !h.kind) return null;
    return {
      lease: JSON.parse(h.lease) as LeaseIdentity,
      providerLeaseId: h.providerLeaseId ?? '',
      kind: h.kind as SandboxState['kind'],
      providerState: h.providerState ?? '',
      since: Number(h.since),
      observedAt: Number(h.observedAt),
      forceStops: Number(h.forceStops ?? 0),
      forceJob: h.forceJob ?? null,
      acquiredAs: h.acquiredAs ?? null,
      acquiredSandbox: h.acquiredSandbox ?? null,
      companyInstance: h.instance === '1',
    };
  }

  /** The sandbox the lane's record names now ('' or null when none is known). */
  async currentSandbox(laneId: string): Promise<string | null> {
    return this.redis.hget(this.recordKey(laneId), 'providerLeaseId');
  }

  /** The id each lane's acquire was enqueued under (null where none is known), in the order asked. */
  async acquiredAs(laneIds: string[]): Promise<(string | null)[]> {
    const pipeline = this.redis.pipeline();
    for (const laneId of laneIds) pipeline.hget(this.recordKey(laneId), 'acquiredAs');
    const replies = (await pipeline.exec()) ?? [];
    return replies.map(([err, value]) => (err || typeof value !== 'string' ? null : value));
  }

  /** Lanes whose sandbox has been on its way to stopped since before `before` (epoch ms), oldest first, with since when. */
  async stoppingSinceWithScores(before: number, limit = 500, offset = 0): Promise<[string, number][]> {
    const flat = await this.redis.zrangebyscore(this.stoppingKey, '-inf', before, 'WITHSCORES', 'LIMIT', offset, limit);
    const pairs: [string, number][] = [];
    for (let i = 0; i + 1 < flat.length; i += 2) pairs.push([flat[i]!, Number(flat[i + 1])]);
    return pairs;
  }

  /** Since when (epoch ms) a lane's sandbox has been on its way to stopped; null when it is not. */
  async stoppingSince(laneId: string): Promise<number | null> {
    const score = await this.redis.zscore(this.stoppingKey, laneId);
    return score === null ? null : Number(score);
  }

  async stoppingCount(before: number): Promise<number> {
    return this.redis.zcount(this.stoppingKey, '-inf', before);
  }

  async forget(laneId: string): Promise<void> {
    await this.redis.zrem(this.stoppingKey, laneId);
  }

  /**
   * Notes that the lease's acquire (enqueued under `leaseId`) handed out `sandbox`: the lease
   * has a sandbox while the record shows that one and not gone (one lease, one sandbox). A
   * sandbox with the lease's own id is noted by the acquire's release instead (lane-release.lua).
   */
  async noteAcquired(laneId: string, leaseId: string, sandbox: string, held: LaneHold, jobId: string): Promise<boolean> {
    return Number(await this.acquiredScript(this.recordKey(laneId), held.holderKey, held.token, leaseId, sandbox, RECORD_TTL_S, jobId)) === 1;
  }

  /**
   * The lease's live acquired sandbox and the acquire that handed it out (null when there is
   * none, or it was noted before lease-ops kept who): what another acquire's clean-up leaves alone.
   */
  async acquiredLive(laneId: string): Promise<{ sandbox: string; by: string } | null> {
    const [kind, providerLeaseId, acquiredSandbox, acquiredBy] = await this.redis.hmget(this.recordKey(laneId), 'kind', 'providerLeaseId', 'acquiredSandbox', 'acquiredBy');
    if (!acquiredBy || !hasAcquiredSandbox({ kind: kind as LeaseRecord['kind'], providerLeaseId: providerLeaseId ?? '', acquiredSandbox: acquiredSandbox ?? null })) return null;
    return { sandbox: acquiredSandbox!, by: acquiredBy };
  }

  /**
   * Claims force-stop `n` of the episode that began at `since`, before it is queued: false
   * when the record no longer shows what the watchdog decided on (that episode, `n - 1`
   * force-stops, the last one's job `lastJob`), or another replica claimed it first.
   */
  async claimForceStop(laneId: string, since: number, n: number, lastJob: string | null): Promise<boolean> {
    return Number(await this.forceClaimScript(this.recordKey(laneId), since, n, lastJob ?? '')) === 1;
  }

  /**
   * Keeps the job of claimed force-stop `n` on the record; false once the record moved on.
   * (A force-stop queued in the record's own lane is kept as it joins, by lane-push.lua.)
   */
  async noteForceJob(laneId: string, since: number, n: number, jobId: string): Promise<boolean> {
    return Number(await this.forceJobScript(this.recordKey(laneId), since, n, jobId)) === 1;
  }

  /** Gives back claimed force-stop `n` that could not be queued (`lastJob`: the job the record showed before). */
  async unclaimForceStop(laneId: string, since: number, n: number, lastJob: string | null): Promise<boolean> {
    return Number(await this.forceUnclaimScript(this.recordKey(laneId), since, n, lastJob ?? '')) === 1;
  }

}
