import { Job } from 'bullmq';
import { LeaseOpsError } from '../errors.ts';
import { laneIdOf, laneIdOfJobId, type LeaseIdentity } from '../lease.ts';
import { OperationJobDataSchema } from '../operations.ts';
import type { OperationsQueue } from './operations-queue.ts';

/** An operator action refused because it would break a lane's guarantee; `code` says which. */
export class OperatorActionRefusedError extends LeaseOpsError {
  override name = 'OperatorActionRefusedError';
  constructor(
    override readonly code: 'operation_executing' | 'operation_ended' | 'operation_not_failed' | 'operation_not_waiting' | 'operation_not_rerunnable',
    message: string,
  ) {
    super(code, message);
  }
}

export type CancelResult = { jobId: string; laneId: string; cancelled: true };
export type RerunResult = { jobId: string; laneId: string; deadlineAt: number };
export type PauseResult = { laneId: string; paused: boolean; changed: boolean; since: number | null };

/**
 * What an operator may do to a lease's operations without breaking its lane's guarantees,
 * each recorded on the lease's timeline with who did it:
 *   cancel   a queued or backing-off operation leaves its lane and fails with `cancelled`
 *            (never one executing: its provider call may be under way)
 *   rerun    a failed operation runs again, as a new request at the tail of its lane, with
 *            its original time budget from now
 *   pause    nothing new starts in the lane (the executing operation finishes); operations
 *            are still accepted and queued, and fail at their deadline as ever
 *   unpause  the lane's head is handed to the workers again
 */
export class OperatorActions {
  constructor(private readonly ops: OperationsQueue) {}

  /** Null when there is no such operation. */
  async cancel(jobId: string, by: string): Promise<CancelResult | null> {
    const laneId = laneIdOfJobId(jobId);
    const job = laneId ? await Job.fromId(this.ops.queue, jobId) : undefined;
    if (!laneId || !job) return null;
    const state = await job.getState();
    if (state === 'completed' || state === 'failed') throw new OperatorActionRefusedError('operation_ended', `${jobId} already ${state}: there is nothing to cancel`);
    const dropped = await this.ops.lanes.drop(laneId, jobId, { status: 'failed', code: 'cancelled', error: `cancelled: cancelled by ${by}` }, true);
    if (dropped.kind === 'executing') {
      throw new OperatorActionRefusedError('operation_executing', `${jobId} is executing, or handed to a worker, or its attempt is ending: an attempt in flight cannot be taken back, its provider call may be under way; try again once it waits`);
    }
    if (dropped.kind === 'absent') throw new OperatorActionRefusedError('operation_not_waiting', `${jobId} is not waiting in its lane; read it again`);
    this.ops.history.append(laneId, { kind: 'cancelled', jobId, op: job.name, message: `cancelled by ${by}` });
    // The lane recorded its outcome; a worker that takes it now repeats it (fails it with
    // `cancelled`) at once instead of when its park or backoff ends.
    await job.promote().catch(() => undefined);
    return { jobId, laneId, cancelled: true };
  }

  /** Null when there is no such operation. */
  async rerun(jobId: string, by: string): Promise<RerunResult | null> {
    const laneId = laneIdOfJobId(jobId);
    const job = laneId ? await Job.fromId(this.ops.queue, jobId) : undefined;
    if (!laneId || !job) return null;
    const state = await job.getState();
    if (state !== 'failed') throw new OperatorActionRefusedError('operation_not_failed', `${jobId} is ${state === 'unknown' ? 'gone' : state}: only a failed operation can be run again`);
    const parsed = OperationJobDataSchema.safeParse(job.data);
    if (!parsed.success) throw new OperatorActionRefusedError('operation_not_failed', `${jobId} has data this version cannot read: it cannot be run again`);
    // A failed acquire's sandbox was cleaned up after it (abandon-acquire): a new acquire is a new request.
    if (parsed.data.op === 'acquire' || parsed.data.op === 'abandon-acquire') {
      throw new OperatorActionRefusedError('operation_not_rerunnable', `${jobId} is an ${parsed.data.op}: a failed acquire was cleaned up after; enqueue a new acquire instead`);
    }
    const now = Date.now();
    // Its original time budget, from now: run again, not failed again at once for a deadline long past.
    const deadlineAt = now + Math.max(1_000, parsed.data.deadlineAt - parsed.data.acceptedAt);
    await job.updateData({ ...parsed.data, acceptedAt: now, deadlineAt });
    // The fence its first hand-off left in its progress is long stale: its next attempt asks the lane.
    await job.updateProgress({ lane: 'run-again' });
    // Its stalls start again from none (stc, pinned by test/bullmq-contract.test.ts): one
    // that failed stalled_too_often would otherwise fail again at once. Its attempts keep
    // counting: the lane tells this run from a repeat of the outcome it recorded by them.
    await this.ops.connection.hdel(this.ops.queue.toKey(jobId), 'stc');
    try {
      // BullMQ's retry of a failed job; the lane takes it back at its tail, like a new
      // request, when a worker picks it up (lane-acquire.lua).
      await job.retry('failed');
    } catch {
      throw new OperatorActionRefusedError('operation_not_failed', `${jobId} is no longer failed (run again by someone else?)`);
    }
    this.ops.history.append(laneId, { kind: 'rerun', jobId, op: parsed.data.op, message: `run again by ${by}` });
    return { jobId, laneId, deadlineAt };
  }

  async pause(lease: LeaseIdentity, by: string): Promise<PauseResult> {
    const laneId = laneIdOf(lease);
    const now = Date.now();
    const changed = await this.ops.lanes.pause(laneId, by, now);
    if (changed) this.ops.history.append(laneId, { kind: 'paused', jobId: '', message: `paused by ${by}` });
    return { laneId, paused: true, changed, since: (await this.ops.lanes.pausedBy(laneId))?.since ?? now };
  }

  async unpause(lease: LeaseIdentity, by: string): Promise<PauseResult> {
    const laneId = laneIdOf(lease);
    const changed = await this.ops.lanes.unpause(laneId);
    if (changed) this.ops.history.append(laneId, { kind: 'unpaused', jobId: '', message: `unpaused by ${by}` });
    return { laneId, paused: false, changed, since: null };
  }
}
