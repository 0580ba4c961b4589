import { describe, expect, it } from 'vitest';
import { formatReport, runChaos, SHORT, violations } from '../chaos/chaos.ts';

// The short chaos campaign (npm run chaos runs the full one), on a redis-server of its own:
// 4 worker processes, 60 sandboxes on the Daytona and CreateOS fakes with injected settling
// and transient errors and stuck stops, about 1,000 operations (a round more, at most two, if
// they ended before three kills and a double stall) and 20 acquires made while
// workers are killed, stopped, paused past their lock and stalled twice; then Redis loses
// its data mid-run, 50 sandboxes stuck for good beside a newly stuck one, and 5,000 open
// lanes beside a blocked one.
describe('chaos campaign, short', () => {
  it('ends with every violation count at zero', { timeout: 240_000 }, async () => {
    const report = await runChaos(SHORT);
    const table = formatReport(report);
    // Each check shows the whole report when it fails.
    expect(violations(report), table).toBe(0);
    expect(report.lost, table).toBe(0);
    expect(report.completed + report.failed, table).toBe(report.accepted);
    // The campaign did what it says: chaos happened and faults were injected and survived.
    expect(report.kills, table).toBeGreaterThanOrEqual(3);
    expect(report.sigkill, table).toBeGreaterThan(0);
    expect(report.sigstop, table).toBeGreaterThan(0);
    expect(report.sigterm, table).toBeGreaterThan(0);
    expect(report.injected_faults, table).toBeGreaterThan(20);
    expect(report.forced_stops, table).toBeGreaterThan(0);
    // Both clouds took part, with their real reply shapes, and no sandbox outlived its lease.
    expect(report.createos_calls, table).toBeGreaterThan(100);
    expect(report.provider_calls - report.createos_calls, table).toBeGreaterThan(100);
    expect(report.orphaned_sandboxes, table).toBe(0);
    // Jobs stalled twice; Redis lost operations in flight, and those accepted after ran.
    expect(report.stalled_twice, table).toBeGreaterThan(0);
    expect(report.data_loss.accepted_before, table).toBeGreaterThan(0);
    expect(report.data_loss.accepted_after, table).toBeGreaterThan(0);
    expect(report.data_loss.lost_after, table).toBe(0);
    expect(report.data_loss.schedules_recreated, table).toBe(true);
    // Bounds that do not grow with what else is stuck or open.
    expect(report.stuck_for_good, table).toBe(SHORT.stuckForGood);
    expect(report.max_stuck_unforced_s, table).toBeLessThanOrEqual(report.stuck_unforced_bound_s);
    expect(report.open_lanes, table).toBe(SHORT.openLanes);
    expect(report.max_blocked_lane_s, table).toBeLessThanOrEqual(report.blocked_lane_bound_s);
    expect(report.sandbox_call_overlaps, table).toBe(0);
  });
});
