import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { laneIdOf } from '../src/lease.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { cli } from './helpers/cli.ts';
import { TestBed, workerEnv } from './helpers/env.ts';
import { createRecordingProvider, type CallRecord } from './helpers/recording-provider.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));

const ADMIN = 'actions-admin-token-0123456789';
const ACME = 'actions-acme-token-0123456789';
const GLOBEX = 'actions-globex-token-0123456789';

/** A gate an operation's provider call waits at until the test opens it. */
function gate() {
  let open!: () => void;
  const opened = new Promise<void>((resolve) => (open = resolve));
  return { open, opened };
}

describe('operator actions keep the lane guarantees: cancel, run again, pause and unpause', () => {
  let bed: TestBed;
  let api: TestApi;
  let client: LeaseOpsClient;
  const calls: CallRecord[] = [];
  const gates = new Map<string, ReturnType<typeof gate>>();
  // Leases whose first provider call is refused for good.
  const failOnce = new Set(['r1', 'r2']);

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: ADMIN }, { token: ACME, companyId: 'acme' }, { token: GLOBEX, companyId: 'globex' }]),
      LEASE_OPS_KEEP_COMPLETED_S: '600',
      LEASE_OPS_BOARD_READ_ONLY: 'false',
      // A stop that settles waits long before its retry: it stays backing off while the test acts.
      LEASE_OPS_BACKOFF_BY_OP: JSON.stringify({ stop: { baseMs: 60_000, capMs: 60_000 } }),
    });
    await bed.startWorker(
      createRecordingProvider({
        sink: (r) => r.end === undefined && calls.push(r),
        behaviour: async ({ ctx, op }) => {
          await gates.get(`${ctx.lease.leaseId}:${op}`)?.opened;
          if (op === 'stop' && ctx.lease.leaseId.startsWith('settles')) return 'settling';
          if (failOnce.delete(ctx.lease.leaseId)) return 'permanent';
          return 'ok';
        },
      }).provider,
    );
    api = await startTestApi(bed);
    client = api.client;
  });

  afterAll(async () => {
    for (const g of gates.values()) g.open();
    await api?.close();
    await bed?.close();
  });

  const lease = (leaseId: string, companyId = 'acme'): LeaseIdentity => ({ provider: 'recording', companyId, environmentId: 'prod', leaseId });
  const post = (path: string, token = ACME) => fetch(`${api.base}${path}`, { method: 'POST', headers: { authorization: `Bearer ${token}` } });
  const callsOf = (jobId: string) => calls.filter((c) => c.jobId === jobId);
  const running = (jobId: string) => expect.poll(async () => (await client.getOperation(jobId))?.state, { timeout: 10_000 }).toBe('running');

  it('cancels a queued operation (it fails with cancelled, never runs, the lane goes on) and refuses to cancel the executing one', { timeout: 30_000 }, async () => {
    const g = gate();
    gates.set('c1:resume', g);
    const head = await client.enqueue('resume', lease('c1'), { providerLeaseId: 'c1', leaseMetadata: {} });
    const queued = await client.enqueue('stop', lease('c1'), { providerLeaseId: 'c1' }, { deadlineMs: 120_000 });
    const after = await client.enqueue('destroy', lease('c1'), { providerLeaseId: 'c1' });
    await running(head.jobId);

    const refused = await post(`/v1/operations/${encodeURIComponent(head.jobId)}/cancel`);
    expect(refused.status).toBe(409);
    expect(((await refused.json()) as { error: { code: string } }).error.code).toBe('operation_executing');
    // Another company cannot even see it.
    expect((await post(`/v1/operations/${encodeURIComponent(queued.jobId)}/cancel`, GLOBEX)).status).toBe(404);

    const cancelled = await post(`/v1/operations/${encodeURIComponent(queued.jobId)}/cancel`);
    expect(cancelled.status).toBe(200);
    expect(await cancelled.json()).toEqual({ jobId: queued.jobId, laneId: laneIdOf(lease('c1')), cancelled: true, whileExecuting: false });
    // It ends at once (not at its deadline, two minutes away), as failed with the code cancelled.
    expect((await bed.waitForAll([queued.jobId], 5_000)).get(queued.jobId)).toBe('failed');
    expect((await client.getOperation(queued.jobId))?.error?.code).toBe('cancelled');

    g.open();
    const ended = await bed.waitForAll([head.jobId, after.jobId], 10_000);
    expect([ended.get(head.jobId), ended.get(after.jobId)]).toEqual(['completed', 'completed']);
    expect(callsOf(queued.jobId)).toEqual([]);
    expect(callsOf(after.jobId)[0]!.start > callsOf(head.jobId)[0]!.start).toBe(true);
    // Ended: nothing left to cancel.
    const again = await post(`/v1/operations/${encodeURIComponent(queued.jobId)}/cancel`);
    expect(((await again.json()) as { error: { code: string } }).error.code).toBe('operation_ended');
    const events = (await client.getLeaseTimeline(lease('c1'))).events.filter((e) => e.kind === 'cancelled');
    expect(events.map((e) => [e.jobId, e.message])).toEqual([[queued.jobId, 'cancelled by company:acme (API)']]);
  });

  it('cancels a head that backs off: the next operation runs at once, the cancelled one never calls again', { timeout: 30_000 }, async () => {
    const stop = await client.enqueue('stop', lease('settles-1'), { providerLeaseId: 'settles-1' }, { deadlineMs: 300_000 });
    const next = await client.enqueue('resume', lease('settles-1'), { providerLeaseId: 'settles-1', leaseMetadata: {} });
    await expect.poll(async () => (await client.getOperation(stop.jobId))?.state, { timeout: 10_000 }).toBe('backing-off');
    expect((await client.cancelOperation(stop.jobId, 'test'))?.cancelled).toBe(true);
    const ended = await bed.waitForAll([stop.jobId, next.jobId], 10_000);
    expect([ended.get(stop.jobId), ended.get(next.jobId)]).toEqual(['failed', 'completed']);
    expect(callsOf(stop.jobId)).toHaveLength(1);
  });

  it('runs a failed operation again, past its old deadline, with a new budget; refuses one that did not fail', { timeout: 30_000 }, async () => {
    const op = await client.enqueue('stop', lease('r1'), { providerLeaseId: 'r1' }, { deadlineMs: 1_000 });
    expect((await bed.waitForAll([op.jobId], 10_000)).get(op.jobId)).toBe('failed');
    await new Promise((r) => setTimeout(r, 1_100)); // its old deadline is past
    const res = await post(`/v1/operations/${encodeURIComponent(op.jobId)}/rerun`);
    expect(res.status).toBe(202);
    const body = (await res.json()) as { deadlineAt: number; location: string };
    expect(body.deadlineAt).toBeGreaterThan(Date.now());
    expect(body.location).toBe(`/v1/operations/${encodeURIComponent(op.jobId)}`);
    await expect.poll(async () => (await client.getOperation(op.jobId))?.state, { timeout: 10_000 }).toBe('completed');
    // Called again, once, by its next attempt (its first after the rerun: no stale try in between).
    expect(callsOf(op.jobId).map((c) => c.attempt)).toEqual([1, 2]);
    const again = await post(`/v1/operations/${encodeURIComponent(op.jobId)}/rerun`);
    expect(again.status).toBe(409);
    expect(((await again.json()) as { error: { code: string } }).error.code).toBe('operation_not_failed');
    expect((await client.getLeaseTimeline(lease('r1'))).events.map((e) => e.kind)).toEqual(expect.arrayContaining(['failed', 'rerun', 'started', 'completed']));
    // A failed acquire was cleaned up after (its sandbox destroyed): it is not run again.
    failOnce.add('r5');
    const acquire = await client.enqueue('acquire', lease('r5'), { runId: 'r5' });
    expect((await bed.waitForAll([acquire.jobId], 10_000)).get(acquire.jobId)).toBe('failed');
    const refused = await post(`/v1/operations/${encodeURIComponent(acquire.jobId)}/rerun`);
    expect(refused.status).toBe(409);
    expect(((await refused.json()) as { error: { code: string } }).error.code).toBe('operation_not_rerunnable');
  });

  it("Bull Board's retry of a failed operation is a rerun: it runs again with a new budget", { timeout: 30_000 }, async () => {
    const op = await client.enqueue('stop', lease('r2'), { providerLeaseId: 'r2' }, { deadlineMs: 1_000 });
    expect((await bed.waitForAll([op.jobId], 10_000)).get(op.jobId)).toBe('failed');
    await new Promise((r) => setTimeout(r, 1_100));
    const res = await fetch(`${api.base}/board/api/queues/ops/${encodeURIComponent(op.jobId)}/retry`, {
      method: 'PUT',
      headers: { authorization: `Basic ${Buffer.from(`operator:${ADMIN}`).toString('base64')}`, 'content-type': 'application/json' },
    });
    expect(res.status).toBe(204);
    await expect.poll(async () => (await client.getOperation(op.jobId))?.state, { timeout: 10_000 }).toBe('completed');
    expect((await client.getLeaseTimeline(lease('r2'))).events.find((e) => e.kind === 'rerun')?.message).toBe('run again by admin-1 (Bull Board)');
    // "Retry all failed" reruns each failed operation but acquires (their sandbox was cleaned up after).
    failOnce.add('r3').add('r4');
    const a = await client.enqueue('stop', lease('r3'), { providerLeaseId: 'r3' }, { deadlineMs: 1_000 });
    const b = await client.enqueue('stop', lease('r4'), { providerLeaseId: 'r4' }, { deadlineMs: 1_000 });
    await bed.waitForAll([a.jobId, b.jobId], 10_000);
    const all = await fetch(`${api.base}/board/api/queues/ops/retry/failed`, {
      method: 'PUT',
      headers: { authorization: `Basic ${Buffer.from(`operator:${ADMIN}`).toString('base64')}`, 'content-type': 'application/json' },
    });
    expect(all.status).toBe(200);
    expect(((await all.json()) as { retried: number }).retried).toBeGreaterThanOrEqual(2);
    const ended = await bed.waitForAll([a.jobId, b.jobId], 10_000);
    expect([ended.get(a.jobId), ended.get(b.jobId)]).toEqual(['completed', 'completed']);
  });

  // Found by the lane model: a rerun force-stop joined at the tail, as a plain operation, so a
  // force-stop accepted after it went ahead of it.
  it('runs a failed force-stop again as a force-stop: ahead of queued operations, behind the force-stops before it and ahead of those after', { timeout: 30_000 }, async () => {
    failOnce.add('f1');
    const first = await client.enqueue('force-stop', lease('f1'), { providerLeaseId: 'f1' });
    expect((await bed.waitForAll([first.jobId], 10_000)).get(first.jobId)).toBe('failed');
    const g = gate();
    gates.set('f1:resume', g);
    const executing = await client.enqueue('resume', lease('f1'), { providerLeaseId: 'f1', leaseMetadata: {} });
    await running(executing.jobId);
    const queued = await client.enqueue('resume', lease('f1'), { providerLeaseId: 'f1', leaseMetadata: {} });
    expect((await post(`/v1/operations/${encodeURIComponent(first.jobId)}/rerun`)).status).toBe(202);
    // The rerun asked its lane and waits there, behind the executing head.
    await expect.poll(async () => (await bed.ops.lanes.view(laneIdOf(lease('f1')))).jobs, { timeout: 10_000 }).toContain(first.jobId);
    const later = await client.enqueue('force-stop', lease('f1'), { providerLeaseId: 'f1' });
    expect((await bed.ops.lanes.view(laneIdOf(lease('f1')))).jobs).toEqual([executing.jobId, first.jobId, later.jobId, queued.jobId]);
    g.open();
    const ids = [executing.jobId, first.jobId, later.jobId, queued.jobId];
    const ended = await bed.waitForAll(ids, 10_000);
    expect(ids.map((id) => ended.get(id))).toEqual(['completed', 'completed', 'completed', 'completed']);
    // Called in that order (the rerun's call is the force-stop's last).
    const lastCall = (jobId: string) => BigInt(calls.filter((c) => c.jobId === jobId).at(-1)!.start);
    expect(ids.map(lastCall).every((start, i, all) => i === 0 || start > all[i - 1]!)).toBe(true);
  });

  it('a rerun joins its lane when asked, not when a worker takes it: a stop accepted after it runs after it (the third attack on issue 26)', { timeout: 30_000 }, async () => {
    failOnce.add('o1');
    const failed = await client.enqueue('resume', lease('o1'), { providerLeaseId: 'o1', leaseMetadata: {} });
    expect((await bed.waitForAll([failed.jobId], 10_000)).get(failed.jobId)).toBe('failed');
    // No worker takes anything for now (every one busy, or none running).
    await bed.ops.queue.pause();
    try {
      expect((await post(`/v1/operations/${encodeURIComponent(failed.jobId)}/rerun`)).status).toBe(202);
      const stop = await client.enqueue('stop', lease('o1'), { providerLeaseId: 'o1' });
      expect((await bed.ops.lanes.view(laneIdOf(lease('o1')))).jobs).toEqual([failed.jobId, stop.jobId]);
      await bed.ops.queue.resume();
      const ended = await bed.waitForAll([failed.jobId, stop.jobId], 10_000);
      expect([ended.get(failed.jobId), ended.get(stop.jobId)]).toEqual(['completed', 'completed']);
      const lastCall = (jobId: string) => BigInt(calls.filter((c) => c.jobId === jobId).at(-1)!.start);
      expect(lastCall(stop.jobId) > lastCall(failed.jobId)).toBe(true);
      // Its timeline: failed, then run again and accepted anew (one moment), then its run.
      const kinds = (await client.getLeaseTimeline(lease('o1'))).events.filter((e) => e.jobId === failed.jobId).map((e) => e.kind);
      const failedAt = kinds.indexOf('failed');
      expect([...kinds.slice(failedAt + 1, failedAt + 3)].sort()).toEqual(['accepted', 'rerun']);
    } finally {
      await bed.ops.queue.resume();
    }
  });

  it('a rerun into a paused lane that no worker has taken yet reads ready, and is counted once (the fourth attack on issue 26)', { timeout: 30_000 }, async () => {
    failOnce.add('q1');
    const failed = await client.enqueue('stop', lease('q1'), { providerLeaseId: 'q1' });
    expect((await bed.waitForAll([failed.jobId], 10_000)).get(failed.jobId)).toBe('failed');
    await bed.ops.queue.pause();
    try {
      await client.pauseLane(lease('q1'), 'test');
      expect((await post(`/v1/operations/${encodeURIComponent(failed.jobId)}/rerun`)).status).toBe(202);
      const resume = await client.enqueue('resume', lease('q1'), { providerLeaseId: 'q1', leaseMetadata: {} });
      expect((await client.getOperation(failed.jobId))?.state).toBe('ready');
      expect((await client.getOperation(resume.jobId))?.state).toBe('paused');
      // Nothing else of this lease's waits anywhere: one ready, one paused.
      const counts = (await client.overview()).counts;
      expect({ ready: counts.ready, paused: counts.paused }).toEqual({ ready: 1, paused: 1 });
      await client.unpauseLane(lease('q1'), 'test');
      await bed.ops.queue.resume();
      const ended = await bed.waitForAll([failed.jobId, resume.jobId], 10_000);
      expect([ended.get(failed.jobId), ended.get(resume.jobId)]).toEqual(['completed', 'completed']);
    } finally {
      await bed.ops.queue.resume();
    }
  });

  it('pauses a lane: the executing operation finishes, nothing new starts (not by the sweep, not by a promote) until unpause, then in order', { timeout: 30_000 }, async () => {
    const g = gate();
    gates.set('p1:resume', g);
    const head = await client.enqueue('resume', lease('p1'), { providerLeaseId: 'p1', leaseMetadata: {} });
    await running(head.jobId);
    const second = await client.enqueue('stop', lease('p1'), { providerLeaseId: 'p1' });
    const third = await client.enqueue('destroy', lease('p1'), { providerLeaseId: 'p1' });
    expect((await post('/v1/leases/recording/acme/prod/p1/pause', GLOBEX)).status).toBe(404);
    const paused = await post('/v1/leases/recording/acme/prod/p1/pause');
    expect(await paused.json()).toMatchObject({ paused: true, changed: true });
    expect((await client.getLease(lease('p1'))).paused?.by).toBe('company:acme (API)');

    g.open();
    expect((await bed.waitForAll([head.jobId], 10_000)).get(head.jobId)).toBe('completed');
    // The sweep's repair hands nothing off on a paused lane...
    await bed.ops.lanes.repair(laneIdOf(lease('p1')));
    expect((await client.getOperation(second.jobId))?.state).toBe('paused');
    // ...and a job promoted by hand parks itself again instead of running.
    const parkedAgain = new Promise<void>((resolve) => {
      const on = ({ jobId }: { jobId: string }) => jobId === second.jobId && (bed.events.off('delayed', on), resolve());
      bed.events.on('delayed', on);
    });
    await (await bed.ops.queue.getJob(second.jobId))!.promote();
    await parkedAgain;
    expect(callsOf(second.jobId)).toEqual([]);

    expect(await (await post('/v1/leases/recording/acme/prod/p1/unpause')).json()).toMatchObject({ paused: false, changed: true });
    const ended = await bed.waitForAll([second.jobId, third.jobId], 10_000);
    expect([ended.get(second.jobId), ended.get(third.jobId)]).toEqual(['completed', 'completed']);
    expect(callsOf(third.jobId)[0]!.start > callsOf(second.jobId)[0]!.start).toBe(true);
    expect((await client.getLeaseTimeline(lease('p1'))).events.map((e) => e.kind)).toEqual(expect.arrayContaining(['paused', 'unpaused']));
  });

  it('from the CLI: pause and unpause a lane, cancel an operation; a refusal exits 1 with the reason, no such operation exits 2', { timeout: 60_000 }, async () => {
    const env = workerEnv(bed, { LEASE_OPS_LOG_LEVEL: 'warn' });
    const where = ['--provider', 'recording', '--company', 'acme', '--environment', 'prod', '--lease', 'k1'];
    const g = gate();
    gates.set('k1:resume', g);
    const head = await client.enqueue('resume', lease('k1'), { providerLeaseId: 'k1', leaseMetadata: {} });
    await running(head.jobId);
    const queued = await client.enqueue('stop', lease('k1'), { providerLeaseId: 'k1' });
    const pause = await cli(['pause', ...where], env);
    expect(pause).toMatchObject({ code: 0 });
    expect(pause.stdout).toContain('paused');
    const refused = await cli(['cancel', head.jobId], env);
    expect(refused.code).toBe(1);
    expect(refused.stderr).toContain('refused (operation_executing)');
    expect((await cli(['cancel', 'no-such-lane.job'], env)).code).toBe(2);
    const cancel = await cli(['cancel', queued.jobId, '--json'], env);
    expect(cancel.code).toBe(0);
    expect(JSON.parse(cancel.stdout)).toMatchObject({ jobId: queued.jobId, cancelled: true });
    expect((await cli(['unpause', ...where], env)).code).toBe(0);
    g.open();
    expect((await bed.waitForAll([head.jobId, queued.jobId], 10_000)).get(queued.jobId)).toBe('failed');
    expect((await client.getLeaseTimeline(lease('k1'))).events.find((e) => e.kind === 'cancelled')?.message).toMatch(/^cancelled by cli:/);
  });
});

describe('cancel at each step of a retry: between the lane\'s yield and BullMQ\'s move to delayed', () => {
  let bed: TestBed | undefined;
  let worker: WorkerProcess | undefined;
  let dir: string | undefined;
  afterAll(async () => {
    worker?.child.kill('SIGCONT');
    await worker?.terminate();
    await bed?.close();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it('is refused while BullMQ still holds the attempt (it would otherwise run and complete after the cancel)', { timeout: 60_000 }, async () => {
    bed = await TestBed.create();
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-cancel-'));
    const callFile = join(dir, 'calls.jsonl');
    worker = new WorkerProcess(
      workerEnv(bed, { LEASE_OPS_PROVIDERS: PROVIDER, RECORDING_FILE: callFile, RECORDING_MAX_MS: '0', RECORDING_SETTLE_FIRST: '1', LEASE_OPS_FAULT_POINTS: 'after-lane-yield=pause*1' }),
    );
    await worker.ready;
    const client = new LeaseOpsClient(bed.config);
    try {
      const stop = await client.enqueue('stop', { provider: 'recording', companyId: 'co', environmentId: 'env', leaseId: 'y1' }, { providerLeaseId: 'y1' });
      await worker.waitForLog('lease-ops fault point after-lane-yield: pause');
      // The worker is frozen with the attempt still active in BullMQ, the lane yielded.
      await expect(client.cancelOperation(stop.jobId, 'test')).rejects.toMatchObject({ code: 'operation_executing' });
      worker.child.kill('SIGCONT');
      // Not cancelled: its retry runs and completes, and its outcome is true.
      expect((await bed.waitForAll([stop.jobId], 20_000)).get(stop.jobId)).toBe('completed');
      expect((await client.getLeaseTimeline({ provider: 'recording', companyId: 'co', environmentId: 'env', leaseId: 'y1' })).events.some((e) => e.kind === 'cancelled')).toBe(false);
    } finally {
      await client.close();
    }
  });
});
