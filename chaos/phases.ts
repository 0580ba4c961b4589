// The campaign's phases after the main one: a Redis data loss with operations flowing,
// sandboxes stuck for good beside a newly stuck one, and many open lanes beside a blocked
// one. Each returns what it measured; chaos.ts checks the calls and the bounds.
import { rmSync, writeFileSync } from 'node:fs';
import { Queue, type QueueEvents } from 'bullmq';
import type { CreateosControls } from '../src/fakes/createos-fake.ts';
import type { SandboxControls } from '../src/fakes/daytona-fake.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import type { OperationsQueue } from '../src/queues/operations-queue.ts';
import type { createRedis } from '../src/queues/redis.ts';
import { waitForJobs } from '../test/helpers/env.ts';
import type { RedisProcess } from '../test/helpers/redis-process.ts';

export interface PhaseContext {
  ops: OperationsQueue;
  events: QueueEvents;
  redis: ReturnType<typeof createRedis>;
  rand: () => number;
  say: (line: string) => void;
  timeoutMs: number;
  control(cloud: 'daytona', id: string, controls: SandboxControls): Promise<null>;
  control(cloud: 'createos', id: string, controls: CreateosControls): Promise<null>;
  /** Sandboxes completed acquires handed out, over the whole campaign. */
  owned: Set<string>;
  /** Removes a job as an operator does, in Bull Board (the API's /board); resolves with the HTTP status. */
  boardRemove(jobId: string): Promise<number>;
}

export const identity = (provider: string, leaseId: string): LeaseIdentity => ({ provider, companyId: 'chaos', environmentId: 'env', leaseId });

/** Every job's end as BullMQ's events report it, from now on (job records may vanish). */
export function watchEnds(events: QueueEvents): { ended: Map<string, 'completed' | 'failed'>; stop(): void } {
  const ended = new Map<string, 'completed' | 'failed'>();
  const completed = ({ jobId }: { jobId: string }) => ended.set(jobId, 'completed');
  const failed = ({ jobId }: { jobId: string }) => ended.set(jobId, 'failed');
  events.on('completed', completed);
  events.on('failed', failed);
  return {
    ended,
    stop: () => {
      events.off('completed', completed);
      events.off('failed', failed);
    },
  };
}

const settle = (p: Promise<unknown>) => p.then(
  () => undefined,
  () => undefined,
);

/** Acquires these leases and returns the sandbox of each that completed (and marks it owned). */
async function acquireAll(ctx: PhaseContext, leases: LeaseIdentity[]): Promise<(string | undefined)[]> {
  const acquires = await Promise.all(leases.map((lease) => ctx.ops.enqueue({ op: 'acquire', lease, params: { runId: lease.leaseId } })));
  await settle(waitForJobs(ctx.events, ctx.ops.queue, acquires.map((a) => a.jobId), ctx.timeoutMs));
  return Promise.all(
    acquires.map(async (a) => {
      const job = await ctx.ops.queue.getJob(a.jobId);
      const id = (job?.returnvalue as { providerLeaseId?: string } | null)?.providerLeaseId;
      if (id) ctx.owned.add(id);
      return id;
    }),
  );
}

export interface DataLossReport {
  /** Operations accepted before Redis lost its data, and of those, ended before it. */
  accepted_before: number;
  ended_before: number;
  /** Accepted before the loss, not ended by then: gone with the data (expected: no persistence). */
  lost_to_data_loss: number;
  /** Enqueued while Redis went away (sent before, answered after): each may be in either Redis, so may be gone. */
  accepted_during: number;
  ended_during: number;
  /** Enqueued after Redis came back; every one must end. */
  accepted_after: number;
  lost_after: number;
  /** The maintenance schedules came back by themselves after the loss. */
  schedules_recreated: boolean;
  /** On the shared clock (process.hrtime), when the data went and when Redis answered again. */
  lostAt: bigint;
  backAt: bigint;
}

/**
 * Operations flow on fresh leases; halfway through, Redis is killed and started again empty
 * (no persistence), and the operations keep coming. What was accepted after it came back
 * must run as usual, and the workers must bring their maintenance schedules back by
 * themselves. Outcomes come from BullMQ's events: the job records of before are gone.
 */
export async function dataLossPhase(ctx: PhaseContext, server: RedisProcess, leases: number, opsPerLease: number): Promise<DataLossReport> {
  const sandboxes = (await acquireAll(ctx, Array.from({ length: leases }, (_, i) => identity(i % 2 ? 'createos' : 'daytona', `loss-${i}`))))
    .map((id, i): [string, string | undefined] => [i % 2 ? 'createos' : 'daytona', id])
    .filter((s): s is [string, string] => !!s[1]);
  const watch = watchEnds(ctx.events);
  const accepted: { jobId: string; sentAt: bigint; at: bigint }[] = [];
  const total = sandboxes.length * opsPerLease;
  let lostAt = 0n;
  let backAt = 0n;
  let loss: Promise<void> | null = null;
  const loseData = async () => {
    lostAt = process.hrtime.bigint();
    await server.crash();
    await server.restart();
    backAt = process.hrtime.bigint();
    ctx.say(`chaos: Redis lost its data with ${accepted.length} of ${total} operations accepted`);
  };
  const steps = ['stop', 'resume', 'stop', 'resume'] as const;
  await Promise.all(
    sandboxes.map(async ([provider, id]) => {
      for (let i = 0; i < opsPerLease; i++) {
        const op = steps[i % steps.length]!;
        const params = op === 'resume' ? { providerLeaseId: id, leaseMetadata: {} } : { providerLeaseId: id };
        const sentAt = process.hrtime.bigint();
        const { jobId } = await ctx.ops.enqueue({ op, lease: identity(provider, id), params, deadlineMs: 300_000 });
        accepted.push({ jobId, sentAt, at: process.hrtime.bigint() });
        if (!loss && accepted.length >= total / 2) loss = loseData();
        // Spaced, so some end before the loss, some are in flight at it, and some come after.
        await new Promise((r) => setTimeout(r, Math.floor(ctx.rand() * 300)));
      }
    }),
  );
  await loss;
  // An enqueue is several Redis steps: one sent before the loss and answered after may have
  // left its job in the Redis that went away.
  const before = accepted.filter((a) => a.at < lostAt);
  const during = accepted.filter((a) => a.at >= lostAt && a.sentAt < backAt);
  const after = accepted.filter((a) => a.sentAt >= backAt);
  const endedBefore = before.filter((a) => watch.ended.has(a.jobId)).length;
  await settle(waitForJobs(ctx.events, ctx.ops.queue, after.map((a) => a.jobId), Math.min(ctx.timeoutMs, 120_000)));
  watch.stop();
  let lostAfter = 0;
  for (const { jobId } of after) {
    const state = await ctx.ops.queue.getJobState(jobId);
    if (state !== 'completed' && state !== 'failed') lostAfter++;
  }
  // The sweep's and the watchdog's schedules, re-created by the workers' self-check.
  const maintenance = new Queue(`${ctx.ops.queue.name}-maintenance`, { connection: ctx.redis, prefix: ctx.ops.queue.opts.prefix! });
  const until = Date.now() + 30_000;
  let schedules = 0;
  while (Date.now() < until && (schedules = (await maintenance.getJobSchedulers()).length) < 2) await new Promise((r) => setTimeout(r, 100));
  await maintenance.close();
  return {
    accepted_before: before.length,
    ended_before: endedBefore,
    lost_to_data_loss: before.length - endedBefore,
    accepted_during: during.length,
    ended_during: during.filter((a) => watch.ended.has(a.jobId)).length,
    accepted_after: after.length,
    lost_after: lostAfter,
    schedules_recreated: schedules >= 2,
    lostAt,
    backAt,
  };
}

export interface StuckReport {
  stuck_for_good: number;
  /** The newly stuck sandbox: how long it stayed stopping past the budget before it was forced. */
  newlyStuck: string | null;
  stopSentAt: bigint | null;
}

/**
 * Sandboxes stuck for good: CreateOS ones whose pause never ends (CreateOS cannot force a
 * stop), their stops failed at a 2 s deadline, so their leases stay "stopping" in lease-ops'
 * records. Then one Daytona sandbox gets stuck: it must be forced as if the others were not
 * there. chaos.ts reads, from the cloud's call log, when the stop and the force reached it.
 */
export async function stuckPhase(ctx: PhaseContext, forGood: number): Promise<StuckReport> {
  const stuck = (await acquireAll(ctx, Array.from({ length: forGood }, (_, i) => identity('createos', `stuck-${i}`)))).filter((id): id is string => !!id);
  for (const id of stuck) await ctx.control('createos', id, { pauseMs: 86_400_000 });
  const stops = await Promise.all(stuck.map((id) => ctx.ops.enqueue({ op: 'stop', lease: identity('createos', id), params: { providerLeaseId: id }, deadlineMs: 2_000 })));
  await settle(waitForJobs(ctx.events, ctx.ops.queue, stops.map((s) => s.jobId), ctx.timeoutMs));
  ctx.say(`chaos: ${stuck.length} CreateOS sandboxes stuck pausing for good; one Daytona sandbox gets stuck now`);
  const [newly] = await acquireAll(ctx, [identity('daytona', 'newly-stuck')]);
  if (!newly) return { stuck_for_good: stuck.length, newlyStuck: null, stopSentAt: null };
  await ctx.control('daytona', newly, { stuckStoppingMs: 600_000 });
  const stopSentAt = process.hrtime.bigint();
  const stop = await ctx.ops.enqueue({ op: 'stop', lease: identity('daytona', newly), params: { providerLeaseId: newly } });
  const resume = await ctx.ops.enqueue({ op: 'resume', lease: identity('daytona', newly), params: { providerLeaseId: newly, leaseMetadata: {} } });
  await settle(waitForJobs(ctx.events, ctx.ops.queue, [stop.jobId, resume.jobId], ctx.timeoutMs));
  return { stuck_for_good: stuck.length, newlyStuck: newly, stopSentAt };
}

export interface ScaleReport {
  open_lanes: number;
  /** The longer of the two below. */
  max_blocked_lane_s: number;
  /** How long the lane whose head an operator removed stayed blocked. */
  blocked_by_removal_s: number;
  /** How long the lane left as a lost hand-off leaves it stayed blocked (the sweep's case). */
  blocked_unannounced_s: number;
  /** Operations of this phase that did not end. */
  lost: number;
  /** Lanes still open once every operation of the phase ended and the bound passed. */
  blocked_lanes: number;
}

/**
 * Many open, quiet lanes: each lease's acquire (the `hold` provider, chaos/hold-provider.ts)
 * answers "settling, try in 10 minutes" while the hold file exists. Among them two lanes are
 * blocked (see below): the release queued behind each must run within the sweep's bound
 * however many lanes are open. Then the hold ends and all drain.
 */
export async function scalePhase(ctx: PhaseContext, holdFile: string, lanes: number, drainBoundMs: number): Promise<ScaleReport> {
  writeFileSync(holdFile, 'held');
  const accepted: string[] = [];
  const HOUR = 3_600_000;
  for (let from = 0; from < lanes; from += 1_000) {
    const batch = await Promise.all(
      Array.from({ length: Math.min(1_000, lanes - from) }, (_, i) =>
        ctx.ops.enqueue({ op: 'acquire', lease: identity('hold', `open-${from + i}`), params: { runId: 'r' }, deadlineMs: HOUR }),
      ),
    );
    accepted.push(...batch.map((b) => b.jobId));
  }
  // Every head tried once and backing off: the lanes are open and quiet.
  const until = Date.now() + ctx.timeoutMs;
  while ((await ctx.redis.zcard(ctx.ops.lanes.backingOffKey)) < lanes && Date.now() < until) await new Promise((r) => setTimeout(r, 200));
  ctx.say(`chaos: ${await ctx.ops.lanes.openLaneCount()} lanes open and backing off; an operator removes one lane's head`);

  // Two blocked lanes: one whose head an operator removes in Bull Board, one whose
  // head's job is deleted by hand with its progress dated long ago, as a lost hand-off
  // leaves a lane (only the sweep can notice). Each has a release queued behind.
  const blockedLane = async (leaseId: string) => {
    const lease = identity('hold', leaseId);
    const head = await ctx.ops.enqueue({ op: 'acquire', lease, params: { runId: 'r' }, deadlineMs: HOUR });
    const behind = await ctx.ops.enqueue({ op: 'release', lease, params: { providerLeaseId: leaseId, leaseMetadata: {}, resourceDisposition: 'keep_running' } });
    // Backing off, and moved to BullMQ's delayed set (a job still active is locked: BullMQ
    // refuses to remove it).
    const backingOff = async () =>
      (await ctx.redis.zscore(ctx.ops.lanes.backingOffKey, head.jobId)) !== null && (await ctx.ops.queue.getJobState(head.jobId)) === 'delayed';
    while (!(await backingOff()) && Date.now() < until) await new Promise((r) => setTimeout(r, 20));
    return { head, behind };
  };
  const removed = await blockedLane('blocked-removed');
  const vanished = await blockedLane('blocked-vanished');
  const timeUntilEnded = async (jobId: string, from: number) => {
    await settle(waitForJobs(ctx.events, ctx.ops.queue, [jobId], ctx.timeoutMs));
    return Date.now() - from;
  };
  const removedAt = Date.now();
  const status = await ctx.boardRemove(removed.head.jobId);
  if (status >= 300) throw new Error(`Bull Board did not remove ${removed.head.jobId} (${status})`);
  await ctx.redis
    .multi()
    .del(ctx.ops.queue.toKey(vanished.head.jobId))
    .zrem(ctx.ops.queue.toKey('delayed'), vanished.head.jobId)
    .zadd(ctx.ops.lanes.lanesKey, 'XX', 0, vanished.head.laneId)
    .exec();
  const [removedMs, vanishedMs] = await Promise.all([timeUntilEnded(removed.behind.jobId, removedAt), timeUntilEnded(vanished.behind.jobId, removedAt)]);

  rmSync(holdFile, { force: true });
  await ctx.ops.queue.promoteJobs();
  // Too many to follow by events (BullMQ trims its event stream at 10,000): done when no
  // lane is open and nothing waits, runs or is delayed; then each job's end is read.
  const busy = async () => {
    const counts = await ctx.ops.queue.getJobCounts('wait', 'active', 'delayed', 'prioritized');
    return (await ctx.ops.lanes.openLaneCount()) > 0 || Object.values(counts).some((n) => n > 0);
  };
  while ((await busy()) && Date.now() < until) await new Promise((r) => setTimeout(r, 500));
  const lost = (await endedOf(ctx, accepted)).filter((state) => state === null).length;
  const drainUntil = Date.now() + drainBoundMs;
  while ((await ctx.ops.lanes.openLaneCount()) > 0 && Date.now() < drainUntil) await new Promise((r) => setTimeout(r, 100));
  const seconds = (ms: number) => Number((ms / 1000).toFixed(2));
  return {
    open_lanes: lanes,
    max_blocked_lane_s: seconds(Math.max(removedMs, vanishedMs)),
    blocked_by_removal_s: seconds(removedMs),
    blocked_unannounced_s: seconds(vanishedMs),
    lost,
    blocked_lanes: await ctx.ops.lanes.openLaneCount(),
  };
}

/** Whether each job completed or failed (null: neither), read from BullMQ's sets 5,000 at a time. */
async function endedOf(ctx: PhaseContext, jobIds: string[]): Promise<('completed' | 'failed' | null)[]> {
  const prefix = `${ctx.ops.queue.opts.prefix}:${ctx.ops.queue.name}`;
  const states: ('completed' | 'failed' | null)[] = [];
  for (let from = 0; from < jobIds.length; from += 5_000) {
    const pipeline = ctx.redis.pipeline();
    const batch = jobIds.slice(from, from + 5_000);
    for (const id of batch) pipeline.zscore(`${prefix}:completed`, id).zscore(`${prefix}:failed`, id);
    const replies = (await pipeline.exec()) ?? [];
    for (let i = 0; i < batch.length; i++) states.push(replies[2 * i]?.[1] !== null ? 'completed' : replies[2 * i + 1]?.[1] !== null ? 'failed' : null);
  }
  return states;
}
