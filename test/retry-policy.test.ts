import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { PermanentError, SettlingError, TransientError } from '../src/providers/errors.ts';
import { decideRetry, DEFAULT_BACKOFF } from '../src/queues/retry-policy.ts';

const SEED = 20261130;

describe('retry policy', () => {
  it('backs off exponentially with jitter within the brief bounds, and never past the deadline', () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 0, max: 40 }),
        fc.integer({ min: 0, max: 120_000 }),
        fc.double({ min: 0, max: 0.999_999, noNaN: true }),
        fc.boolean(),
        (attemptsMade, budgetMs, r, settling) => {
          const now = 1_000_000;
          const err = settling ? new SettlingError('x', 'settling') : new TransientError('y', 'transient');
          const d = decideRetry(err, attemptsMade, now + budgetMs, now, DEFAULT_BACKOFF, () => r);
          const nominal = Math.min(5_000, 250 * 2 ** attemptsMade);
          if (d.retry) {
            expect(d.delayMs).toBeGreaterThanOrEqual(Math.floor(nominal * 0.75));
            expect(d.delayMs).toBeLessThanOrEqual(Math.ceil(nominal * 1.25));
            expect(now + d.delayMs).toBeLessThan(now + budgetMs);
          } else {
            expect(d.reason).toBe('deadline');
            expect(now + Math.round(nominal * (0.75 + 0.5 * r))).toBeGreaterThanOrEqual(now + budgetMs);
          }
        },
      ),
      { seed: SEED, numRuns: 2_000 },
    );
  });

  it('lets a longer Retry-After win, still bounded by the deadline', () => {
    fc.assert(
      fc.property(fc.integer({ min: 0, max: 60_000 }), fc.integer({ min: 0, max: 60_000 }), (retryAfterMs, budgetMs) => {
        const err = new TransientError('rate_limited', '429', { retryAfterMs });
        const d = decideRetry(err, 0, 10 + budgetMs, 10, DEFAULT_BACKOFF, () => 0.5);
        const want = Math.max(retryAfterMs, 250);
        if (want < budgetMs) expect(d).toEqual({ retry: true, delayMs: want });
        else expect(d).toEqual({ retry: false, reason: 'deadline' });
      }),
      { seed: SEED, numRuns: 1_000 },
    );
  });

  it('fails permanent and unclassified errors at once', () => {
    expect(decideRetry(new PermanentError('mismatch', 'no'), 0, Infinity, 0)).toEqual({ retry: false, reason: 'permanent' });
    expect(decideRetry(new TypeError('bug'), 0, Infinity, 0)).toEqual({ retry: false, reason: 'unclassified' });
  });
});
