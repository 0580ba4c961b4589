import type { RedisClient } from './redis.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { SandboxState } from '../providers/types.ts';
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
  /** Force-stops the watchdog queued for the current stuck episode. */
  forceStops: number;
}

/** A week without news and the record goes: it is a cache of observations, not a source of truth. */
const RECORD_TTL_S = 7 * 24 * 3_600;

/**
 * Per-lease records of the observed provider state and since when, updated by every
 * operation that reads its sandbox, and an index of leases seen `stopping` for the
 * watchdog. Keys: <prefix>:lease:<laneId> (hash), <prefix>:stopping (zset).
 */
export class LeaseRecords {
  readonly stoppingKey: string;
  private readonly observeScript: LuaCommand;

  constructor(
    private readonly redis: RedisClient,
    private readonly prefix: string,
  ) {
    this.stoppingKey = `${prefix}:stopping`;
    this.observeScript = luaCommand(redis, 'lease-observe', 2);
  }

  recordKey(laneId: string): string {
    return `${this.prefix}:lease:${laneId}`;
  }

  private claimKey(laneId: string): string {
    return `${this.prefix}:lane:${laneId}:watchdog`;
  }

  /** Records an observation; returns since when the sandbox has been in that state. */
  async observe(laneId: string, lease: LeaseIdentity, providerLeaseId: string, state: SandboxState): Promise<number> {
    const providerState = 'providerState' in state ? state.providerState : state.kind;
    const since = await this.observeScript(
      this.recordKey(laneId),
      this.stoppingKey,
      laneId,
      Date.now(),
      state.kind,
      providerState,
      JSON.stringify(lease),
      providerLeaseId,
      RECORD_TTL_S,
      isStopping(state) ? '1' : '0',
    );
    return Number(since);
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
    };
  }

  /** Lanes whose sandbox has been seen stopping since before `before` (epoch ms). */
  async stoppingSince(before: number, limit = 500): Promise<string[]> {
    return this.redis.zrangebyscore(this.stoppingKey, '-inf', before, 'LIMIT', 0, limit);
  }

  /** The same, with since when each has been stopping (epoch ms). */
  async stoppingSinceWithScores(before: number, limit = 500): Promise<[string, number][]> {
    const flat = await this.redis.zrangebyscore(this.stoppingKey, '-inf', before, 'WITHSCORES', 'LIMIT', 0, limit);
    const pairs: [string, number][] = [];
    for (let i = 0; i + 1 < flat.length; i += 2) pairs.push([flat[i]!, Number(flat[i + 1])]);
    return pairs;
  }

  async forget(laneId: string): Promise<void> {
    await this.redis.zrem(this.stoppingKey, laneId);
  }

  /**
   * Claims the right to queue one force-stop for this lease for `ttlMs` (one per stuck
   * episode, however many replicas scan); counts it. False if already claimed.
   */
  async claimForceStop(laneId: string, ttlMs: number): Promise<boolean> {
    const claimed = await this.redis.set(this.claimKey(laneId), '1', 'PX', ttlMs, 'NX');
    if (claimed !== 'OK') return false;
    await this.redis.hincrby(this.recordKey(laneId), 'forceStops', 1);
    return true;
  }
}
