import type { Logger } from '../logger.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import { isRedisUnavailable, type RedisClient } from './redis.ts';

/** A provider call refused because its attempt is no longer the lease's current one. */
export class StaleAttemptError extends Error {
  override name = 'StaleAttemptError';
  readonly code = 'stale_attempt';
}

/** One running attempt: its lane, its token, and how to stop it. */
export class Attempt {
  private controller: AbortController | undefined;
  private staleReason: string | null = null;
  /** Told when the attempt turns stale (see whenStale): a set, not the signal's listeners, which warn past ten. */
  private readonly staleListeners = new Set<() => void>();
  /** Set by abandon(): the attempt's end is not to be written. */
  abandoned = false;
  /** performance.now() until which no successor can have started (see fence-check.lua). */
  private freshUntil = Number.NEGATIVE_INFINITY;

  constructor(
    readonly jobId: string,
    readonly laneId: string,
    readonly token: string,
    /** The BullMQ lock token this attempt's worker holds the job with. */
    readonly lockToken: string,
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

  /**
   * The lane confirmed this attempt with `lockMsLeft` on its lock, for a check sent at
   * `sentAt`: no successor can start before sentAt + lockMsLeft. A margin covers the
   * clocks of Redis and this process running at slightly different rates.
   */
  confirmed(sentAt: number, lockMsLeft: number): void {
    this.freshUntil = lockMsLeft > 0 ? sentAt + lockMsLeft * 0.8 : Number.NEGATIVE_INFINITY;
  }

  /** Forgets the last confirmation: the next request waits for a new check. */
  unconfirmed(): void {
    this.freshUntil = Number.NEGATIVE_INFINITY;
  }

  /**
   * Synchronous: true while no successor can have started. A request sent while this holds
   * is not a stale one, even if the process was paused (SIGSTOP, a long GC, a starved event
   * loop) between its fence check and the send.
   */
  fresh(): boolean {
    return !this.stale && performance.now() < this.freshUntil;
  }

  markStale(reason: string): void {
    if (this.staleReason) return;
    this.staleReason = reason;
    this.controller?.abort(new StaleAttemptError(reason));
    for (const listener of this.staleListeners) listener();
    this.staleListeners.clear();
  }

  /** Calls `listener` once the attempt turns stale (at once if it is); returns how to stop listening. */
  whenStale(listener: () => void): () => void {
    if (this.staleReason) {
      listener();
      return () => undefined;
    }
    this.staleListeners.add(listener);
    return () => this.staleListeners.delete(listener);
  }

  /** Its worker closed without waiting for it: stale, and its end is not to be written. */
  abandon(): void {
    this.abandoned = true;
    this.markStale('its worker closed without waiting for it');
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
  /** Set by abandonAll: every attempt tracked from then on stops at once. */
  private abandoning = false;
  private timer: NodeJS.Timeout | null = null;
  private readonly fenceCheck: LuaCommand;
  /**
   * Bumped each time the connection closes. A confirmation holds only while the Redis that
   * gave it is the one still there: a restart without persistence, or a failover to a
   * replica that had not caught up, takes the lane's token and the lock with it, and a
   * successor can start at once. Every connection that closes may have been such a Redis.
   */
  private connectionEpoch = 0;
  private readonly connectionClosed = () => {
    this.connectionEpoch++;
    for (const attempt of this.running) attempt.unconfirmed();
  };

  constructor(
    private readonly redis: RedisClient,
    private readonly execKey: (laneId: string) => string,
    /** The BullMQ lock key of a job. */
    private readonly lockKey: (jobId: string) => string,
    private readonly log: Logger,
    private readonly intervalMs: number,
  ) {
    this.fenceCheck = luaCommand(redis, 'fence-check', 2);
    redis.on('close', this.connectionClosed);
    // A Cluster client says 'close' only when every node is gone; one node's restart is a '-node'.
    redis.on('-node', this.connectionClosed);
  }

  start(): void {
    this.timer ??= setInterval(() => void this.sweep(), this.intervalMs);
    this.timer.unref();
  }

  stop(): void {
    if (this.timer) clearInterval(this.timer);
    this.timer = null;
    this.redis.off('close', this.connectionClosed);
    this.redis.off('-node', this.connectionClosed);
  }

  track(attempt: Attempt): () => void {
    this.running.add(attempt);
    // A job BullMQ handed over as the worker closed without waiting: it stops at once too.
    if (this.abandoning) attempt.abandon();
    return () => this.running.delete(attempt);
  }

  /** Whether abandonAll ran: the worker closed without waiting, and nothing starts any more. */
  get abandoned(): boolean {
    return this.abandoning;
  }

  /** The worker closes without waiting for its running attempts: each stops, and any tracked later (see Attempt.abandon). Returns how many. */
  abandonAll(): number {
    this.abandoning = true;
    for (const attempt of this.running) attempt.abandon();
    return this.running.size;
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

  /** Whether this worker still holds a job's BullMQ lock (no other attempt can have taken it over). */
  async holdsLock(jobId: string, lockToken: string): Promise<boolean> {
    return (await this.redis.get(this.lockKey(jobId))) === lockToken;
  }

  /** Throws StaleAttemptError unless the attempt still holds its lane. */
  async check(attempt: Attempt): Promise<void> {
    while (!attempt.stale) {
      // Taken before sending: the answer holds from some moment after this one.
      const sentAt = performance.now();
      const epoch = this.connectionEpoch;
      let answer: [number, number];
      try {
        // Given up the moment the attempt turns stale: an answer that comes after (its worker
        // closed without waiting, and the reply still came over the closing socket) is not a
        // confirmation, and one that never comes (a connection closed while reconnecting)
        // must not hold the call for ever.
        answer = (await untilStale(attempt, this.fenceCheck(this.execKey(attempt.laneId), this.lockKey(attempt.jobId), attempt.token, attempt.lockToken))) as [number, number];
      } catch (err) {
        // The connection went while the check was out: ask whichever Redis answers now.
        if (epoch !== this.connectionEpoch && isRedisUnavailable(err)) continue;
        throw err;
      }
      // Turned stale in the same turn as the answer came: not confirmed.
      if (attempt.stale) break;
      const [current, lockMsLeft] = answer;
      if (current !== 1) attempt.markStale('a newer attempt holds the lease, or its lock is not its own');
      // An answer from before a close came from a Redis that may be gone: ask again.
      else if (epoch === this.connectionEpoch) {
        attempt.confirmed(sentAt, lockMsLeft);
        return;
      }
    }
    throw attempt.staleError();
  }

  private async sweep(): Promise<void> {
    const attempts = [...this.running].filter((a) => !a.stale);
    if (!attempts.length) return;
    try {
      const pipeline = this.redis.pipeline();
      for (const a of attempts) pipeline.hget(this.execKey(a.laneId), 'token').get(this.lockKey(a.jobId));
      const results = (await pipeline.exec()) ?? [];
      attempts.forEach((a, i) => {
        const [tokenErr, token] = results[2 * i] ?? [null, null];
        const [lockErr, lock] = results[2 * i + 1] ?? [null, null];
        if (!tokenErr && !lockErr && (token !== a.token || lock !== a.lockToken)) {
          const reason = token !== a.token ? 'the lane no longer names it (a newer attempt holds the lease, or Redis lost its data)' : 'its BullMQ lock is gone or another worker\'s';
          a.markStale(reason);
          this.log.warn({ jobId: a.jobId, reason }, 'attempt no longer holds its lease; aborted');
        }
      });
    } catch (err) {
      this.log.debug({ err }, 'fence sweep skipped');
    }
  }
}

/** `answer`, unless the attempt turns stale first: then its StaleAttemptError, at once. */
function untilStale<T>(attempt: Attempt, answer: Promise<T>): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const stopListening = attempt.whenStale(() => reject(attempt.staleError()));
    answer.then(resolve, reject).finally(stopListening);
  });
}
