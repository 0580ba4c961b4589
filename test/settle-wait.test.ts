import { randomBytes } from 'node:crypto';
import { afterEach, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { DaytonaStateEvents } from '../src/providers/daytona/events.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { InstanceProviders } from '../src/providers/instances/resolver.ts';
import { MasterKeys } from '../src/providers/instances/sealing.ts';
import { ProviderInstanceStore } from '../src/providers/instances/store.ts';
import { localRateLimiters } from '../src/providers/pacing.ts';
import { createLogger } from '../src/logger.ts';
import { LeaseRecords } from '../src/queues/lease-records.ts';
import { startTestApi } from './helpers/api-server.ts';
import { cli } from './helpers/cli.ts';
import { bedFor, QUICK_RECOVERY, readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { killAll, WorkerProcess, workerFor } from './helpers/worker-process.ts';

// Settle waits: an attempt that meets a sandbox in transition waits, holding its lane, for
// Daytona's notification gateway to push the sandbox's next state, and goes on at once.
// The fake serves the gateway as apps/api's NotificationGateway does (socket.io, token in the
// handshake, events to the organization's room).

const ORG = '7c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f';
const KEY = 'settle-key';
const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
const identity = (leaseId: string): LeaseIdentity => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });

// For the blocks that run in order (and attemptsOf, requestsOf below): the blocks whose tests
// run at once keep their own bed, cloud and workers.
let bed: TestBed | undefined;
let fake: DaytonaFake | undefined;
const workers: WorkerProcess[] = [];
afterEach(async () => {
  await killAll(workers);
  await bed?.close();
  await fake?.close();
  bed = undefined;
  fake = undefined;
});

/** Attempts a job took (BullMQ counts the one it finished with too). */
async function attemptsOf(jobId: string): Promise<number> {
  const job = await bed!.ops.queue.getJob(jobId);
  return job!.attemptsMade;
}

/** Requests the fake served for one sandbox, by the job's attempts (their X-Lease-Ops-Attempt). */
function requestsOf(jobId: string): number {
  return fake!.calls.filter((c) => c.attempt?.startsWith(`${jobId}:`)).length;
}

describe('settle waits on Daytona pushes', () => {
  it('an acquire, a stop and a resume each end in their first attempt when the gateway pushes the end of the transition', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 1_200, start: 1_200, stop: 1_200, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create();
    await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));

    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity('w1'), params: { runId: 'r1' } });
    expect((await bed.waitForAll([acquire.jobId])).get(acquire.jobId)).toBe('completed');
    const sandbox = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity(sandbox), params: { providerLeaseId: sandbox } });
    expect((await bed.waitForAll([stop.jobId])).get(stop.jobId)).toBe('completed');
    expect(fake.stateOf(sandbox)).toBe('stopped');
    const resume = await bed.ops.enqueue({ op: 'resume', lease: identity(sandbox), params: { providerLeaseId: sandbox, leaseMetadata: {} } });
    expect((await bed.waitForAll([resume.jobId])).get(resume.jobId)).toBe('completed');
    expect(fake.stateOf(sandbox)).toBe('started');

    // Each waited in its attempt (no retry), and read the sandbox only after the push:
    // acquire: read by name, create, read, read after the push; stop and resume: read,
    // action, read, read after the push. The acquire's first wait connected the socket after
    // its read, so it read once more (an event before the socket would have been missed).
    expect(await Promise.all([acquire, stop, resume].map((j) => attemptsOf(j.jobId)))).toEqual([1, 1, 1]);
    expect([acquire, stop, resume].map((j) => requestsOf(j.jobId))).toEqual([5, 4, 4]);
    expect(fake.gatewaySockets()).toBe(1);
    const metrics = await import('../src/metrics.ts');
    const text = await metrics.registry.metrics();
    expect(text).toMatch(/lease_ops_settle_waits_total\{op="resume",outcome="changed"\} 1/);
  });

  it('without an organization (the gateway sends none of its events) or without a gateway, a transition is waited out by backing off, as before', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 600, start: 50, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_BACKOFF_BASE_MS: '100', LEASE_OPS_BACKOFF_CAP_MS: '200' });
    const noGateway = new DaytonaFake({ apiKey: KEY, organizationId: ORG, timings: { create: 600, start: 50, stop: 50, destroy: 50 } });
    const noGatewayUrl = await noGateway.listen();
    try {
      await bed.startWorker(
        createDaytonaProvider({ name: 'daytona', apiUrl, apiKey: KEY, rateLimits: unpaced }),
        createDaytonaProvider({ name: 'daytona-b', apiUrl: noGatewayUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }),
      );
      const a = await bed.ops.enqueue({ op: 'acquire', lease: identity('no-org'), params: { runId: 'r2' } });
      const b = await bed.ops.enqueue({ op: 'acquire', lease: { ...identity('no-gateway'), provider: 'daytona-b' }, params: { runId: 'r3' } });
      const ended = await bed.waitForAll([a.jobId, b.jobId]);
      expect([ended.get(a.jobId), ended.get(b.jobId)]).toEqual(['completed', 'completed']);
      expect(await attemptsOf(a.jobId)).toBeGreaterThan(1);
      expect(await attemptsOf(b.jobId)).toBeGreaterThan(1);
      expect(fake.gatewaySockets()).toBe(0);
    } finally {
      await noGateway.close();
    }
  });

  it('a gateway that pushes nothing for the sandbox (another organization\'s room): the waits time out, the operation backs off, and once a read finds a change no push brought, the socket is dropped', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 1_000, start: 50, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_SETTLE_WAIT_MS: '300', LEASE_OPS_BACKOFF_BASE_MS: '100', LEASE_OPS_BACKOFF_CAP_MS: '200' });
    await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: 'another-organization', rateLimits: unpaced }));
    const a = await bed.ops.enqueue({ op: 'acquire', lease: identity('silent'), params: { runId: 'r4' } });
    expect((await bed.waitForAll([a.jobId])).get(a.jobId)).toBe('completed');
    expect(await attemptsOf(a.jobId)).toBeGreaterThan(1);
    const text = await (await import('../src/metrics.ts')).registry.metrics();
    // Waits timed out while the sandbox was still being made; the read that found it started
    // with no push between showed the gateway missed it, and the socket was dropped.
    expect(text).toMatch(/lease_ops_settle_waits_total\{op="acquire",outcome="timed_out"\} [1-9]/);
    await readUntil(async () => fake!.gatewaySockets() === 0, 5_000, 'the silent socket dropped');
  });

  it('a worker that closes stops its attempts\' waits: the close does not wait for the transition', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 50, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_SETTLE_WAIT_MS: '120000' });
    const worker = await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity('closing'), params: { runId: 'r5' } });
    await bed.waitForAll([acquire.jobId]);
    const sandbox = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    // The stop hangs in `stopping` far longer than the test (a process ignoring SIGTERM).
    fake.control(sandbox, { stuckStoppingMs: 600_000 });
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity(sandbox), params: { providerLeaseId: sandbox } });
    const metrics = await import('../src/metrics.ts');
    await readUntil(async () => /lease_ops_settle_waits_in_progress 1\b/.test(await metrics.registry.metrics()), 10_000, 'the stop waiting');
    await worker.close();
    expect(fake.stateOf(sandbox)).toBe('stopping');
    const text = await metrics.registry.metrics();
    expect(text).toMatch(/lease_ops_settle_waits_total\{op="stop",outcome="stopped"\} 1/);
    expect(text).toMatch(/lease_ops_settle_waits_in_progress 0\b/);
    // The stop was not lost: it waits in its lane for the next worker.
    expect(await bed.ops.queue.getJobState(stop.jobId)).toMatch(/delayed|waiting|active/);
  });
});

// This block and the next: worker processes killed or frozen, each test with a cloud, a bed and
// workers of its own, closed when it ends (the workers, the bed, then the cloud): they run at once.
describe.concurrent('settle waits: crashes at the wait', () => {
  const daytonaEnv = (bed: TestBed, apiUrl: string, extra: Record<string, string> = {}) =>
    workerEnv(bed, { ...QUICK_RECOVERY, LEASE_OPS_PROVIDERS: 'daytona', DAYTONA_API_URL: apiUrl, DAYTONA_API_KEY: KEY, DAYTONA_ORGANIZATION_ID: ORG, ...extra });

  it('a worker killed while its acquire waits: the successor finds the sandbox by name, makes no second one, and completes', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 1_500, start: 50, stop: 50, destroy: 50 } });
    onTestFinished(() => fake.close());
    const apiUrl = await fake.listen();
    const bed = await bedFor(onTestFinished);
    const first = workerFor(onTestFinished, daytonaEnv(bed, apiUrl, { LEASE_OPS_FAULT_POINTS: 'settle-wait=kill*1' }));
    await first.ready;
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: identity('killed'), params: { runId: 'r6' } });
    await first.waitForLog('fault point settle-wait: kill');
    await first.exited;
    const second = workerFor(onTestFinished, daytonaEnv(bed, apiUrl));
    await second.ready;
    expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
    expect(fake.ids()).toHaveLength(1);
    expect(fake.calls.filter((c) => c.method === 'POST' && c.path === '/sandbox')).toHaveLength(1);
    const sandbox = ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    expect(sandbox).toBe(fake.ids()[0]);
  });

  it('a worker frozen at the wait past its lock: its successor completes the resume, and the frozen attempt, thawed, sends nothing', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 1_500, stop: 50, destroy: 50 } });
    onTestFinished(() => fake.close());
    const apiUrl = await fake.listen();
    const bed = await bedFor(onTestFinished);
    const setup = await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity('frozen'), params: { runId: 'r7' } });
    await bed.waitForAll([acquire.jobId]);
    const sandbox = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity(sandbox), params: { providerLeaseId: sandbox } });
    await bed.waitForAll([stop.jobId]);
    await setup.close();

    const first = workerFor(onTestFinished, daytonaEnv(bed, apiUrl, { LEASE_OPS_FAULT_POINTS: 'settle-wait=pause*1' }));
    await first.ready;
    const resume = await bed.ops.enqueue({ op: 'resume', lease: identity(sandbox), params: { providerLeaseId: sandbox, leaseMetadata: {} } });
    await first.waitForLog('fault point settle-wait: pause');
    const firstAttempt = fake.calls.filter((c) => c.attempt?.startsWith(`${resume.jobId}:`)).map((c) => c.attempt)[0]!;
    const firstCalls = fake.calls.filter((c) => c.attempt === firstAttempt).length;

    const second = workerFor(onTestFinished, daytonaEnv(bed, apiUrl));
    await second.ready;
    expect((await bed.waitForAll([resume.jobId])).get(resume.jobId)).toBe('completed');
    expect(fake.stateOf(sandbox)).toBe('started');

    // Thawed, the stale attempt's wait ends (pushed or aborted) and it is refused: at its fence
    // ('stale attempt'), or, when its wait ended before it saw its lock go, at its lane and then
    // by BullMQ (a run beside four busy loops took that way).
    first.child.kill('SIGCONT');
    await readUntil(async () => first.logs.some((l) => /stale attempt|BullMQ refused the end of a superseded attempt/.test(l)), 30_000, 'the thawed attempt refused');
    expect(fake.calls.filter((c) => c.attempt === firstAttempt)).toHaveLength(firstCalls);
    expect(fake.calls.some((c) => c.attempt?.startsWith(`${resume.jobId}:`) && c.attempt !== firstAttempt)).toBe(true);
  });
});

describe.concurrent('an attempt that lost its turn writes nothing to the lease\'s record', () => {
  it('frozen after its stop\'s provider call past its lock, thawed after its successor and a resume: the record still says running (helper-20)', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 50, stop: 50, destroy: 50 } });
    onTestFinished(() => fake.close());
    const apiUrl = await fake.listen();
    const bed = await bedFor(onTestFinished);
    const env = (extra: Record<string, string> = {}) =>
      workerEnv(bed, { ...QUICK_RECOVERY, LEASE_OPS_PROVIDERS: 'daytona', DAYTONA_API_URL: apiUrl, DAYTONA_API_KEY: KEY, DAYTONA_ORGANIZATION_ID: ORG, ...extra });
    const setup = await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity('late'), params: { runId: 'r-late' } });
    await bed.waitForAll([acquire.jobId]);
    const sandbox = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    await setup.close();

    const first = workerFor(onTestFinished, env({ LEASE_OPS_FAULT_POINTS: 'after-provider-call=pause*1' }));
    await first.ready;
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity('late'), params: { providerLeaseId: sandbox } });
    await first.waitForLog('fault point after-provider-call: pause');
    const second = workerFor(onTestFinished, env());
    await second.ready;
    expect((await bed.waitForAll([stop.jobId])).get(stop.jobId)).toBe('completed');
    const resume = await bed.ops.enqueue({ op: 'resume', lease: identity('late'), params: { providerLeaseId: sandbox, leaseMetadata: {} } });
    expect((await bed.waitForAll([resume.jobId])).get(resume.jobId)).toBe('completed');
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    const laneId = await bed.ops.laneOf(identity('late'));
    expect((await records.get(laneId))?.kind).toBe('running');

    // Thawed, the stale stop goes on to its end: it saw the sandbox stopped, long ago.
    first.child.kill('SIGCONT');
    await first.waitForLog('superseded');
    expect((await records.get(laneId))?.kind).toBe('running');
    expect(fake.stateOf(sandbox)).toBe('started');
    // BullMQ refuses its end too: a warning, not an error with a stack (helper-21).
    await first.waitForLog('BullMQ refused the end of a superseded attempt');
    expect(first.logs.filter((l) => l.includes('"level":50'))).toEqual([]);
  });
});

describe('the gateway listener (DaytonaStateEvents) on its own', () => {
  it('wakes a wait only for its own sandbox\'s new state, ignores what it cannot read, and closes its socket once no wait uses it', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 300, start: 300, stop: 300, destroy: 50 } });
    const apiUrl = await fake.listen();
    const events = new DaytonaStateEvents({ apiUrl, apiKey: KEY, organizationId: ORG, idleCloseMs: 200 });
    try {
      const gateway = (fake as unknown as { gateway: { to(room: string): { emit(event: string, payload: unknown): void } } }).gateway;
      const create = (name: string) => fetch(`${apiUrl}/sandbox`, { method: 'POST', headers: { authorization: `Bearer ${KEY}`, 'content-type': 'application/json' }, body: JSON.stringify({ name }) }).then((r) => r.json() as Promise<{ id: string }>);
      // A wait that begins after a read older than the socket answers `changed` at once: the
      // socket may have connected after the event it waits for.
      expect(await events.waitForChange('not-made-yet', 'creating', performance.now(), 10_000, new AbortController().signal)).toBe('changed');
      expect(fake.gatewaySockets()).toBe(1);
      const mine = await create('mine');
      const since = performance.now();
      const waiting = events.waitForChange(mine.id, 'creating', since, 10_000, new AbortController().signal);
      // Junk and other sandboxes' events do not end the wait; the same state does not either.
      for (const payload of [null, 42, 'x', { sandbox: null }, { sandbox: { id: mine.id } }, { sandbox: { id: mine.id }, newState: 7 }, JSON.parse('{"__proto__":{"polluted":true},"sandbox":{"id":"x"},"newState":"started"}'), { sandbox: { id: 'someone-else' }, newState: 'started' }, { sandbox: { id: mine.id }, newState: 'creating' }]) {
        gateway.to(ORG).emit('sandbox.state.updated', payload);
      }
      expect(({} as Record<string, unknown>).polluted).toBeUndefined();
      expect(await waiting).toBe('changed');
      expect(fake.stateOf(mine.id)).toBe('started');
      // A state pushed after `since` and before the wait began counts at once.
      const other = await create('other');
      const otherSince = performance.now();
      await readUntil(async () => fake!.stateOf(other.id) === 'started', 5_000, 'the other sandbox started');
      await new Promise((resolve) => setTimeout(resolve, 50));
      expect(await events.waitForChange(other.id, 'creating', otherSince, 10_000, new AbortController().signal)).toBe('changed');
      // An aborted wait ends unchanged; then, unused, the socket is closed.
      const stopper = new AbortController();
      const aborted = events.waitForChange(other.id, 'started', performance.now(), 10_000, stopper.signal);
      stopper.abort();
      expect(await aborted).toBe('unchanged');
      await readUntil(async () => fake!.gatewaySockets() === 0, 5_000, 'the idle socket closed');
    } finally {
      events.close();
    }
  });
});

describe('settle waits: what an attack on them found', () => {
  it('no more attempts wait at once than LEASE_OPS_SETTLE_WAITS: the rest back off and leave their slots to other work', { timeout: 60_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 50, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_CONCURRENCY: '10', LEASE_OPS_SETTLE_WAITS: '2', LEASE_OPS_BACKOFF_BASE_MS: '50', LEASE_OPS_BACKOFF_CAP_MS: '100' });
    await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));
    const acquires = await Promise.all(Array.from({ length: 6 }, (_, i) => bed!.ops.enqueue({ op: 'acquire', lease: identity(`many-${i}`), params: { runId: `m${i}` } })));
    await bed.waitForAll(acquires.map((a) => a.jobId));
    const sandboxes = await Promise.all(acquires.map(async (a) => ((await bed!.ops.queue.getJob(a.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId));
    const stops = await Promise.all(sandboxes.map((id) => bed!.ops.enqueue({ op: 'stop', lease: identity(id), params: { providerLeaseId: id } })));
    await bed.waitForAll(stops.map((s) => s.jobId));
    // Six resumes whose sandboxes take 3 s to start: all six run at once (10 slots), two wait.
    fake.setTimings({ start: 3_000 });
    const metrics = await import('../src/metrics.ts');
    const waiting = async () => Number(/lease_ops_settle_waits_in_progress (\d+)/.exec(await metrics.registry.metrics())?.[1] ?? -1);
    const resumes = await Promise.all(sandboxes.map((id) => bed!.ops.enqueue({ op: 'resume', lease: identity(id), params: { providerLeaseId: id, leaseMetadata: {} } })));
    const seen = new Set<number>();
    const sampling = (async () => {
      for (let ended = false; !ended; ) {
        seen.add(await waiting());
        ended = (await Promise.all(resumes.map((r) => bed!.ops.queue.getJobState(r.jobId)))).every((s) => s === 'completed' || s === 'failed');
      }
    })();
    const ended = await bed.waitForAll(resumes.map((r) => r.jobId));
    await sampling;
    expect([...ended.values()].every((s) => s === 'completed')).toBe(true);
    expect(seen.has(2)).toBe(true);
    expect(Math.max(...seen)).toBe(2);
  });

  it('a 409 on a sandbox at rest is not waited on (no push would end the wait): the resume backs off', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 50, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_BACKOFF_BASE_MS: '50', LEASE_OPS_BACKOFF_CAP_MS: '100' });
    await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity('rest'), params: { runId: 'rest' } });
    await bed.waitForAll([acquire.jobId]);
    const sandbox = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity(sandbox), params: { providerLeaseId: sandbox } });
    await bed.waitForAll([stop.jobId]);
    const metrics = await import('../src/metrics.ts');
    const resumeWaits = async () => (await metrics.registry.metrics()).split('\n').filter((l) => l.startsWith('lease_ops_settle_waits_total{op="resume"')).join('\n');
    const before = await resumeWaits();
    // The start answers 409 for 600 ms while the sandbox reads `stopped`; then it starts at once.
    fake.setTimings({ start: 0 });
    fake.control(sandbox, { conflictUntil: { at: Date.now() + 600, message: 'Sandbox state change in progress' } });
    const resume = await bed.ops.enqueue({ op: 'resume', lease: identity(sandbox), params: { providerLeaseId: sandbox, leaseMetadata: {} } });
    expect((await bed.waitForAll([resume.jobId])).get(resume.jobId)).toBe('completed');
    expect(await attemptsOf(resume.jobId)).toBeGreaterThan(1);
    expect(await resumeWaits()).toBe(before);
  });

  it('the gateway is looked for under the API URL itself: the key goes nowhere outside it', { timeout: 30_000 }, async () => {
    const { createServer } = await import('node:http');
    const upgrades: string[] = [];
    const server = createServer((_req, res) => res.writeHead(404).end());
    server.on('upgrade', (req, socket) => {
      upgrades.push(req.url ?? '');
      socket.destroy();
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const port = (server.address() as { port: number }).port;
    const events = new DaytonaStateEvents({ apiUrl: `http://127.0.0.1:${port}/tenant-a/api`, apiKey: 'TENANT-A-KEY', organizationId: ORG });
    try {
      expect(await events.waitForChange('x', 'starting', performance.now(), 3_000, new AbortController().signal)).toBe('cannot_push');
      expect(upgrades).toHaveLength(1);
      expect(upgrades[0]).toMatch(/^\/tenant-a\/api\/socket\.io\/\?/);
    } finally {
      events.close();
      server.close();
    }
  });
});

describe('settle waits: provider instances', () => {
  it('an instance provider that leaves the worker\'s cache (its instance changed) is closed, and its gateway socket with it', { timeout: 30_000 }, async () => {
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 50, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create();
    const store = new ProviderInstanceStore(bed.redis, bed.config.LEASE_OPS_PREFIX, { keys: new MasterKeys(randomBytes(32)), allowedApiUrls: [apiUrl] });
    const instances = new InstanceProviders(store, { rateLimiters: localRateLimiters }, [apiUrl]);
    const config = { apiUrl, organizationId: ORG, rateLimits: unpaced };
    await store.create('acme', { name: 'dt', type: 'daytona', config, credentials: { apiKey: KEY } } as never, 'test');
    const first = await instances.resolve('acme', 'env', 'dt');
    if (!('provider' in first)) throw new Error(first.message);
    const ctx = { log: createLogger({ level: 'silent' }) } as never;
    // A wait connects the instance's socket (and, connected after the read, answers at once).
    expect(await first.provider.waitForChange!(ctx, 'x', { kind: 'transitioning', providerState: 'starting' }, { since: performance.now(), timeoutMs: 3_000, signal: new AbortController().signal })).toBe('changed');
    expect(fake.gatewaySockets()).toBe(1);
    await store.update('acme', 'dt', { config: { ...config, timeoutMs: 20_000 } } as never, 'test');
    const second = await instances.resolve('acme', 'env', 'dt');
    if (!('provider' in second)) throw new Error(second.message);
    expect(second.provider).not.toBe(first.provider);
    await readUntil(async () => fake!.gatewaySockets() === 0, 5_000, 'the replaced provider\'s socket closed');
    await second.provider.close?.();
  });
});

describe('one truth while an attempt waits for a push', () => {
  it('the client, /v1, the page, the CLI and /metrics all say the resume is running (not backing off) and its sandbox starting; then all say it ended', { timeout: 60_000 }, async () => {
    const admin = 'settle-views-admin-token-0123456789';
    fake = new DaytonaFake({ apiKey: KEY, organizationId: ORG, notifications: true, timings: { create: 50, start: 120_000, stop: 50, destroy: 50 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: admin, LEASE_OPS_SETTLE_WAIT_MS: '120000' });
    await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: KEY, organizationId: ORG, rateLimits: unpaced }));
    const api = await startTestApi(bed);
    const bearer = { authorization: `Bearer ${admin}` };
    try {
      const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity('wv'), params: { runId: 'wv' } });
      expect((await bed.waitForAll([acquire.jobId])).get(acquire.jobId)).toBe('completed');
      const sandbox = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
      const stop = await bed.ops.enqueue({ op: 'stop', lease: identity('wv'), params: { providerLeaseId: sandbox } });
      expect((await bed.waitForAll([stop.jobId])).get(stop.jobId)).toBe('completed');
      const resume = await bed.ops.enqueue({ op: 'resume', lease: identity('wv'), params: { providerLeaseId: sandbox, leaseMetadata: {} } });
      const metricsText = async () => (await fetch(`${api.base}/metrics`)).text();
      await readUntil(async () => /^lease_ops_settle_waits_in_progress 1$/m.test(await metricsText()), 10_000, 'the resume to wait for the push');

      // The operation: running, in its first attempt.
      const operation = (await api.client.getOperation(resume.jobId))!;
      expect(operation.state).toBe('running');
      // The lease, by either name: the resume executing, nothing backing off, the sandbox seen starting.
      for (const name of ['wv', sandbox]) {
        const view = await api.client.getLease(identity(name));
        expect({ executing: view.executing?.jobId, backingOff: view.backingOff, kind: view.observed?.kind, state: view.observed?.providerState }).toEqual({
          executing: resume.jobId,
          backingOff: null,
          kind: 'transitioning',
          state: 'starting',
        });
      }
      const overview = (await (await fetch(`${api.base}/v1/overview`, { headers: bearer })).json()) as { counts: Record<string, number> };
      expect(overview.counts).toMatchObject({ running: 1, 'backing-off': 0 });
      const metrics = await metricsText();
      expect(metrics).toMatch(/^lease_ops_operations\{state="running"\} 1$/m);
      expect(metrics).toMatch(/^lease_ops_operations\{state="backing-off"\} 0$/m);
      const page = await (await fetch(`${api.base}/ui/leases/daytona/co/env/wv`, { headers: { authorization: `Basic ${Buffer.from(`x:${admin}`).toString('base64')}` } })).text();
      expect(page).toContain('resume executing');
      expect(page).toMatch(/starting <span class="muted">since/);
      const text = await cli(['status', '--provider', 'daytona', '--company', 'co', '--environment', 'env', '--lease', 'wv'], workerEnv(bed, {}));
      expect(text.stdout).toMatch(new RegExp(`executing: +resume ${resume.jobId} running\n +backing off: -\n`));
      expect(text.stdout).toMatch(/observed: +starting \(transitioning\)/);

      // The push comes: the same attempt ends it, and every view says so.
      fake.control(sandbox, { state: 'started' });
      expect((await bed.waitForAll([resume.jobId])).get(resume.jobId)).toBe('completed');
      expect(await attemptsOf(resume.jobId)).toBe(1);
      expect((await api.client.getOperation(resume.jobId))!.state).toBe('completed');
      const after = await api.client.getLease(identity('wv'));
      expect({ executing: after.executing, kind: after.observed?.kind }).toEqual({ executing: null, kind: 'running' });
      expect(await metricsText()).toMatch(/^lease_ops_settle_waits_in_progress 0$/m);
    } finally {
      await api.close();
    }
  });
});
