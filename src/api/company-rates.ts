import type { IncomingHttpHeaders } from 'node:http';
import { HttpError } from './http-error.ts';

/** What a request costs its company: a cheap read, a walk over many records, or a change. */
export type RequestClass = 'read' | 'walk' | 'write';

export type CompanyRates = Record<RequestClass, { perSecond: number; burst: number }>;

/**
 * What a change's body adds to its cost: one token more for each 4 KiB (a 16 KiB enqueue costs
 * 5). What a change costs the API, the workers and Redis grows with its body (issue 27: 16 KiB
 * of metadata at the write rate put B's p99 at 4-9x); a body of unknown length counts as the
 * largest the API takes (64 KiB), and so does a compressed one.
 */
export function costOfBody(headers: IncomingHttpHeaders): number {
  const length = headers['content-length'];
  if (length === undefined && headers['transfer-encoding'] === undefined) return 1;
  // A compressed body's length says nothing of what it inflates to (up to 64 KiB): counted as that
  // (helper-17: 16 KB of metadata sent gzipped as 120 bytes passed at a small one's cost).
  const encoding = headers['content-encoding'];
  const encoded = encoding !== undefined && encoding.trim().toLowerCase() !== 'identity';
  const bytes = !encoded && length !== undefined && /^\d+$/.test(length) ? Number(length) : 64 * 1024;
  return 1 + Math.floor(bytes / 4096);
}

/**
 * A walk counts one token more for each this many Redis commands it sent past its first
 * token (charged when it ends): requests are a poor measure of a walk, whose cost grows with
 * what it reads (issue 27: A's walks over 3,000 failed leases, at A's rate, put B's p99 at
 * 2-4x), so a company's walks are held to a budget of commands, 2,500 a second at the default
 * rate, and a company with short walks keeps its rate of them.
 */
export const WALK_TOKEN_COMMANDS = 500;

/** How far a walk's charge may take its company's bucket below empty: this many seconds of its rate (or its burst, if more). */
export const WALK_DEBT_S = 30;

/** A refused request's Retry-After is its wait and up to this many seconds more, at random. */
export const RETRY_SPREAD_S = 2;

/** Defaults a deployment of about 100 companies can run with on one API replica (docs/security.md). */
export const DEFAULT_COMPANY_RATES: CompanyRates = {
  read: { perSecond: 100, burst: 200 },
  walk: { perSecond: 5, burst: 10 },
  write: { perSecond: 50, burst: 100 },
};

/**
 * A token bucket per company and class of request, in this API process (each replica keeps
 * its own: N replicas let a company N times the rate). A request past its company's bucket
 * is refused at once (429 `company_rate_limited`, with Retry-After), before it reads Redis.
 */
export class CompanyRateLimiter {
  private readonly buckets = new Map<string, { tokens: number; at: number }>();
  /** Requests refused so far (for /metrics). */
  refused = 0;

  constructor(
    private readonly rates: CompanyRates,
    private readonly now: () => number = () => performance.now(),
    private readonly random: () => number = Math.random,
  ) {}

  /**
   * Takes a request's tokens for `company` (one, or `cost`: a change counts its body too, see
   * costOfBody), or throws the 429. Returns what gives them back, for a request refused
   * afterwards for another reason before anything of it was done.
   */
  take(company: string, kind: RequestClass, cost = 1): () => void {
    const { perSecond, burst } = this.rates[kind];
    if (perSecond <= 0) return () => undefined;
    // Never more than a full bucket: a request the bucket could never hold would never pass.
    const tokens = Math.min(Math.max(1, cost), burst);
    const key = `${kind}\n${company}`;
    const now = this.now();
    const bucket = this.buckets.get(key) ?? { tokens: burst, at: now };
    bucket.tokens = Math.min(burst, bucket.tokens + ((now - bucket.at) / 1000) * perSecond);
    bucket.at = now;
    if (bucket.tokens < tokens) {
      this.buckets.set(key, bucket);
      this.refused++;
      // The wait, and 0-2 s more at random: a company's clients refused together (a burst)
      // do not come back together, all at once, each second (issue 27: A's 20 clients did, and
      // B's requests that landed in the burst waited behind it).
      const waitS = Math.max(1, Math.ceil((tokens - bucket.tokens) / perSecond)) + Math.floor(this.random() * (RETRY_SPREAD_S + 1));
      throw new HttpError(429, 'company_rate_limited', `the company sends more ${kind} requests than its rate (${perSecond}/s, LEASE_OPS_API_COMPANY_RATES)`, { retryAfterS: waitS });
    }
    bucket.tokens -= tokens;
    this.buckets.set(key, bucket);
    let given = false;
    const giveBack = () => {
      if (given) return;
      given = true;
      const current = this.buckets.get(key);
      if (current) current.tokens = Math.min(burst, current.tokens + tokens);
    };
    // Full buckets tell nothing: let them go, so the map holds only companies that are busy now.
    if (this.buckets.size > 10_000) for (const [k, b] of this.buckets) if (b.tokens >= this.rates[k.slice(0, k.indexOf('\n')) as RequestClass].burst) this.buckets.delete(k);
    return giveBack;
  }

  /**
   * Counts what a company's walk cost past its first token (WALK_TOKEN_COMMANDS Redis commands
   * a token), once it ended: the bucket may go below empty, down to WALK_DEBT_S seconds of the
   * rate (a walk far past the budget holds its company's next walks that long at most).
   */
  chargeWalk(company: string, commands: number): void {
    const { perSecond, burst } = this.rates.walk;
    const extra = Math.floor(commands / WALK_TOKEN_COMMANDS);
    if (perSecond <= 0 || extra <= 0) return;
    const key = `walk\n${company}`;
    const now = this.now();
    const bucket = this.buckets.get(key) ?? { tokens: burst, at: now };
    bucket.tokens = Math.max(-Math.max(burst, perSecond * WALK_DEBT_S), Math.min(burst, bucket.tokens + ((now - bucket.at) / 1000) * perSecond) - extra);
    bucket.at = now;
    this.buckets.set(key, bucket);
  }
}
