import { RETRY_SPREAD_S } from './company-rates.ts';
import { HttpError } from './http-error.ts';

/**
 * Requests that hold their connection while they wait (a long poll, Prefer: wait, an exec),
 * counted per company and in all. A company's waits are bounded so one tenant cannot hold
 * every socket; the server's are bounded below its connection cap, so /healthz, /readyz and
 * other requests always find a connection.
 */
export class WaitBudget {
  private readonly held = new Map<string, number>();
  private total = 0;
  /** Waits refused so far, by which budget was full (for /metrics). */
  readonly refused = { company: 0, server: 0 };

  constructor(
    private readonly limits: { perCompany: number; total: number },
    private readonly random: () => number = Math.random,
  ) {}

  /** Takes a wait for `company`, or says which budget is full. `release` gives it back (once). */
  take(company: string): { release: () => void } | { full: 'company' | 'server' } {
    const mine = this.held.get(company) ?? 0;
    if (mine >= this.limits.perCompany) {
      this.refused.company++;
      return { full: 'company' };
    }
    if (this.total >= this.limits.total) {
      this.refused.server++;
      return { full: 'server' };
    }
    this.held.set(company, mine + 1);
    this.total++;
    let released = false;
    return {
      release: () => {
        if (released) return;
        released = true;
        this.total--;
        const left = (this.held.get(company) ?? 1) - 1;
        if (left > 0) this.held.set(company, left);
        else this.held.delete(company);
      },
    };
  }

  /** Like take, but a full budget is a 429 with its code (`company_waits_full`, `server_waits_full`). */
  takeOrRefuse(company: string): () => void {
    const taken = this.take(company);
    if ('full' in taken) {
      throw new HttpError(
        429,
        taken.full === 'company' ? 'company_waits_full' : 'server_waits_full',
        taken.full === 'company'
          ? `the company already holds ${this.limits.perCompany} waiting requests (LEASE_OPS_API_MAX_WAITS_PER_COMPANY): retry, or poll without waitMs`
          : `the API already holds ${this.limits.total} waiting requests (LEASE_OPS_API_MAX_WAITS): retry, or poll without waitMs`,
        // 1 s and up to RETRY_SPREAD_S more at random: a company's polls refused together do not come back together.
        { retryAfterS: 1 + Math.floor(this.random() * (RETRY_SPREAD_S + 1)) },
      );
    }
    return taken.release;
  }

  /**
   * How long a wait of `waitMs` is held: up to a tenth less, at random. A wait is "up to" its
   * time, so ending early keeps its contract; polls begun together (one company's hundred)
   * then time out apart, and so do the polls their clients send again at once (issue 27: they
   * timed out together every 30 s, and the API's event loop was held up to 109 ms in one run).
   */
  spread(waitMs: number): number {
    return waitMs - Math.floor(this.random() * (waitMs / 10));
  }

  /** Waits held now: in all, and by the company holding the most. */
  usage(): { total: number; busiestCompany: number } {
    return { total: this.total, busiestCompany: Math.max(0, ...this.held.values()) };
  }
}
