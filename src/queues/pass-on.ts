import type { Job } from 'bullmq';
import { faultPoint } from '../fault-points.ts';

/** How long a probe or exec job goes back for when its worker does not serve its provider. */
const PASS_ON_DELAY_MS = 100;

/**
 * A probe or exec job for a provider this worker does not serve goes back to its queue for
 * another replica to take (workers of one deployment may serve different providers), while
 * some worker has announced the provider (`announced`) and until `until` (ms, the job's own
 * bound: its caller stops waiting then). True when it went back: its processor then throws
 * BullMQ's DelayedError (and leaves what it holds for the worker that takes it); false when it
 * is this worker's to answer: a name no worker ever served, past `until`, or no lock token to
 * move it with. `until` is counted from the job's timestamp (the adding process' clock).
 */
export async function passOnUnserved(job: Job, token: string | undefined, until: number, announced: () => Promise<boolean>): Promise<boolean> {
  const now = Date.now();
  if (!token || now + PASS_ON_DELAY_MS >= until || !(await announced())) return false;
  await faultPoint('pass-on-before-move');
  await job.moveToDelayed(now + PASS_ON_DELAY_MS, token);
  await faultPoint('pass-on-moved');
  return true;
}
