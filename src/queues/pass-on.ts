import type { Job } from 'bullmq';

/** How long a probe or exec job goes back for when its worker does not serve its provider. */
const PASS_ON_DELAY_MS = 50;
/** How long such a job keeps going back before a worker that does not serve it answers it. */
export const PASS_ON_FOR_MS = 3_000;

/**
 * A probe or exec job for a provider this worker does not serve goes back to its queue for
 * another replica to take (workers of one deployment may serve different providers), until
 * `until` (ms). True when it went back: its processor then throws BullMQ's DelayedError (and
 * leaves what it holds for the worker that takes it); false when it is this worker's to answer
 * (past `until`, or with no lock token to move it with).
 */
export async function passOnUnserved(job: Job, token: string | undefined, until: number): Promise<boolean> {
  const now = Date.now();
  if (!token || now + PASS_ON_DELAY_MS >= until) return false;
  await job.moveToDelayed(now + PASS_ON_DELAY_MS, token);
  return true;
}
