import { describe, expect, it } from 'vitest';
import { formatReport, runChaos, SHORT, violations } from '../chaos/chaos.ts';
import { REDIS_URL } from './helpers/env.ts';

// The short chaos campaign (npm run chaos runs the full one): 4 worker processes, 60
// sandboxes on the Daytona and CreateOS fakes with injected settling and transient errors
// and stuck stops, about 1,000 operations and 20 acquires made while workers are killed,
// stopped and paused past their lock.
describe('chaos campaign, short', () => {
  it('ends with every violation count at zero', { timeout: 240_000 }, async () => {
    const report = await runChaos(SHORT, REDIS_URL);
    const table = formatReport(report);
    expect({ violations: violations(report), table }).toEqual({ violations: 0, table });
    expect(report.lost).toBe(0);
    expect(report.completed + report.failed).toBe(report.accepted);
    // The campaign did what it says: chaos happened and faults were injected and survived.
    expect(report.kills).toBeGreaterThanOrEqual(3);
    expect(report.sigkill).toBeGreaterThan(0);
    expect(report.sigstop).toBeGreaterThan(0);
    expect(report.sigterm).toBeGreaterThan(0);
    expect(report.injected_faults).toBeGreaterThan(20);
    expect(report.forced_stops).toBeGreaterThan(0);
    // Both clouds took part, with their real reply shapes, and no sandbox outlived its lease.
    expect(report.createos_calls).toBeGreaterThan(100);
    expect(report.provider_calls - report.createos_calls).toBeGreaterThan(100);
    expect(report.orphaned_sandboxes).toBe(0);
  });
});
