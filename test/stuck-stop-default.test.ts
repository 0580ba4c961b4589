import { describe, expect, it } from 'vitest';
import { timelineText } from '../src/charts.ts';
import { REAL_TIMING, scenario } from '../src/demo.ts';
import { createRedis } from '../src/queues/redis.ts';
import { REDIS_URL, scanKeys, testConfig } from './helpers/env.ts';

describe('the stuck-stop watchdog at its default settings (30 s budget, 5 s scans)', () => {
  it('forces a stop that ignores SIGTERM after the budget, and the queued resume completes within budget + scan + 2 s', { timeout: 90_000 }, async () => {
    // The fake's own start and stop take 0.2 s: the watchdog's timing is what is under test.
    const r = await scenario(testConfig(), { ...REAL_TIMING, transitionMs: 200 }, true, false);
    expect(r.summary).toMatch(/^completed/);
    // Never before the graceful budget: a stop that might still finish on its own is left alone.
    expect(r.seconds).toBeGreaterThan(REAL_TIMING.stuckMs / 1000);
    expect(r.seconds).toBeLessThan((REAL_TIMING.stuckMs + REAL_TIMING.scanMs) / 1000 + 2);
    // Its timeline shows it: the watchdog's force-stop, 30 s of "stopping" before it.
    const stuck = r.timeline?.events.find((e) => e.kind === 'stuck');
    expect(stuck?.message).toMatch(/^"stopping" for 3\d(\.\d)? s \(budget 30 s\)/);
    expect(r.timeline?.events.some((e) => e.kind === 'completed' && e.op === 'force-stop')).toBe(true);
    expect(timelineText(r.timeline!)).toMatch(/force-stop \(watchdog\) +\|[ ·]*◆/);
    // And the demo leaves nothing in the Redis it used.
    const redis = createRedis(REDIS_URL);
    try {
      expect(await scanKeys(redis, `${r.prefix}*`)).toEqual([]);
    } finally {
      redis.disconnect();
    }
  });
});
