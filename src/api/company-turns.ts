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

  constructor(private readonly perCompany: number) {}

  /**
   * Runs `go` once `company` has a turn free. The handle's `done` gives the turn back, or takes
   * the request out of line if it has not had one yet; calling it again does nothing.
   */
  take(company: string, go: () => void): { done: () => void } {
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
      entry.go();
    } else {
      const line = this.waiting.get(company) ?? [];
      line.push(entry);
      this.waiting.set(company, line);
    }
    return { done };
  }

  /** Requests waiting for a turn now, in all (for /metrics). */
  waitingCount(): number {
    let n = 0;
    for (const line of this.waiting.values()) n += line.filter((e) => !e.cancelled).length;
    return n;
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
