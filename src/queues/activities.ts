import { randomBytes } from 'node:crypto';
import type { LeaseIdentity } from '../lease.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import type { RedisClient } from './redis.ts';

/** Kinds and TTLs callers may give an activity. */
export const MAX_ACTIVITY_TTL_MS = 3_600_000;
export const MIN_ACTIVITY_TTL_MS = 1_000;

export type BeginResult = { kind: 'begun'; token: string; expiresAt: number } | { kind: 'closing'; jobId: string; op: string };

/** What an operation of a lease waits for before it touches the sandbox (activity-gate.lua). */
export interface GateState {
  /** Open activities it waits for. */
  waiting: number;
  /** The kinds of the first few. */
  kinds: string[];
  /** When the oldest began (Redis' clock, ms). */
  oldestSince: number;
  now: number;
}

/**
 * Activity gates: work inside a lease's sandbox (an exec the agent started, a sync) is
 * declared with a token, kept alive by heartbeats, and ended; a stop, release or destroy of
 * the lease waits, in its lane and within its deadline, until the open ones end (asking them
 * to cancel first with cancelActiveWork), and refuses new ones while it is queued or runs. A
 * holder that died is gone at its TTL. Keys: <prefix>:activity:<laneId> (see
 * lua/includes/activities.lua); a token is `<laneId>.<random>`, so it names its lease's lane.
 */
export class Activities {
  private readonly beginScript: LuaCommand;
  private readonly heartbeatScript: LuaCommand;
  private readonly gateScript: LuaCommand;

  constructor(
    private readonly redis: RedisClient,
    private readonly prefix: string,
    /** The BullMQ queue's key prefix: a job's hash is this plus its id. */
    private readonly queueKeyPrefix: string,
  ) {
    this.beginScript = luaCommand(redis, 'activity-begin', 2);
    this.heartbeatScript = luaCommand(redis, 'activity-heartbeat', 1);
    this.gateScript = luaCommand(redis, 'activity-gate', 1);
  }

  key(laneId: string): string {
    return `${this.prefix}:activity:${laneId}`;
  }

  /** Begins an activity in the lane `laneId` (the lease's, by either of its names), unless the lease is closing. */
  async begin(laneId: string, lease: LeaseIdentity, kind: string, ttlMs: number): Promise<BeginResult> {
    const token = `${laneId}.${randomBytes(18).toString('base64url')}`;
    const r = (await this.beginScript(`${this.prefix}:lane:${laneId}`, this.key(laneId), this.queueKeyPrefix, token, kind, ttlMs, JSON.stringify(lease))) as string[];
    if (r[0] === 'closing') return { kind: 'closing', jobId: String(r[1]), op: String(r[2]) };
    return { kind: 'begun', token, expiresAt: Number(r[1]) };
  }

  /** Extends an open activity; whether a cancel was asked. Null once it is gone (ended, or past its TTL). */
  async heartbeat(token: string, ttlMs: number): Promise<{ expiresAt: number; cancel: boolean } | null> {
    const laneId = laneOfToken(token);
    if (!laneId) return null;
    const r = (await this.heartbeatScript(this.key(laneId), token, ttlMs)) as string[];
    return r[0] === 'ok' ? { expiresAt: Number(r[1]), cancel: r[2] === '1' } : null;
  }

  /** Ends an activity; false when it was gone already. */
  async end(token: string): Promise<boolean> {
    const laneId = laneOfToken(token);
    if (!laneId) return false;
    return (await this.redis.hdel(this.key(laneId), token)) === 1;
  }

  /** The lease an activity was begun on (for a caller's scope), or null once it is gone. */
  async leaseOf(token: string): Promise<LeaseIdentity | null> {
    const laneId = laneOfToken(token);
    if (!laneId) return null;
    const value = await this.redis.hget(this.key(laneId), token);
    if (!value) return null;
    try {
      const info = JSON.parse(value) as { lease?: unknown; expiresAt?: unknown };
      if (typeof info.expiresAt !== 'number' || info.expiresAt <= Date.now() - 5_000 || typeof info.lease !== 'string') return null;
      return JSON.parse(info.lease) as LeaseIdentity;
    } catch {
      return null;
    }
  }

  /** What an operation waits for (see GateState): `close` for a stop, release or destroy; `resume` for a resume. */
  async gate(laneId: string, mode: 'close' | 'resume', cancel: boolean): Promise<GateState> {
    const r = (await this.gateScript(this.key(laneId), mode, cancel ? '1' : '0')) as [number, string, string, string];
    return { waiting: Number(r[0]), kinds: r[1] ? r[1].split(',') : [], oldestSince: Number(r[2]), now: Number(r[3]) };
  }
}

/** A token's lane id, or null for a string that is no token. */
export function laneOfToken(token: string): string | null {
  return /^[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{24}$/.test(token) ? token.slice(0, 22) : null;
}
