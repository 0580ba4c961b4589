import type { RedisClient } from '../queues/redis.ts';
import { TransientError } from './errors.ts';
import { luaCommand, type LuaCommand } from '../queues/lua-scripts.ts';

/** A service's request limit for one bucket of its routes. */
export interface RateLimit {
  perMinute: number;
  /** Requests that may go at once after a quiet spell (default 1: evenly spaced). */
  burst?: number;
}

/**
 * Paces a provider's requests under the service's limits. `take` waits for a request's
 * turn in a bucket (one per limit the service counts separately, e.g. Daytona's create and
 * lifecycle throttlers); `holdOff` is what a 429 with Retry-After asks: every request of the
 * bucket waits that long (at most MAX_HOLD_OFF_MS). A bucket without a configured limit is
 * not paced. A turn that would come after `deadlineAt` is not taken: `take` throws a
 * TransientError saying how long the wait was (or `deadline_passed`, once `deadlineAt` has
 * passed before the turn came), and the operation's retry policy, which never retries past
 * the deadline, decides.
 */
export interface RateLimiter {
  take(bucket: string, opts?: { signal?: AbortSignal; deadlineAt?: number }): Promise<void>;
  holdOff(bucket: string, ms: number): Promise<void>;
}

/** One Retry-After holds a budget back at most this long: a bad header must not stop a fleet for a day. */
export const MAX_HOLD_OFF_MS = 5 * 60_000;

function tooLate(bucket: string, waitMs: number): TransientError {
  return new TransientError('rate_limited', `request budget ${bucket}: the next turn is ${waitMs} ms away, after the operation's deadline`, { retryAfterMs: waitMs });
}

/**
 * Refuses a request whose deadline passed before it got its turn (before it asked, while it
 * waited, or while Redis answered late): it is not sent. The code is the providers' own for
 * it, so the operation's failure names the provider's last error (attempt-life.ts), not a
 * wait of 0 ms.
 */
function refuseIfDeadlinePassed(bucket: string, deadlineAt: number): void {
  if (Date.now() >= deadlineAt) throw new TransientError('deadline_passed', `request budget ${bucket}: the operation's deadline passed before this request could be sent`);
}

/** How a provider gets a limiter: shared by every replica on the worker's Redis, or per process. */
export type RateLimiterFactory = (scope: string, limits: Record<string, RateLimit | null>) => RateLimiter;

const sleep = (ms: number, signal?: AbortSignal) =>
  new Promise<void>((resolve, reject) => {
    if (ms <= 0) return resolve();
    if (signal?.aborted) return reject(signal.reason as Error);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal!.reason as Error);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });

const intervalOf = (limit: RateLimit) => 60_000 / limit.perMinute;

/**
 * The limit shared through Redis (GCRA in pace-take.lua): replicas behind one address, or
 * using one account, share one budget, which is how CreateOS (per caller IP) and Daytona
 * (per organization) count. Keys: `<prefix>:pace:<scope>:<bucket>`, gone a minute after the
 * bucket was last used.
 */
export function redisRateLimiters(redis: RedisClient, prefix: string): RateLimiterFactory {
  const take: LuaCommand = luaCommand(redis, 'pace-take', 1, prefix);
  const holdOff: LuaCommand = luaCommand(redis, 'pace-hold-off', 1);
  return (scope, limits) => {
    const key = (bucket: string) => `${prefix}:pace:${scope}:${bucket}`;
    return {
      async take(bucket, { signal, deadlineAt = Number.POSITIVE_INFINITY } = {}) {
        const limit = limits[bucket];
        if (!limit) return;
        for (;;) {
          // Before every turn asked for: a 429's hold may have run out at the deadline.
          refuseIfDeadlinePassed(bucket, deadlineAt);
          const maxWait = Number.isFinite(deadlineAt) ? Math.max(0, deadlineAt - Date.now()) : -1;
          const wait = Number(await take(key(bucket), intervalOf(limit), limit.burst ?? 1, '1', maxWait));
          if (wait < 0) throw tooLate(bucket, -wait);
          // Redis may answer late (stalled), and a timer may wake late: past the deadline the
          // turn was taken within, it is not used.
          refuseIfDeadlinePassed(bucket, deadlineAt);
          if (wait === 0) return;
          await sleep(wait, signal);
          refuseIfDeadlinePassed(bucket, deadlineAt);
          // A 429 may have held the bucket off while this request waited for its turn: then
          // the turn is void, and it waits out the hold and takes a new one.
          const held = Number(await take(key(bucket), intervalOf(limit), limit.burst ?? 1, '0', -1));
          if (held <= 0) return refuseIfDeadlinePassed(bucket, deadlineAt);
          if (Date.now() + held > deadlineAt) throw tooLate(bucket, held);
          await sleep(held, signal);
        }
      },
      async holdOff(bucket, ms) {
        if (limits[bucket]) await holdOff(key(bucket), Math.ceil(Math.min(ms, MAX_HOLD_OFF_MS)));
      },
    };
  };
}

/** The same schedule kept in this process only: for a provider used without a worker (tests, scripts). */
export const localRateLimiters: RateLimiterFactory = (_scope, limits) => {
  const buckets = new Map<string, { tat: number; until: number }>();
  return {
    async take(bucket, { signal, deadlineAt = Number.POSITIVE_INFINITY } = {}) {
      const limit = limits[bucket];
      if (!limit) return;
      for (;;) {
        refuseIfDeadlinePassed(bucket, deadlineAt);
        const now = Date.now();
        const b = buckets.get(bucket) ?? { tat: now, until: 0 };
        const interval = intervalOf(limit);
        const tat = Math.max(b.tat, now);
        const sendAt = Math.max(now, tat - ((limit.burst ?? 1) - 1) * interval, b.until);
        if (sendAt > deadlineAt) throw tooLate(bucket, Math.ceil(sendAt - now));
        buckets.set(bucket, { tat: Math.max(tat, sendAt) + interval, until: b.until });
        if (sendAt <= now) return;
        await sleep(sendAt - now, signal);
        refuseIfDeadlinePassed(bucket, deadlineAt);
        const held = (buckets.get(bucket)?.until ?? 0) - Date.now();
        if (held <= 0) return;
        if (Date.now() + held > deadlineAt) throw tooLate(bucket, held);
        await sleep(held, signal);
      }
    },
    async holdOff(bucket, ms) {
      if (!limits[bucket]) return;
      const b = buckets.get(bucket) ?? { tat: Date.now(), until: 0 };
      buckets.set(bucket, { ...b, until: Math.max(b.until, Date.now() + Math.min(ms, MAX_HOLD_OFF_MS)) });
    },
  };
};
