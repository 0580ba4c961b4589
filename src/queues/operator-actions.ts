import { Job } from 'bullmq';
import { LeaseOpsError, PausesFullError, QueueFullError, type QueueLimit } from '../errors.ts';

/** When a refused rerun may be asked again (as a refused enqueue is told). */
const RERUN_RETRY_AFTER_MS = 5_000;
import { laneIdOfJobId, type LeaseIdentity } from '../lease.ts';
import { OperationJobDataSchema } from '../operations.ts';
import { NO_LIMITS } from './lane.ts';
import { historyNote } from './lease-history.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import { targetSandbox, type OperationsQueue } from './operations-queue.ts';
import { leaseRecordKey } from './lease-records.ts';

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

/**
 * `whileExecuting`: an acquire that was executing is asked to stop at its next step (it then
 * fails with `cancelled`); until then it shows as running, and it may complete first.
 */
export type CancelResult = { jobId: string; laneId: string; cancelled: true; whileExecuting: boolean };
/** `overLimit`: an admin ran it again past a queue limit (it is said, not refused). */
export type RerunResult = { jobId: string; laneId: string; deadlineAt: number; overLimit?: string };
/** `overLimit`: an admin paused past the company's limit of paused lanes (it is said, not refused). */
export type PauseResult = { laneId: string; paused: boolean; changed: boolean; since: number | null; overLimit?: 'company_pauses_full' };
/** What an acknowledgement took off the attention list: each kind of operation whose failure it was. */
export type AcknowledgeResult = { acknowledged: { op: string; jobId: string; at: number }[] };

/**
 * What an operator may do to a lease's operations without breaking its lane's guarantees,
 * each recorded on the lease's timeline with who did it:
 *   cancel   a queued or backing-off operation leaves its lane and fails with `cancelled`
 *            (never one executing: its provider call may be under way), but an acquire
 *            executing is asked to stop at its next step; what a cancelled acquire made is
 *            destroyed by an abandon-acquire clean-up in its lane
 *   rerun    a failed operation runs again, as a new request at the tail of its lane, with
 *            its original time budget from now
 *   pause    nothing new starts in the lane (the executing operation finishes); operations
 *            are still accepted and queued, and fail at their deadline as ever
 *   unpause  the lane's head is handed to the workers again
 */
export class OperatorActions {
  private readonly markCancel: LuaCommand;

  private readonly admitRerun: LuaCommand;

  constructor(private readonly ops: OperationsQueue) {
    this.markCancel = luaCommand(ops.connection, 'job-cancel', 1);
    this.admitRerun = luaCommand(ops.connection, 'rerun-admit', 6, ops.settings.LEASE_OPS_PREFIX);
  }

  /** Null when there is no such operation. */
  async cancel(jobId: string, by: string): Promise<CancelResult | null> {
    const laneId = laneIdOfJobId(jobId);
    const job = laneId ? await Job.fromId(this.ops.queue, jobId) : undefined;
    if (!laneId || !job) return null;
    const state = await job.getState();
    if (state === 'completed' || state === 'failed') throw new OperatorActionRefusedError('operation_ended', `${jobId} already ${state}: there is nothing to cancel`);
    const acquire = OperationJobDataSchema.safeParse(job.data);
    const isAcquire = acquire.success && acquire.data.op === 'acquire';
    const dropped = await this.ops.lanes.drop(laneId, jobId, { status: 'failed', code: 'cancelled', error: `cancelled: cancelled by ${by}` }, true, '', acquire.success ? acquire.data.lease.companyId : '');
    if (dropped.kind === 'executing' && isAcquire) {
      // A host that gave up on an acquire must not leave its sandbox running with no owner.
      const marked = await this.markCancel(this.ops.queue.toKey(jobId), by);
      if (marked === 'ended') throw new OperatorActionRefusedError('operation_ended', `${jobId} ended meanwhile: there is nothing to cancel`);
      if (marked === 'gone') return null;
      this.ops.history.append(laneId, { kind: 'cancelled', jobId, op: job.name, message: `cancel asked by ${by} while it ran: it stops at its next step` });
      return { jobId, laneId, cancelled: true, whileExecuting: true };
    }
    if (dropped.kind === 'executing') {
      throw new OperatorActionRefusedError('operation_executing', `${jobId} is executing, or handed to a worker, or its attempt is ending: an attempt in flight cannot be taken back, its provider call may be under way; try again once it waits`);
    }
    if (dropped.kind === 'absent') throw new OperatorActionRefusedError('operation_not_waiting', `${jobId} is not waiting in its lane; read it again`);
    this.ops.history.append(laneId, { kind: 'cancelled', jobId, op: job.name, message: `cancelled by ${by}` });
    if (isAcquire) {
      // It may have run (it backs off) and made a sandbox, which its clean-up finds and destroys.
      // Read after the drop, which no attempt can start after: an attempt that ended just
      // before it shows in its counts, or in the checkpoint a provider writes before it creates.
      const [atm, stc, checkpointText] = await this.ops.connection.hmget(this.ops.queue.toKey(jobId), 'atm', 'stc', 'lo:checkpoint');
      const checkpoint = JSON.parse(checkpointText ?? 'null') as Record<string, unknown> | null;
      if (Number(atm ?? 0) > 0 || Number(stc ?? 0) > 0 || (checkpoint !== null && Object.keys(checkpoint).length > 0)) {
        await this.ops.enqueueAbandon(acquire.data!.lease, jobId, checkpoint, acquire.data!.instance === true);
      }
    }
    // The lane recorded its outcome; a worker that takes it now repeats it (fails it with
    // `cancelled`) at once instead of when its park or backoff ends.
    await job.promote().catch(() => undefined);
    return { jobId, laneId, cancelled: true, whileExecuting: false };
  }

  /** Null when there is no such operation. */
  /**
   * Runs a failed operation again, counted against the queue limits an enqueue of its lease
   * is held to (QueueFullError past one), unless `override` (an admin), which goes past and
   * says so.
   */
  async rerun(jobId: string, by: string, opts: { override?: boolean } = {}): Promise<RerunResult | null> {
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
    // One lease, one sandbox: an operation on a sandbox the lease no longer has (destroyed, and
    // another acquired since) would act on it again, or point the lease back at it; enqueue
    // refuses such a request, and so does its rerun.
    const sandbox = targetSandbox(parsed.data);
    if (sandbox !== null) {
      const current = await this.ops.connection.hget(leaseRecordKey(this.ops.settings.LEASE_OPS_PREFIX, laneId), 'providerLeaseId');
      if (current && current !== sandbox) {
        throw new OperatorActionRefusedError('operation_not_rerunnable', `${jobId} acted on sandbox ${sandbox}, which is not its lease's sandbox any more (its sandbox is ${current}): enqueue a new operation for that one`);
      }
    }
    const now = Date.now();
    const { lease } = parsed.data;
    const limits = this.ops.limitsFor(lease);
    const runs = this.ops.lanes.rerunsKey(lease.companyId);
    const member = `${lease.environmentId}\n${jobId}`;
    const admitted = (await this.admitRerun(
      this.ops.lanes.listKey(laneId),
      this.ops.lanes.byCompanyKey,
      this.ops.lanes.byEnvironmentKey,
      this.ops.queue.toKey('delayed'),
      this.ops.queue.toKey('wait'),
      runs,
      jobId,
      lease.companyId,
      lease.environmentId,
      now,
      limits.perLane,
      limits.perEnvironment,
      limits.perCompany,
      limits.queued,
      opts.override ? '0' : '1',
    )) as [string, QueueLimit?, number?];
    if (admitted[0] === 'full') throw new QueueFullError(admitted[1]!, Number(admitted[2]), RERUN_RETRY_AFTER_MS);
    const overLimit = admitted[0] === 'over' ? new QueueFullError(admitted[1]!, Number(admitted[2]), 0).code : undefined;
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
      // BullMQ's retry of a failed job, back to its wait list.
      await job.retry('failed');
    } catch {
      await this.ops.connection.zrem(runs, member);
      throw new OperatorActionRefusedError('operation_not_failed', `${jobId} is no longer failed (run again by someone else?)`);
    }
    // It joins its lane now, at the tail like a new request (a force-stop at the front), so it
    // runs after what was accepted before it and before what comes after: not when a worker
    // takes it, which may be after later requests (every worker busy, or none running). A
    // worker that takes it first joins it itself (lane-acquire.lua), and this finds it there.
    const message = `run again by ${by}`;
    const joined = await this.ops.lanes.push(laneId, jobId, parsed.data.op === 'force-stop' ? 'front' : 'tail', '', lease, NO_LIMITS, false, null, historyNote({ kind: 'rerun', op: parsed.data.op, message }), { acceptedAt: now, deadlineAt }, true);
    if (joined.kind !== 'queued' && joined.kind !== 'next') this.ops.history.append(laneId, { kind: 'rerun', jobId, op: parsed.data.op, message });
    return { jobId, laneId, deadlineAt, ...(overLimit ? { overLimit } : {}) };
  }

  /**
   * Pauses a lease's lane, counted against its company's paused lanes: refused past
   * LEASE_OPS_MAX_PAUSED_PER_COMPANY (PausesFullError), unless `override` (an admin), which
   * goes past it and says so.
   */
  async pause(lease: LeaseIdentity, by: string, opts: { override?: boolean } = {}): Promise<PauseResult> {
    const laneId = await this.ops.laneOf(lease);
    const now = Date.now();
    const { outcome, count } = await this.ops.lanes.pause(laneId, by, now, lease, { max: this.ops.settings.LEASE_OPS_MAX_PAUSED_PER_COMPANY, enforce: !opts.override });
    if (outcome === 'full') throw new PausesFullError(count);
    const changed = outcome === 'paused' || outcome === 'over';
    if (changed) this.ops.history.append(laneId, { kind: 'paused', jobId: '', message: `paused by ${by}` });
    return { laneId, paused: true, changed, since: (await this.ops.lanes.pausedBy(laneId))?.since ?? now, ...(outcome === 'over' ? { overLimit: 'company_pauses_full' as const } : {}) };
  }

  /** An operator saw the lease's failures: they leave attention (until the next one). */
  async acknowledge(lease: LeaseIdentity, by: string): Promise<AcknowledgeResult> {
    const laneId = await this.ops.laneOf(lease);
    const acknowledged = await this.ops.lanes.acknowledgeFailures(laneId);
    if (acknowledged.length) this.ops.history.append(laneId, { kind: 'acknowledged', jobId: '', message: `acknowledged by ${by}: ${acknowledged.map((f) => f.op).join(', ')}` });
    return { acknowledged };
  }

  async unpause(lease: LeaseIdentity, by: string): Promise<PauseResult> {
    const laneId = await this.ops.laneOf(lease);
    const changed = await this.ops.lanes.unpause(laneId);
    if (changed) this.ops.history.append(laneId, { kind: 'unpaused', jobId: '', message: `unpaused by ${by}` });
    return { laneId, paused: false, changed, since: null };
  }
}
