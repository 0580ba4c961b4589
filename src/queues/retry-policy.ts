import { UnrecoverableError } from 'bullmq';
import { isProviderError } from '../providers/errors.ts';

export interface BackoffSettings {
  /** First retry delay (brief: 250 ms). */
  baseMs: number;
  /** Longest retry delay (brief: 5 s). */
  capMs: number;
  /** Multiplier range applied to every delay (brief: x0.75..1.25). */
  jitter: [number, number];
}

export const DEFAULT_BACKOFF: BackoffSettings = { baseMs: 250, capMs: 5_000, jitter: [0.75, 1.25] };

export type RetryDecision =
  | { retry: true; delayMs: number }
  | { retry: false; reason: 'permanent' | 'deadline' | 'unclassified' };

/**
 * Settling and transient provider errors are retried with exponential backoff and jitter,
 * never past the deadline; a provider's Retry-After wins when it is longer. Anything else
 * fails at once: permanent errors by definition, and unclassified errors because a retry
 * would only hide a bug (providers map network failures to TransientError).
 */
export function decideRetry(
  err: unknown,
  attemptsMade: number,
  deadlineAt: number,
  now: number,
  backoff: BackoffSettings = DEFAULT_BACKOFF,
  random: () => number = Math.random,
): RetryDecision {
  if (!isProviderError(err)) return { retry: false, reason: 'unclassified' };
  if (err.kind === 'permanent') return { retry: false, reason: 'permanent' };
  const exp = Math.min(backoff.capMs, backoff.baseMs * 2 ** Math.max(0, attemptsMade));
  const [lo, hi] = backoff.jitter;
  let delayMs = Math.round(exp * (lo + (hi - lo) * random()));
  if (err.retryAfterMs !== undefined && err.retryAfterMs > delayMs) delayMs = err.retryAfterMs;
  if (now + delayMs >= deadlineAt) return { retry: false, reason: 'deadline' };
  return { retry: true, delayMs };
}

/** Thrown to BullMQ for a retry; the custom backoff strategy reads the chosen delay. */
export class RetryLaterError extends Error {
  override name = 'RetryLaterError';
  constructor(
    readonly delayMs: number,
    cause: unknown,
  ) {
    // Bounded: BullMQ keeps it (and a stack that starts with it) with the job.
    const message = cause instanceof Error ? cause.message : String(cause);
    super(message.length > 1_000 ? `${message.slice(0, 1_000)}...` : message, { cause });
  }
}

/**
 * Fails an operation for good (BullMQ never retries an UnrecoverableError). The message
 * starts with the stable code, so BullMQ's failedReason can be branched on as well.
 */
export class OperationFailedError extends UnrecoverableError {
  override name = 'OperationFailedError';
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(`${code}: ${message}`);
  }
}

/** The operation ran out of time; the message names the last provider error. */
export class DeadlineExceededError extends OperationFailedError {
  override name = 'DeadlineExceededError';
  constructor(message: string) {
    super('deadline_exceeded', message);
  }
}
