import type { Logger } from '../logger.ts';
import type { OperationsQueue } from './operations-queue.ts';

export interface SweepReport {
  inspected: number;
  dropped: number;
  handedOff: number;
}

/** Lanes repaired per round trip: each repair is a short script, so Redis never waits long on one page. */
const PAGE = 500;

/**
 * The periodic half of the one recovery path: every lane that showed no progress for
 * `staleMs` gets the same atomic repair step a parking job uses (lane-repair.lua). A head
 * whose job was removed or finished unheard-of is dropped, a head left parked is handed
 * off, and a healthy lane is only marked as seen.
 *
 * One pass covers every quiet lane, a page at a time: each repair marks its lane as seen,
 * so the next page starts where this one ended, and a blocked lane waits at most one pass
 * however many healthy quiet lanes come before it.
 */
export async function sweepLanes(ops: OperationsQueue, staleMs: number, log: Logger): Promise<SweepReport> {
  const olderThan = Date.now() - staleMs;
  // A lane repaired in this pass is never quiet again before it ends; the bound only guards
  // against a lane that comes back quiet by a clock going backwards.
  const bound = Math.ceil((await ops.lanes.quietLaneCount(olderThan)) / PAGE) + 1;
  let page = 0;
  return repairPages(ops, log, async () => (page++ < bound ? ops.lanes.quietLanes(olderThan, PAGE) : []));
}

/**
 * Every lane with work, those waiting out a backoff too (their progress is dated when the
 * retry comes due): after a bulk clean, which names no job. The lanes are listed first, as
 * a repair re-dates a lane and would move it in the index under a paging reader.
 */
export async function sweepEveryLane(ops: OperationsQueue, log: Logger, listed?: string[]): Promise<SweepReport> {
  // A caller that has just listed them (the API after a bulk clean) passes its list: not read twice.
  const all = listed ?? (await ops.lanes.allLanes());
  let from = 0;
  return repairPages(ops, log, async () => all.slice(from, (from += PAGE)));
}

async function repairPages(ops: OperationsQueue, log: Logger, nextPage: () => Promise<string[]>): Promise<SweepReport> {
  const report: SweepReport = { inspected: 0, dropped: 0, handedOff: 0 };
  for (;;) {
    const laneIds = await nextPage();
    if (!laneIds.length) break;
    const results = await ops.lanes.repairMany(laneIds);
    report.inspected += laneIds.length;
    results.forEach((r, i) => {
      const laneId = laneIds[i];
      if (r.kind === 'dropped') {
        report.dropped++;
        log.warn({ laneId, jobId: r.jobId, next: r.next?.jobId }, 'lane head could not end by itself; dropped it');
      } else if (r.kind === 'handed') {
        report.handedOff++;
        log.warn({ laneId, jobId: r.jobId }, 'lane head was left parked; handed it off');
      }
    });
  }
  return report;
}
