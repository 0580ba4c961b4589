import type { Logger } from '../logger.ts';
import { PARK_MS, type OperationsQueue } from './operations-queue.ts';

export interface SweepReport {
  inspected: number;
  dropped: number;
  handedOff: number;
}

/**
 * The one recovery path for lanes. A lane that showed no progress for `staleMs` has its
 * head looked at:
 *  - the head's job is gone (removed by an operator) or finished without the lane hearing
 *    of it (BullMQ failed it after too many stalls): drop it, hand off the next;
 *  - the head is still parked (its hand-off was cut short by a crash): hand it off;
 *  - otherwise (waiting, active, backing off) it is healthy: mark the lane as seen.
 * Every change goes through the same conditional lane scripts as normal processing, so a
 * sweep racing a worker can only find its change already made.
 */
export async function sweepLanes(ops: OperationsQueue, staleMs: number, log: Logger): Promise<SweepReport> {
  const report: SweepReport = { inspected: 0, dropped: 0, handedOff: 0 };
  const quiet = await ops.lanes.quietLanes(Date.now() - staleMs);
  for (const laneId of quiet) {
    report.inspected++;
    const head = await ops.lanes.head(laneId);
    if (!head.job) {
      await ops.lanes.touch(laneId);
      continue;
    }
    const job = await ops.queue.getJob(head.job);
    const state = job ? await job.getState() : 'unknown';
    if (state === 'unknown' || state === 'completed' || state === 'failed') {
      log.warn({ laneId, jobId: head.job, state }, 'lane head cannot end by itself; dropping it');
      report.dropped++;
      const next = await ops.lanes.drop(laneId, head.job);
      if (next.kind === 'next') await ops.handOff(laneId, next.jobId);
    } else if (state === 'delayed' && head.executing !== head.job && job && job.delay >= PARK_MS / 2) {
      log.warn({ laneId, jobId: head.job }, 'lane head still parked; handing it off');
      report.handedOff++;
      await ops.handOff(laneId, head.job);
      await ops.lanes.touch(laneId);
    } else {
      await ops.lanes.touch(laneId);
    }
  }
  return report;
}
