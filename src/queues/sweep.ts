import type { Logger } from '../logger.ts';
import type { OperationsQueue } from './operations-queue.ts';

export interface SweepReport {
  inspected: number;
  dropped: number;
  handedOff: number;
}

/**
 * The periodic half of the one recovery path: every lane that showed no progress for
 * `staleMs` gets the same atomic repair step a parking job uses (lane-repair.lua). A head
 * whose job was removed or finished unheard-of is dropped, a head left parked is handed
 * off, and a healthy lane is only marked as seen.
 */
export async function sweepLanes(ops: OperationsQueue, staleMs: number, log: Logger): Promise<SweepReport> {
  const report: SweepReport = { inspected: 0, dropped: 0, handedOff: 0 };
  for (const laneId of await ops.lanes.quietLanes(Date.now() - staleMs)) {
    report.inspected++;
    const r = await ops.lanes.repair(laneId);
    if (r.kind === 'dropped') {
      report.dropped++;
      log.warn({ laneId, jobId: r.jobId, next: r.next?.jobId }, 'lane head could not end by itself; dropped it');
    } else if (r.kind === 'handed') {
      report.handedOff++;
      log.warn({ laneId, jobId: r.jobId }, 'lane head was left parked; handed it off');
    }
  }
  return report;
}
