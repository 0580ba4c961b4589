import type { Logger } from '../logger.ts';

/**
 * A company's requests refused at its budgets (429 `company_*`), logged as one line per
 * company and code every interval with how many, not one line each: a company sending
 * thousands past its rate would otherwise have the API write thousands of lines for it
 * (each a write to stdout, about 0.2 ms of this process on this machine class). The counts
 * are in /metrics too.
 */
export class RefusalLog {
  private readonly counts = new Map<string, { companyId: string; code: string; refused: number }>();
  private timer: NodeJS.Timeout | null = null;

  constructor(
    private readonly log: Logger,
    private readonly intervalMs = 10_000,
  ) {}

  note(companyId: string, code: string): void {
    const key = `${companyId}\n${code}`;
    const entry = this.counts.get(key);
    if (entry) entry.refused++;
    else {
      // The first of a run is told at once; the rest at the end of the interval.
      this.counts.set(key, { companyId, code, refused: 0 });
      this.log.warn({ companyId, code }, `a request was refused at its company budget; more of this company and code are counted for ${this.intervalMs / 1000} s`);
    }
    this.timer ??= setTimeout(() => this.flush(), this.intervalMs).unref();
  }

  flush(): void {
    this.timer = null;
    for (const { companyId, code, refused } of this.counts.values()) {
      if (refused > 0) this.log.warn({ companyId, code, refused, seconds: this.intervalMs / 1000 }, 'requests refused at their company budget');
    }
    this.counts.clear();
  }
}
