import { HttpError } from './http-error.ts';

/** What a request costs its company: a cheap read, a walk over many records, or a change. */
export type RequestClass = 'read' | 'walk' | 'write';

export type CompanyRates = Record<RequestClass, { perSecond: number; burst: number }>;

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
  ) {}

  /** Takes one request's token for `company`, or throws the 429. */
  take(company: string, kind: RequestClass): void {
    const { perSecond, burst } = this.rates[kind];
    if (perSecond <= 0) return;
    const key = `${kind}\n${company}`;
    const now = this.now();
    const bucket = this.buckets.get(key) ?? { tokens: burst, at: now };
    bucket.tokens = Math.min(burst, bucket.tokens + ((now - bucket.at) / 1000) * perSecond);
    bucket.at = now;
    if (bucket.tokens < 1) {
      this.buckets.set(key, bucket);
      this.refused++;
      const waitS = Math.max(1, Math.ceil((1 - bucket.tokens) / perSecond));
      throw new HttpError(429, 'company_rate_limited', `the company sends more ${kind} requests than its rate (${perSecond}/s, LEASE_OPS_API_COMPANY_RATES)`, { retryAfterS: waitS });
    }
    bucket.tokens -= 1;
    this.buckets.set(key, bucket);
    // Full buckets tell nothing: let them go, so the map holds only companies that are busy now.
    if (this.buckets.size > 10_000) for (const [k, b] of this.buckets) if (b.tokens >= this.rates[k.slice(0, k.indexOf('\n')) as RequestClass].burst) this.buckets.delete(k);
  }
}
