/**
 * Requests a company has in progress in this API process at once. Past that, its next ones
 * wait their turn here, in order, before their body is read: a company that sends a hundred
 * requests at once (its rate's burst) has a few worked on at a time, so another company's
 * request waits behind those few, not behind all of them (issue 27: A's bursts of 16 KiB
 * enqueues put B's enqueue p99 at 4-7x alone). A request that waits for an operation
 * (long poll, Prefer: wait, exec) gives its turn back while it waits.
 */
export class CompanyTurns {
  private readonly inProgress = new Map<string, number>();
  private readonly waiting = new Map<string, { go: () => void; cancelled: boolean }[]>();

  constructor(
    private readonly perCompany: number,
    /** Requests of one company that may wait in line; past them, take answers null (a 429). */
    private readonly maxWaiting = perCompany * 4,
  ) {}

  /**
   * Runs `go` once `company` has a turn free (later, never inside this call). The handle's
   * `done` gives the turn back, or takes the request out of line if it has not had one yet;
   * calling it again does nothing. Null when the company's line is full: the request is
   * refused, so a company cannot hold the server's connections with requests in line
   * (helper-16: 1,000 of them refused /healthz and every other company).
   */
  take(company: string, go: () => void): { done: () => void } | null {
    let state: 'waiting' | 'turn' | 'done' = 'waiting';
    const entry = {
      go: () => {
        state = 'turn';
        go();
      },
      cancelled: false,
    };
    const done = () => {
      if (state === 'turn') this.giveBack(company);
      else if (state === 'waiting') entry.cancelled = true;
      state = 'done';
    };
    if (this.perCompany <= 0 || (this.inProgress.get(company) ?? 0) < this.perCompany) {
      this.inProgress.set(company, (this.inProgress.get(company) ?? 0) + 1);
      // After the caller holds its handle: a `go` that gives the turn back at once finds it.
      queueMicrotask(entry.go);
      return { done };
    }
    const line = (this.waiting.get(company) ?? []).filter((e) => !e.cancelled);
    if (line.length >= this.maxWaiting) return null;
    line.push(entry);
    this.waiting.set(company, line);
    return { done };
  }

  /** Requests with a turn, and requests waiting for one, now, in all companies (for /metrics). */
  usage(): { inProgress: number; waiting: number } {
    let inProgress = 0;
    for (const n of this.inProgress.values()) inProgress += n;
    let waiting = 0;
    for (const line of this.waiting.values()) waiting += line.filter((e) => !e.cancelled).length;
    return { inProgress, waiting };
  }

  private giveBack(company: string): void {
    const line = this.waiting.get(company);
    let next = line?.shift();
    while (next?.cancelled) next = line?.shift();
    if (!line?.length) this.waiting.delete(company);
    if (next) {
      // The turn passes straight to the next in line.
      next.go();
      return;
    }
    const left = (this.inProgress.get(company) ?? 1) - 1;
    if (left > 0) this.inProgress.set(company, left);
    else this.inProgress.delete(company);
  }
}
