import { afterEach, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { laneIdOf, laneIdOfJobId, type LeaseIdentity } from '../src/lease.ts';
import type { LeaseProvider, OperationContext } from '../src/providers/types.ts';
import { Inspector } from '../src/queues/inspect.ts';
import { LeaseRecords, RECORD_TTL_S } from '../src/queues/lease-records.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { LeaseHasSandboxError } from '../src/errors.ts';
import { PermanentError } from '../src/providers/errors.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { OperatorActions } from '../src/queues/operator-actions.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { bedFor, gate, lease, readUntil, TestBed, type Finished } from './helpers/env.ts';


type Call = { sandbox: string; jobId: string; op: string; start: number; end: number };

/**
 * A provider whose acquire makes a sandbox with an id of its own (`sb-<run id>`), as every
 * real cloud does: the acquire's lane id and the sandbox id are two names of one lease.
 */
function sandboxCloud(opts: { holdAcquire?: Promise<void>; holdStop?: Promise<void> } = {}) {
  const calls: Call[] = [];
  const call = async <T>(op: string, ctx: OperationContext, sandbox: string, result: T): Promise<T> => {
    await ctx.fence();
    const start = performance.now();
    ctx.observe(sandbox, { kind: op === 'stop' ? 'stopped' : 'running', providerState: op === 'stop' ? 'stopped' : 'started' } as never);
    if (op === 'acquire') await opts.holdAcquire;
    if (op === 'stop') await opts.holdStop;
    await new Promise((r) => setTimeout(r, 5));
    calls.push({ sandbox, jobId: ctx.jobId, op, start, end: performance.now() });
    return result;
  };
  const provider: LeaseProvider = {
    name: 'recording',
    capabilities: { stop: true, pause: false, forceStop: true },
    acquire: (ctx, p) => call('acquire', ctx, `sb-${p.runId}`, { providerLeaseId: `sb-${p.runId}`, metadata: {}, expiresAt: null }),
    resume: (ctx, p) => call('resume', ctx, p.providerLeaseId, { providerLeaseId: p.providerLeaseId, metadata: {}, expiresAt: null }),
    release: (ctx, p) => call('release', ctx, p.providerLeaseId, { providerLeaseId: p.providerLeaseId, state: 'destroyed' as const }),
    stop: (ctx, p) => call('stop', ctx, p.providerLeaseId, { providerLeaseId: p.providerLeaseId, state: 'stopped' as const }),
    forceStop: (ctx, p) => call('force-stop', ctx, p.providerLeaseId, { providerLeaseId: p.providerLeaseId, state: 'stopped' as const }),
    destroy: (ctx, p) => call('destroy', ctx, p.providerLeaseId, { providerLeaseId: p.providerLeaseId, state: 'destroyed' as const }),
    status: async () => ({ kind: 'running' as const }),
  };
  return { provider, calls };
}

const named = (l: LeaseIdentity, sandbox: string) => ({ providerLeaseId: sandbox });

describe('one lease identity from acquire to destroy', () => {
  // This block's tests run in order and share these; the attacked tests below keep their own.
  let bed: TestBed | undefined;
  let client: LeaseOpsClient | undefined;
  afterEach(async () => {
    await client?.close();
    client = undefined;
    await bed?.close();
    bed = undefined;
  });
  it('an operation by the acquire id and one by the sandbox id, enqueued together, run one at a time in accepted order in one lane', async () => {
    bed = await TestBed.create({ LEASE_OPS_CONCURRENCY: '10' });
    const { provider, calls } = sandboxCloud();
    await bed.startWorker(provider);
    await bed.startWorker(provider);
    const run = lease('run-1');
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: run, params: { runId: 'run-1' } });
    expect((await bed.waitForAll([acquired.jobId])).get(acquired.jobId)).toBe('completed');
    const sandbox = lease('sb-run-1');

    // Alternating names, all enqueued at once: each joins the one lane in the order accepted.
    const requests = [
      { op: 'stop' as const, lease: run },
      { op: 'resume' as const, lease: sandbox },
      { op: 'stop' as const, lease: sandbox },
      { op: 'resume' as const, lease: run },
      { op: 'destroy' as const, lease: sandbox },
    ];
    const order: string[] = [];
    for (const r of requests) {
      const { jobId, laneId } = await bed.ops.enqueue({ op: r.op, lease: r.lease, params: named(r.lease, 'sb-run-1') });
      expect(laneId).toBe(acquired.laneId);
      expect(laneIdOfJobId(jobId)).toBe(acquired.laneId);
      order.push(jobId);
    }
    const ended = await bed.waitForAll(order);
    expect([...ended.values()]).toEqual(order.map(() => 'completed'));

    const ran = calls.filter((c) => c.op !== 'acquire').sort((a, b) => a.start - b.start);
    expect(ran.map((c) => c.jobId)).toEqual(order);
    for (let i = 1; i < ran.length; i++) expect(ran[i]!.start).toBeGreaterThanOrEqual(ran[i - 1]!.end);
    expect(await bed.laneKeys()).toEqual([]);
  });

  it('every view by either name shows one lease: its lane, what was last seen of its sandbox, and a timeline that holds the acquire', async () => {
    bed = await TestBed.create();
    const { provider } = sandboxCloud();
    await bed.startWorker(provider);
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-2'), params: { runId: 'run-2' } });
    await bed.waitForAll([acquired.jobId]);
    const inspector = new Inspector(bed.ops, new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX), { stuckStoppingMs: 30_000, blockedAfterMs: 60_000 });

    const byRun = await inspector.lease(lease('run-2'));
    const bySandbox = await inspector.lease(lease('sb-run-2'));
    expect(bySandbox.laneId).toBe(byRun.laneId);
    expect(bySandbox.observed?.providerLeaseId).toBe('sb-run-2');
    expect(bySandbox.observed?.kind).toBe('running');
    expect(bySandbox.sandboxId).toBe('sb-run-2');
    expect(bySandbox.acquiredAs).toBe('run-2');

    const timeline = await inspector.timeline(lease('sb-run-2'));
    expect(timeline.events.some((e) => e.jobId === acquired.jobId && e.kind === 'accepted')).toBe(true);
    expect(timeline.operations.map((o) => o.op)).toContain('acquire');
  });

  it("attention names a lease by its acquire's id, whichever name its failed operation and its pause used; the timeline's acceptance is the operation's acceptedAt", async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_FAILED_S: '600' });
    const { provider } = sandboxCloud();
    provider.stop = async () => {
      throw new PermanentError('refused', 'the cloud refused the stop');
    };
    await bed.startWorker(provider);
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-n'), params: { runId: 'run-n' } });
    await bed.waitForAll([acquired.jobId]);
    const inspector = new Inspector(bed.ops, new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX), { stuckStoppingMs: 30_000, blockedAfterMs: 60_000 });
    const stopped = await bed.ops.enqueue({ op: 'stop', lease: lease('sb-run-n'), params: { providerLeaseId: 'sb-run-n' } });
    expect((await bed.waitForAll([stopped.jobId])).get(stopped.jobId)).toBe('failed');
    const actions = new OperatorActions(bed.ops);
    await actions.pause(lease('sb-run-n'), 'test');
    const items = (await inspector.attention()).filter((i) => i.laneId === acquired.laneId);
    expect(items.map((i) => [i.lease?.leaseId, [...i.reasons].sort()])).toEqual([['run-n', ['operation_failed', 'paused']]]);
    await actions.unpause(lease('run-n'), 'test');

    // Each operation's acceptance in the timeline is the time its view says it was accepted.
    const more = [];
    for (let i = 0; i < 5; i++) more.push((await bed.ops.enqueue({ op: 'resume', lease: lease(i % 2 ? 'run-n' : 'sb-run-n'), params: { providerLeaseId: 'sb-run-n', leaseMetadata: {} } })).jobId);
    await bed.waitForAll(more);
    const timeline = await inspector.timeline(lease('run-n'));
    for (const jobId of [acquired.jobId, stopped.jobId, ...more]) {
      const accepted = timeline.events.find((e) => e.jobId === jobId && e.kind === 'accepted');
      expect({ jobId, at: accepted?.at }).toEqual({ jobId, at: (await inspector.operation(jobId))?.acceptedAt });
    }
  });

  it('the client and the operator actions name the same lane by either name, also with several partitions', async () => {
    bed = await TestBed.create({ LEASE_OPS_PARTITIONS: '4' });
    const { provider } = sandboxCloud();
    const { LeaseWorkers } = await import('../src/queues/partitioned-worker.ts');
    const { ProviderRegistry } = await import('../src/providers/registry.ts');
    const { createLogger } = await import('../src/logger.ts');
    const worker = new LeaseWorkers(bed.config, new ProviderRegistry([provider]), createLogger({ level: 'silent' }));
    await worker.start();
    try {
      client = new LeaseOpsClient(bed.config);
      // Find a run id whose lane and sandbox lane fall into different partitions.
      const { partitionOfLane } = await import('../src/partitions.ts');
      let runId = '';
      for (let i = 0; ; i++) {
        runId = `run-p${i}`;
        if (partitionOfLane(laneIdOf(lease(runId)), 4) !== partitionOfLane(laneIdOf(lease(`sb-${runId}`)), 4)) break;
      }
      const acquired = await client.enqueue('acquire', lease(runId), { runId });
      expect((await client.waitForResult(acquired.jobId, 10_000)).state).toBe('completed');
      const sandbox = lease(`sb-${runId}`);
      const stop = await client.enqueue('stop', sandbox, { providerLeaseId: sandbox.leaseId });
      expect(stop.laneId).toBe(acquired.laneId);
      expect((await client.waitForResult(stop.jobId, 10_000)).state).toBe('completed');
      expect((await client.getLease(sandbox)).laneId).toBe(acquired.laneId);
      const paused = await client.pauseLane(sandbox, 'test');
      expect(paused.laneId).toBe(acquired.laneId);
      expect((await client.getLease(lease(runId))).paused?.by).toBe('test');
      await client.unpauseLane(lease(runId), 'test');
    } finally {
      await worker.close();
    }
  });

  it('a sandbox id that already has a lane of its own when its acquire ends keeps that lane (two names are never two lanes at once)', async () => {
    bed = await TestBed.create();
    const acquireHeld = gate();
    const stopHeld = gate();
    const { provider, calls } = sandboxCloud({ holdAcquire: acquireHeld.promise, holdStop: stopHeld.promise });
    await bed.startWorker(provider);
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-3'), params: { runId: 'run-3' } });
    // Someone names the sandbox before its acquire said what it is: it gets a lane of its own,
    // whose stop is still executing when the acquire ends.
    const early = await bed.ops.enqueue({ op: 'stop', lease: lease('sb-run-3'), params: { providerLeaseId: 'sb-run-3' } });
    expect(early.laneId).toBe(laneIdOf(lease('sb-run-3')));
    await readUntil(async () => (await bed!.ops.lanes.view(early.laneId)).holder !== null, 10_000, 'the early stop executing');
    acquireHeld.open();
    expect((await bed.waitForAll([acquired.jobId])).get(acquired.jobId)).toBe('completed');
    // The acquire's lane did not take the busy name; the history says why.
    await readUntil(async () => (await bed!.ops.history.read(acquired.laneId)).some((e) => e.kind === 'named' && /lane of its own/.test(e.message ?? '')), 10_000, 'the history saying so');
    // The sandbox's operations go on in their own lane, one at a time.
    const later = await bed.ops.enqueue({ op: 'resume', lease: lease('sb-run-3'), params: { providerLeaseId: 'sb-run-3' } });
    expect(later.laneId).toBe(early.laneId);
    stopHeld.open();
    await bed.waitForAll([early.jobId, later.jobId]);
    expect(calls.filter((c) => c.sandbox === 'sb-run-3' && c.op !== 'acquire').map((c) => c.op)).toEqual(['stop', 'resume']);
  });

  it('refuses an operation whose lease and sandbox name two different leases', async () => {
    bed = await TestBed.create();
    const { provider } = sandboxCloud();
    await bed.startWorker(provider);
    const a = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-a'), params: { runId: 'run-a' } });
    const b = await bed.ops.enqueue({ op: 'acquire', lease: lease('run-b'), params: { runId: 'run-b' } });
    await bed.waitForAll([a.jobId, b.jobId]);
    await expect(bed.ops.enqueue({ op: 'stop', lease: lease('run-a'), params: { providerLeaseId: 'sb-run-b' } })).rejects.toThrow(/sb-run-b/);
    await expect(bed.ops.enqueue({ op: 'stop', lease: lease('run-a'), params: { providerLeaseId: 'sb-nowhere' } })).rejects.toThrow(/sb-nowhere/);
  });
});

/**
 * A provider whose sandboxes take their lease's own id (none of the built-in ones do): it
 * notes what it made and destroyed, holds each acquire at `held`, and finds an acquire's
 * sandbox the way its retry would, by the lease's id.
 */
function ownIdProvider(made: string[], destroyed: string[], held: { promise: Promise<unknown> }): LeaseProvider {
  return {
    name: 'own-id',
    capabilities: { stop: true, pause: false, forceStop: true },
    async acquire(ctx: OperationContext) {
      await ctx.fence();
      await held.promise;
      made.push(ctx.jobId);
      ctx.observe(ctx.lease.leaseId, { kind: 'running' });
      return { providerLeaseId: ctx.lease.leaseId, metadata: {}, expiresAt: null };
    },
    resume: async (_ctx, p) => ({ providerLeaseId: p.providerLeaseId, metadata: {}, expiresAt: null }),
    release: async () => null,
    stop: async (_ctx, p) => ({ providerLeaseId: p.providerLeaseId, state: 'stopped' }),
    forceStop: async (_ctx, p) => ({ providerLeaseId: p.providerLeaseId, state: 'stopped' }),
    // Gone without a read after (as examples/memory-provider.ts): the receipt says so.
    destroy: async (_ctx, p) => {
      destroyed.push(p.providerLeaseId);
      return { providerLeaseId: p.providerLeaseId, state: 'destroyed' };
    },
    status: async () => ({ kind: 'running' }),
    findAcquired: async (ctx) => ctx.lease.leaseId,
  };
}
const own = (leaseId: string): LeaseIdentity => ({ provider: 'own-id', companyId: 'co', environmentId: 'env', leaseId });

// The tests mostly wait (on backoffs, slow creates and sweeps), each with a bed, cloud and worker of its own: they run at once.
describe.concurrent('one lease identity, attacked (helper-2)', () => {
  const daytonaLease = (leaseId: string) => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });
  /** The sandbox an acquire that completed handed out. */
  const sandboxMadeBy = async (bed: TestBed, jobId: string) => ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;

  /** An acquire of `leaseId` (its run id the same), run to its end: its job and the sandbox it handed out. */
  const acquiredOnce = async (bed: TestBed, leaseId: string) => {
    const job = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease(leaseId), params: { runId: leaseId } });
    await bed.waitForAll([job.jobId]);
    return { job, sandbox: await sandboxMadeBy(bed, job.jobId) };
  };

  /** A bed with a worker on a Daytona fake, closed when the test ends (the bed and its worker first, then the cloud). */
  async function daytonaBed(finished: Finished, timings: Partial<{ create: number; start: number; stop: number; destroy: number }> = {}, settings: Record<string, string> = {}) {
    const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 10, stop: 10, forceStop: 0, destroy: 10, ...timings } });
    finished(() => fake.close());
    const bed = await bedFor(finished, { LEASE_OPS_KEEP_COMPLETED_S: '600', ...settings });
    const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
    await bed.startWorker(createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced }));
    return { bed, fake };
  }

  it('a sandbox id learnt while its acquire still runs (its timeline shows it) already names the acquire\'s lane', async ({ onTestFinished }) => {
    const { bed, fake } = await daytonaBed(onTestFinished, { create: 800 });
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-early'), params: { runId: 'run-early' } });
    const inspector = new Inspector(bed.ops, new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX), { stuckStoppingMs: 30_000, blockedAfterMs: 60_000 });
    const seen = await readUntil(async () => (await inspector.timeline(daytonaLease('run-early'))).events.find((e) => e.kind === 'observed' && e.sandbox)?.sandbox, 10_000, 'the sandbox id on the timeline');
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(seen), params: { providerLeaseId: seen } });
    expect(stop.laneId).toBe(acquired.laneId);
    const ended = await bed.waitForAll([acquired.jobId, stop.jobId], 20_000);
    expect([...ended.values()]).toEqual(['completed', 'completed']);
    expect(fake.http.overlaps()).toEqual([]);
    expect((await inspector.lease(daytonaLease(seen))).laneId).toBe(acquired.laneId);
  });

  it('a lease whose acquire handed out a live sandbox is not acquired again (lease_has_sandbox); once it is destroyed, it may be', async ({ onTestFinished }) => {
    const { bed } = await daytonaBed(onTestFinished);
    const first = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-twice'), params: { runId: 'run-twice' }, idempotencyKey: 'k-twice' });
    await bed.waitForAll([first.jobId]);
    const sandbox = ((await bed.ops.queue.getJob(first.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    await expect(bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-twice'), params: { runId: 'run-twice-2' } })).rejects.toBeInstanceOf(LeaseHasSandboxError);
    await expect(bed.ops.enqueue({ op: 'acquire', lease: daytonaLease(sandbox), params: { runId: 'by-its-sandbox' } })).rejects.toBeInstanceOf(LeaseHasSandboxError);
    // The same request again is still answered with its job.
    const again = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-twice'), params: { runId: 'run-twice' }, idempotencyKey: 'k-twice' });
    expect(again).toMatchObject({ jobId: first.jobId, deduplicated: 'idempotency-key' });
    const destroyed = await bed.ops.enqueue({ op: 'destroy', lease: daytonaLease(sandbox), params: { providerLeaseId: sandbox } });
    await bed.waitForAll([destroyed.jobId]);
    const anew = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-twice'), params: { runId: 'run-twice-3' } });
    expect((await bed.waitForAll([anew.jobId])).get(anew.jobId)).toBe('completed');
  }, 30_000);

  it("a destroyed sandbox's id acts on nothing of its lease's next sandbox, and cannot point the lease back at itself (the attack on issue 26)", async ({ onTestFinished }) => {
    const { bed, fake } = await daytonaBed(onTestFinished);
    const sandboxOf = (jobId: string) => sandboxMadeBy(bed, jobId);
    const { job: first, sandbox: s1 } = await acquiredOnce(bed, 'run-swap');
    // A resume of the first sandbox that failed (out of time in a paused lane), for a rerun below.
    const actions = new OperatorActions(bed.ops);
    await actions.pause(daytonaLease('run-swap'), 'test');
    const stale = await bed.ops.enqueue({ op: 'resume', lease: daytonaLease('run-swap'), params: { providerLeaseId: s1 }, deadlineMs: 300 });
    expect((await bed.waitForAll([stale.jobId])).get(stale.jobId)).toBe('failed');
    await actions.unpause(daytonaLease('run-swap'), 'test');
    const destroyed = await bed.ops.enqueue({ op: 'destroy', lease: daytonaLease('run-swap'), params: { providerLeaseId: s1 } });
    await bed.waitForAll([destroyed.jobId]);
    const second = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-swap'), params: { runId: 'run-swap-2' } });
    await bed.waitForAll([second.jobId]);
    const s2 = await sandboxOf(second.jobId);
    // Named by the old sandbox, with the new one (what the CLI filled in), or with itself; or by the lease with the old one: refused.
    await expect(bed.ops.enqueue({ op: 'stop', lease: daytonaLease(s1), params: { providerLeaseId: s2 } })).rejects.toThrow(/not the sandbox of lease/);
    await expect(bed.ops.enqueue({ op: 'resume', lease: daytonaLease(s1), params: { providerLeaseId: s1 } })).rejects.toThrow(`its sandbox is ${s2}`);
    await expect(bed.ops.enqueue({ op: 'resume', lease: daytonaLease('run-swap'), params: { providerLeaseId: s1 } })).rejects.toThrow(`its sandbox is ${s2}`);
    // Nor is the failed resume of the old sandbox run again (the fourth attack on issue 26).
    await expect(actions.rerun(stale.jobId, 'test')).rejects.toMatchObject({ code: 'operation_not_rerunnable', message: expect.stringContaining(`its sandbox is ${s2}`) });
    // The lease still has one sandbox, running, and a third acquire is refused.
    expect(fake.stateOf(s2)).toBe('started');
    await expect(bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-swap'), params: { runId: 'run-swap-3' } })).rejects.toBeInstanceOf(LeaseHasSandboxError);
    // By its sandbox's id now, or the lease's name with it: accepted.
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(s2), params: { providerLeaseId: s2 } });
    expect((await bed.waitForAll([stop.jobId])).get(stop.jobId)).toBe('completed');
  }, 30_000);

  it("an operation on the old sandbox accepted behind the lease's next acquire does nothing at its turn: no second live sandbox (the fifth attack on issue 26)", async ({ onTestFinished }) => {
    const { bed, fake } = await daytonaBed(onTestFinished);
    const sandboxOf = (jobId: string) => sandboxMadeBy(bed, jobId);
    const { job: first, sandbox: s1 } = await acquiredOnce(bed, 'run-late');
    const destroyed = await bed.ops.enqueue({ op: 'destroy', lease: daytonaLease('run-late'), params: { providerLeaseId: s1 } });
    await bed.waitForAll([destroyed.jobId]);
    // The next acquire waits in the paused lane; a stop of the old sandbox is still its lease's sandbox at enqueue.
    const actions = new OperatorActions(bed.ops);
    await actions.pause(daytonaLease('run-late'), 'test');
    const second = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-late'), params: { runId: 'run-late-2' } });
    const late = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease('run-late'), params: { providerLeaseId: s1 } });
    await actions.unpause(daytonaLease('run-late'), 'test');
    const ended = await bed.waitForAll([second.jobId, late.jobId]);
    expect([ended.get(second.jobId), ended.get(late.jobId)]).toEqual(['completed', 'failed']);
    const s2 = await sandboxOf(second.jobId);
    expect((await bed.ops.queue.getJob(late.jobId))?.failedReason).toMatch(`its sandbox is ${s2}`);
    // The lease still names its one live sandbox, and a third acquire is refused.
    expect(await new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX).currentSandbox(first.laneId)).toBe(s2);
    expect(fake.stateOf(s2)).toBe('started');
    await expect(bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-late'), params: { runId: 'run-late-3' } })).rejects.toBeInstanceOf(LeaseHasSandboxError);
  }, 30_000);

  it("the late clean-up of an acquire an operator removed, run after the lease's next acquire, leaves the lease its sandbox (the sixth attack on issue 26)", async ({ onTestFinished }) => {
    // Backoffs of seconds: the first acquire stays delayed long enough to be seen so on a busy
    // machine, and no wait for a push inside an attempt (it holds the attempt active).
    const { bed, fake } = await daytonaBed(onTestFinished, {}, { LEASE_OPS_SWEEP_INTERVAL_MS: '300', LEASE_OPS_SWEEP_STALE_MS: '0', LEASE_OPS_WATCHDOG: 'false', LEASE_OPS_BACKOFF_BASE_MS: '1500', LEASE_OPS_BACKOFF_CAP_MS: '1500', LEASE_OPS_SETTLE_WAIT_MS: '0' });
    // The first sandbox is creating for 5 s: its acquire backs off (1.5 s at a time) meanwhile.
    // (A slow start did not do it: a sandbox is created started, and on a busy machine its
    // 10 ms create had passed by the first read, so the acquire completed and never backed off.)
    fake.failNextCreate({ kind: 'slow-boot', bootMs: 5_000 });
    const sandboxOf = (jobId: string) => sandboxMadeBy(bed, jobId);
    const first = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-rm'), params: { runId: 'run-rm' } });
    const second = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-rm'), params: { runId: 'run-rm-2' } });
    // The first made its sandbox, still creating: it backs off, and an operator removes it in BullMQ.
    const b = await readUntil(async () => fake.ids()[0], 10_000, 'the first sandbox made');
    await readUntil(async () => (await bed.ops.queue.getJobState(first.jobId)) === 'delayed', 30_000, 'the first acquire backing off');
    await (await bed.ops.queue.getJob(first.jobId))!.remove();
    expect((await bed.waitForAll([second.jobId], 20_000)).get(second.jobId)).toBe('completed');
    const c = await sandboxOf(second.jobId);
    // The sweep queues the removed acquire's clean-up, which destroys what it made.
    await readUntil(async () => fake.stateOf(b) === 'gone', 20_000, 'the first sandbox destroyed');
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    await readUntil(async () => (await bed.ops.queue.getJobs(['waiting', 'delayed', 'active'])).length === 0, 10_000, 'the clean-up ended');
    expect(await records.currentSandbox(first.laneId)).toBe(c);
    // The lease still manages its sandbox, and a third acquire is refused.
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease('run-rm'), params: { providerLeaseId: c } });
    expect((await bed.waitForAll([stop.jobId])).get(stop.jobId)).toBe('completed');
    await expect(bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-rm'), params: { runId: 'run-rm-3' } })).rejects.toBeInstanceOf(LeaseHasSandboxError);
  }, 60_000);

  it('two acquires of one lease accepted while the first still runs (other keys): the second makes nothing and fails with lease_has_sandbox', async ({ onTestFinished }) => {
    const { bed, fake } = await daytonaBed(onTestFinished, { create: 400 });
    const first = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-two'), params: { runId: 'run-two' }, idempotencyKey: 'k-a' });
    const second = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-two'), params: { runId: 'run-two' }, idempotencyKey: 'k-b' });
    const ended = await bed.waitForAll([first.jobId, second.jobId], 20_000);
    expect(ended.get(first.jobId)).toBe('completed');
    expect(ended.get(second.jobId)).toBe('failed');
    expect((await bed.ops.queue.getJob(second.jobId))!.failedReason).toMatch(/^lease_has_sandbox: /);
    expect([...fake.sandboxes.values()].filter((sb) => sb.labels['lease-ops/run'] === 'run-two')).toHaveLength(1);
  });

  it('a provider whose sandboxes take their lease\'s own id: a second acquire accepted while the first ran fails with lease_has_sandbox and destroys nothing, a third is refused at enqueue, and after a destroy the lease is acquired again (helper-20, helper-21)', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const made: string[] = [];
    const destroyed: string[] = [];
    const held = gate();
    const ownId = ownIdProvider(made, destroyed, held);
    await bed.startWorker(ownId);
    const first = await bed.ops.enqueue({ op: 'acquire', lease: own('same'), params: { runId: 'a' } });
    const second = await bed.ops.enqueue({ op: 'acquire', lease: own('same'), params: { runId: 'b' } });
    held.open();
    const ended = await bed.waitForAll([first.jobId, second.jobId]);
    expect([ended.get(first.jobId), ended.get(second.jobId)]).toEqual(['completed', 'failed']);
    expect((await bed.ops.queue.getJob(second.jobId))!.failedReason).toMatch(/^lease_has_sandbox: /);
    expect(made).toEqual([first.jobId]);
    // Noted in the release, the record kept as long as every record (RECORD_TTL_S).
    const recordKey = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX).recordKey(await bed.ops.laneOf(own('same')));
    expect(await bed.redis.hget(recordKey, 'acquiredSandbox')).toBe('same');
    expect(await bed.redis.ttl(recordKey)).toBeGreaterThan(RECORD_TTL_S - 60);
    await expect(bed.ops.enqueue({ op: 'acquire', lease: own('same'), params: { runId: 'c' } })).rejects.toThrow(LeaseHasSandboxError);
    // The refused one made nothing: no clean-up, and the first one's sandbox lives.
    const jobs = await bed.ops.queue.getJobs(['waiting', 'active', 'delayed', 'completed', 'failed']);
    expect(jobs.filter((j) => j?.name === 'abandon-acquire')).toEqual([]);
    expect(destroyed).toEqual([]);
    // Destroyed, the lease takes an acquire again.
    const destroy = await bed.ops.enqueue({ op: 'destroy', lease: own('same'), params: { providerLeaseId: 'same' } });
    expect((await bed.waitForAll([destroy.jobId])).get(destroy.jobId)).toBe('completed');
    expect(destroyed).toEqual(['same']);
    const again = await bed.ops.enqueue({ op: 'acquire', lease: own('same'), params: { runId: 'd' } });
    expect((await bed.waitForAll([again.jobId])).get(again.jobId)).toBe('completed');
    expect(made).toEqual([first.jobId, again.jobId]);
  });

  it('an acquire refused after a retry (its first attempt ended before its provider) queues a clean-up that leaves the lease\'s live sandbox alone (helper-22)', async ({ onTestFinished }) => {
    const bed = await bedFor(onTestFinished);
    const made: string[] = [];
    const destroyed: string[] = [];
    const held = gate();
    const registry = new ProviderRegistry([ownIdProvider(made, destroyed, held)]);
    await bed.startWorkerWith(registry);
    const first = await bed.ops.enqueue({ op: 'acquire', lease: own('spared'), params: { runId: 'a' } });
    const second = await bed.ops.enqueue({ op: 'acquire', lease: own('spared'), params: { runId: 'b' } });
    // The second's first attempt ends before its provider: the replica does not serve it yet.
    const resolve = registry.resolve.bind(registry);
    let refusals = 1;
    registry.resolve = async (lease) => (refusals-- > 0 && made.length === 1 ? { code: 'unknown_provider', message: 'not served here yet', forGood: false } : resolve(lease));
    held.open();
    const ended = await bed.waitForAll([first.jobId, second.jobId]);
    expect([ended.get(first.jobId), ended.get(second.jobId)]).toEqual(['completed', 'failed']);
    const refused = (await bed.ops.queue.getJob(second.jobId))!;
    expect({ reason: refused.failedReason?.split(':')[0], attempts: refused.attemptsMade }).toEqual({ reason: 'lease_has_sandbox', attempts: 2 });
    // Its clean-up ran, found the lease's sandbox by the id they share, and left it alone.
    const cleanUp = await readUntil(async () => {
      const jobs = await bed.ops.queue.getJobs(['completed', 'failed']);
      return jobs.find((j) => j?.name === 'abandon-acquire');
    }, 10_000, 'the clean-up to end');
    expect(cleanUp.returnvalue).toEqual({ providerLeaseId: null, state: 'none' });
    expect(destroyed).toEqual([]);
    expect((await new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX).get(await bed.ops.laneOf(own('spared'))))?.kind).toBe('running');
  });

  it('an acquire enqueued under a sandbox id (its lease destroyed) runs in the lease\'s lane, and cancelled, its clean-up runs there too', async ({ onTestFinished }) => {
    // The second acquire backs off for 3 s: the cancel below must find it delayed (with the
    // default 250 ms, a loaded machine's cancel came after its retry had begun: helper-26).
    const { bed, fake } = await daytonaBed(onTestFinished, { create: 600 }, { LEASE_OPS_BACKOFF_BASE_MS: '3000', LEASE_OPS_BACKOFF_CAP_MS: '3000' });
    const first = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-again'), params: { runId: 'run-again' } });
    await bed.waitForAll([first.jobId], 20_000);
    const s1 = ((await bed.ops.queue.getJob(first.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const destroyed = await bed.ops.enqueue({ op: 'destroy', lease: daytonaLease(s1), params: { providerLeaseId: s1 } });
    await bed.waitForAll([destroyed.jobId]);
    const second = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease(s1), params: { runId: 'run-again-2' } });
    expect(second.laneId).toBe(first.laneId);
    await readUntil(async () => (await bed.ops.queue.getJobState(second.jobId)) === 'delayed' && [...fake.sandboxes.values()].some((sb) => sb.labels['lease-ops/run'] === 'run-again-2'), 10_000, 'the second acquire backing off');
    expect(await new OperatorActions(bed.ops).cancel(second.jobId, 'test')).toMatchObject({ whileExecuting: false });
    const made = () => [...fake.sandboxes.values()].filter((sb) => sb.labels['lease-ops/run'] === 'run-again-2');
    await readUntil(async () => made().every((sb) => fake.stateOf(sb.id) === 'gone'), 15_000, 'the clean-up in the lease\'s lane');
  });

  it("an acquire under an old sandbox's id names the lease it joined: its operations by that id are accepted (the seventh attack on issue 26)", async ({ onTestFinished }) => {
    const { bed, fake } = await daytonaBed(onTestFinished);
    const sandboxOf = (jobId: string) => sandboxMadeBy(bed, jobId);
    const { job: first, sandbox: s1 } = await acquiredOnce(bed, 'run-reuse');
    const destroyed = await bed.ops.enqueue({ op: 'destroy', lease: daytonaLease(s1), params: { providerLeaseId: s1 } });
    await bed.waitForAll([destroyed.jobId]);
    const second = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease(s1), params: { runId: 'run-reuse-2' } });
    expect((await bed.waitForAll([second.jobId])).get(second.jobId)).toBe('completed');
    const s2 = await sandboxOf(second.jobId);
    const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(s1), params: { providerLeaseId: s2 } });
    expect((await bed.waitForAll([stop.jobId])).get(stop.jobId)).toBe('completed');
    expect(fake.stateOf(s2)).toBe('stopped');
    // Its old sandbox, by that name, is still not its sandbox.
    await expect(bed.ops.enqueue({ op: 'resume', lease: daytonaLease(s1), params: { providerLeaseId: s1 } })).rejects.toThrow(`its sandbox is ${s2}`);
  }, 30_000);

  it('a sandbox\'s name of its lease is renewed by use: a look-up after most of its week has gone gives it a week again', async ({ onTestFinished }) => {
    const { bed } = await daytonaBed(onTestFinished);
    const acquired = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('run-ttl'), params: { runId: 'run-ttl' } });
    await bed.waitForAll([acquired.jobId]);
    const sandbox = ((await bed.ops.queue.getJob(acquired.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const key = bed.ops.lanes.aliasKey(laneIdOf(daytonaLease(sandbox)));
    await bed.redis.pexpire(key, 60_000);
    // A process that has not met the name yet looks it up.
    const client = new LeaseOpsClient(bed.config);
    onTestFinished(() => client.close());
    expect((await client.getLease(daytonaLease(sandbox))).laneId).toBe(acquired.laneId);
    expect(await bed.redis.pttl(key)).toBeGreaterThan(6 * 24 * 3_600_000);
  });
});
