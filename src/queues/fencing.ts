import type { RedisClient } from './redis.ts';
import type { Logger } from '../logger.ts';

/** A provider call refused because its attempt is no longer the lease's current one. */
export class StaleAttemptError extends Error {
  override name = 'StaleAttemptError';
  readonly code = 'stale_attempt';
}

/** One running attempt: its lane, its token, and how to stop it. */
export class Attempt {
  private controller: AbortController | undefined;
  private staleReason: string | null = null;
  /** performance.now() when the lane last confirmed this attempt's token; -Infinity before. */
  private confirmedAt = Number.NEGATIVE_INFINITY;

  constructor(
    readonly jobId: string,
    readonly laneId: string,
    readonly token: string,
  ) {}

  /** Aborted when the attempt turns stale; made only when someone asks for it. */
  get signal(): AbortSignal {
    this.controller ??= new AbortController();
    if (this.staleReason) this.controller.abort(new StaleAttemptError(this.staleReason));
    return this.controller.signal;
  }

  get stale(): boolean {
    return this.staleReason !== null;
  }

  confirmed(): void {
    this.confirmedAt = performance.now();
  }

  /**
   * Synchronous: true while the last confirmation is younger than `maxAgeMs`. A successor
   * can only start once this attempt's lock expired, which takes longer than that, so a
   * request sent while this holds cannot be a stale one, even if the process was paused
   * (SIGSTOP, a long GC) between the check and the send.
   */
  confirmedWithin(maxAgeMs: number): boolean {
    return !this.stale && performance.now() - this.confirmedAt <= maxAgeMs;
  }

  markStale(reason: string): void {
    if (this.staleReason) return;
    this.staleReason = reason;
    this.controller?.abort(new StaleAttemptError(reason));
  }

  staleError(): StaleAttemptError {
    return new StaleAttemptError(`attempt of ${this.jobId} is stale: ${this.staleReason ?? 'superseded'}`);
  }
}

/**
 * Fencing for provider calls. Every attempt holds the lane's token; `check` compares it
 * with the lane's current one before a call leaves the process, and a watcher does the
 * same for all running attempts every `intervalMs`, aborting the signal of any that a newer
 * attempt superseded (or whose BullMQ lock was lost), so in-flight calls are cancelled too.
 */
export class Fencing {
  private readonly running = new Set<Attempt>();
  private timer: NodeJS.Timeout | null = null;

  constructor(
    private readonly redis: RedisClient,
    private readonly execKey: (laneId: string) => string,
    private readonly log: Logger,
    private readonly intervalMs: number,
  ) {}

  start(): void {
    this.timer ??= setInterval(() => void this.sweep(), this.intervalMs);
    this.timer.unref();
  }

  stop(): void {
    if (this.timer) clearInterval(this.timer);
    this.timer = null;
  }

  track(attempt: Attempt): () => void {
    this.running.add(attempt);
    return () => this.running.delete(attempt);
  }

  /** BullMQ could not renew these jobs' locks: their attempts must stop. */
  lockLost(jobIds: string[]): void {
    const lost = new Set(jobIds);
    for (const attempt of this.running) {
      if (lost.has(attempt.jobId)) {
        attempt.markStale('its BullMQ lock was lost');
        this.log.warn({ jobId: attempt.jobId }, 'lock lost; attempt aborted');
      }
    }
  }

  /** Throws StaleAttemptError unless the attempt still holds its lane. */
  async check(attempt: Attempt): Promise<void> {
    if (!attempt.stale) {
      const current = await this.redis.hget(this.execKey(attempt.laneId), 'token');
      if (current !== attempt.token) attempt.markStale('a newer attempt holds the lease');
      else attempt.confirmed();
    }
    if (attempt.stale) throw attempt.staleError();
  }

  private async sweep(): Promise<void> {
    const attempts = [...this.running].filter((a) => !a.stale);
    if (!attempts.length) return;
    try {
      const pipeline = this.redis.pipeline();
      for (const a of attempts) pipeline.hget(this.execKey(a.laneId), 'token');
      const results = (await pipeline.exec()) ?? [];
      attempts.forEach((a, i) => {
        const [err, token] = results[i] ?? [null, null];
        if (!err && token !== a.token) {
          a.markStale('a newer attempt holds the lease');
          this.log.warn({ jobId: a.jobId }, 'attempt superseded; aborted');
        }
      });
    } catch (err) {
      this.log.debug({ err }, 'fence sweep skipped');
    }
  }
}
