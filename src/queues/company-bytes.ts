import { CompanyBytesFullError } from '../errors.ts';
import { historyKey } from './lease-history.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import type { RedisClient } from './redis.ts';

/**
 * What an accepted operation holds in Redis besides its data, while it waits: its job hash's
 * other fields (options, BullMQ's bookkeeping) and its first events.
 */
export const ACCEPTED_ALLOWANCE_BYTES = 1_536;
/**
 * What it holds more once it ran (lane-release.lua adds it, with its outcome): the errors and
 * stacks of its attempts, their events in its lease's history, its end. Measured in
 * test/company-bytes.test.ts: a failed operation with 15 KB of metadata and four attempts held
 * its data plus about 5.1 KB in all.
 */
export const ENDED_ALLOWANCE_BYTES = 5_120;

/** Bytes held by company (a hash), and one company's counted jobs (job id -> bytes, and in order). */
export function companyBytesKeys(prefix: string, company: string): [string, string, string] {
  return [`${prefix}:bytes`, `${prefix}:bytes:${company}`, `${prefix}:bytes-order:${company}`];
}

/**
 * Of an operation's count, what its events in its lease's history hold: when its record goes
 * at the budget, this much stays counted on the history (its events stay there) until the
 * history expires or goes too. A lease's events took about 1.6 KB an operation.
 */
const HISTORY_SHARE_BYTES = 2_048;

/** Oldest counted jobs looked at per try to make room (one round trip, bounded work). */
const REVIEWED = 200;
/**
 * Room made beyond what one enqueue needs, as a share of the budget: a company that lives at
 * its budget pays for making room once per many enqueues, not on each.
 */
const HEADROOM = 0.1;
/** Tries to make room per enqueue, at most. */
const MAX_ROUNDS = 8;

/**
 * A company's bytes budget (issue 27): every accepted operation is counted, its data plus
 * ACCEPTED_ALLOWANCE_BYTES, and when it ends ENDED_ALLOWANCE_BYTES and twice its outcome
 * (BullMQ's return value and the lane's record of it; lane-release.lua), until its job is gone:
 * a queue of thousands waiting is counted at little more than their data. At the budget, the
 * company's oldest ended operations lose their records before their retention (a retention at
 * the budget); when its live operations alone fill it, the enqueue is refused
 * (CompanyBytesFullError).
 *
 * A count is taken back lazily: only when the company is at its budget are its oldest counted
 * jobs looked at, and those gone (removed after their retention, refused, dropped) forgotten.
 * A removed record's events stay in its lease's history, and so does part of its count, on
 * the history ("h:<laneId>"), which goes the same way when it is the oldest.
 * So the count is never below what the company's operations hold, and looking costs nothing
 * until a company is at its budget.
 */
export class CompanyBytes {
  private readonly admitScript: LuaCommand;
  private readonly reviewScript: LuaCommand;
  private readonly evictScript: LuaCommand;
  /** Bytes held, by company: what /metrics and the overview show. */
  readonly heldKey: string;

  constructor(
    private readonly connection: RedisClient,
    private readonly prefix: string,
    /** BullMQ's key prefix of the queue's jobs ("<prefix>:<queue>:"). */
    private readonly jobKeyPrefix: string,
  ) {
    this.admitScript = luaCommand(connection, 'bytes-admit', 3);
    this.reviewScript = luaCommand(connection, 'bytes-review', 'varies');
    this.evictScript = luaCommand(connection, 'bytes-evict', 'varies');
    this.heldKey = companyBytesKeys(prefix, '')[0];
  }

  private keysOf(company: string): [string, string, string] {
    return companyBytesKeys(this.prefix, company);
  }

  /**
   * Counts `bytes` of job `jobId` against `company`'s budget (0: none), making room by removing
   * the records of its oldest ended operations if it must; CompanyBytesFullError if that is not
   * enough.
   */
  async admit(company: string, jobId: string, bytes: number, budget: number): Promise<void> {
    const keys = this.keysOf(company);
    // Concurrent enqueues of one company may pick the same records to remove: one that lost
    // that race tries again; one that found nothing left to remove is refused.
    for (let round = 0; ; round++) {
      const [verdict, held] = (await this.admitScript(...keys, company, jobId, bytes, budget, Date.now())) as [string, number];
      if (verdict === 'ok') return;
      const room = await this.makeRoom(company, held, held + bytes - budget + Math.ceil(budget * HEADROOM));
      if (room === 'none' || round === MAX_ROUNDS) throw new CompanyBytesFullError(held, budget);
    }
  }

  /**
   * Frees `needed` bytes of `company`'s count (`held` now) as far as its oldest counted jobs
   * allow: those gone are forgotten, then the oldest ended ones removed. 'raced' when the
   * records it picked were removed by another enqueue first; 'none' when nothing could go.
   */
  private async makeRoom(company: string, held: number, needed: number): Promise<'freed' | 'raced' | 'none'> {
    const keys = this.keysOf(company);
    const oldest = await this.connection.zrange(keys[2], 0, REVIEWED - 1);
    if (oldest.length === 0) return 'none';
    const review = (await this.reviewScript(keys.length + oldest.length, ...keys, ...oldest.map((id) => this.keyOf(id)), company, ...oldest)) as (string | number)[];
    const forgotten = held - Number(review[0]);
    let stillNeeded = needed - forgotten;
    const victims: string[] = [];
    for (let i = 1; i + 1 < review.length && stillNeeded > 0; i += 2) {
      victims.push(String(review[i]));
      stillNeeded -= Number(review[i + 1]);
    }
    if (victims.length === 0) return forgotten > 0 ? 'freed' : 'none';
    const [, removed] = (await this.evictScript(
      5 + 2 * victims.length,
      ...keys,
      `${this.jobKeyPrefix}completed`,
      `${this.jobKeyPrefix}failed`,
      ...victims.flatMap((id) => (id.startsWith('h:') ? [this.keyOf(id), this.keyOf(id)] : [this.jobKeyPrefix + id, `${this.jobKeyPrefix}${id}:logs`])),
      company,
      HISTORY_SHARE_BYTES,
      Date.now(),
      ...victims,
    )) as [number, number];
    return forgotten > 0 || removed > 0 ? 'freed' : 'raced';
  }

  /** The key a counted entry stands for: a job's hash, or ("h:<laneId>") a lease's history. */
  private keyOf(id: string): string {
    return id.startsWith('h:') ? historyKey(this.prefix, id.slice(2)) : this.jobKeyPrefix + id;
  }

  /** Bytes counted for `company` now. */
  async heldOf(company: string): Promise<number> {
    return Number((await this.connection.hget(this.heldKey, company)) ?? 0);
  }

  /** Bytes counted for every company that holds some. */
  async held(): Promise<Record<string, number>> {
    const all = await this.connection.hgetall(this.heldKey);
    return Object.fromEntries(Object.entries(all).map(([company, bytes]) => [company, Number(bytes)]));
  }
}
