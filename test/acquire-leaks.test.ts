import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CreateosFake } from '../src/fakes/createos-fake.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import type { CreateFault } from '../src/fakes/http-fake.ts';
import { createCreateosProvider } from '../src/providers/createos/index.ts';
import { createDaytonaProvider, daytonaSandboxName } from '../src/providers/daytona/index.ts';
import type { LeaseProvider } from '../src/providers/types.ts';
import { gate, QUICK_RECOVERY, readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

/** One provider and its fake, seen as a worker sees them, with what the fake has made. */
interface Subject {
  kind: 'daytona' | 'createos';
  fake: DaytonaFake | CreateosFake;
  /** A provider whose requests time out after 400 ms (for the slow-create case). */
  provider: LeaseProvider;
  /** Sandboxes the cloud is running (or making) now. */
  live(): string[];
  /** The environment of a `lease-ops worker` process using this fake. */
  env: Record<string, string>;
  createPath: RegExp;
}

const SUBJECTS: Record<string, () => Promise<Subject>> = {
  daytona: async () => {
    const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 150, start: 20, stop: 20, forceStop: 0, destroy: 10 } });
    const apiUrl = await fake.listen();
    return {
      kind: 'daytona',
      fake,
      provider: createDaytonaProvider({ apiUrl, apiKey: 'k', timeoutMs: 400 }),
      live: () => fake.ids(),
      env: { LEASE_OPS_PROVIDERS: 'daytona', DAYTONA_API_URL: apiUrl, DAYTONA_API_KEY: 'k' },
      createPath: /^\/sandbox$/,
    };
  },
  createos: async () => {
    const fake = new CreateosFake({ apiKey: 'k', timings: { create: 150, pause: 20, resume: 20, destroy: 10 } });
    const apiUrl = await fake.listen();
    return {
      kind: 'createos',
      fake,
      provider: createCreateosProvider({ apiUrl, apiKey: 'k', timeoutMs: 400, requestsPerMinute: 60_000 }),
      live: () => fake.live(),
      env: { LEASE_OPS_PROVIDERS: 'createos', CREATEOS_API_URL: apiUrl, CREATEOS_API_KEY: 'k' },
      createPath: /^\/v1\/sandboxes$/,
    };
  },
};

for (const [name, make] of Object.entries(SUBJECTS)) {
  // Every block of this file runs beside the others (each has its own cloud fake and bed); the
  // tests of a block that share one run in order.
  describe.concurrent(`acquire never leaks a sandbox: ${name}`, () => {
    let s: Subject;
    let bed: TestBed;
    let seq = 0;
    beforeAll(async () => {
      s = await make();
      // A queue that takes one operation at a time: the clean-up of a failed acquire must
      // never be refused by a queue limit.
      bed = await TestBed.create({ LEASE_OPS_MAX_QUEUED: '1' });
      await bed.startWorker(s.provider);
    });
    afterAll(async () => {
      await bed.close();
      await s.fake.close();
    });
    const acquire = (deadlineMs?: number) =>
      bed.ops.enqueue({ op: 'acquire', lease: { provider: s.provider.name, companyId: 'co', environmentId: 'env', leaseId: `leak-${++seq}` }, params: { runId: `run-${seq}` }, ...(deadlineMs ? { deadlineMs } : {}) });
    const resultOf = async (jobId: string) => (await bed.ops.queue.getJob(jobId))!;

    const FAULTS: [string, CreateFault][] = [
      ['the create reply is cut mid-body', { kind: 'cut' }],
      ['the create reply is not a sandbox at all', { kind: 'invalid' }],
      ['create answers 504 after the sandbox was made', { kind: 'status', status: 504 }],
      ['create answers later than the client waits', { kind: 'slow', delayMs: 1_200 }],
    ];
    it.sequential.each(FAULTS)('%s: a later attempt adopts the sandbox, and it is the only one', async (_what, fault) => {
      const before = new Set(s.live());
      s.fake.failNextCreate(fault);
      const { jobId } = await acquire();
      expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
      const job = await resultOf(jobId);
      const made = s.live().filter((id) => !before.has(id));
      expect(made).toEqual([(job.returnvalue as { providerLeaseId: string }).providerLeaseId]);
      // The fault did bite: the first attempt failed and a retry finished the job.
      expect(job.attemptsMade).toBeGreaterThan(0);
    });

    /** The clean-up a failed acquire queued: exactly one, and it completes. */
    const cleanUpOf = async (acquireJobId: string) => {
      const cleanUps = (await bed.ops.queue.getJobs(['waiting', 'delayed', 'active', 'completed', 'failed'])).filter(
        (j) => j.name === 'abandon-acquire' && (j.data as { params: { acquireJobId: string } }).params.acquireJobId === acquireJobId,
      );
      expect(cleanUps).toHaveLength(1);
      expect((await bed.waitForAll([cleanUps[0]!.id!], 20_000)).get(cleanUps[0]!.id!)).toBe('completed');
      return (await resultOf(cleanUps[0]!.id!)).returnvalue as { providerLeaseId: string | null; state: string };
    };

    it.sequential('an acquire that fails for good has the sandbox it made destroyed through its lane, even while it is still being created', async () => {
      const before = new Set(s.live());
      // The sandbox takes longer to come up than the acquire may take (Daytona refuses to
      // delete it until then: the clean-up waits it out).
      s.fake.failNextCreate({ kind: 'slow-boot', bootMs: 1_500 });
      const { jobId } = await acquire(700);
      expect((await bed.waitForAll([jobId])).get(jobId)).toBe('failed');
      expect((await resultOf(jobId)).failedReason).toMatch(/^deadline_exceeded/);
      expect(await cleanUpOf(jobId)).toMatchObject({ state: 'destroyed' });
      expect(s.live().filter((id) => !before.has(id))).toEqual([]);
    });

    it.sequential('a cloud outage across the acquire\'s deadline: the clean-up waits for the cloud and destroys what was made', async () => {
      const before = new Set(s.live());
      s.fake.failNextCreate({ kind: 'slow-boot', bootMs: 1_000 });
      const arrived = s.fake.nextRequest('POST', s.createPath);
      const { jobId } = await acquire(1_500);
      await arrived;
      const port = new URL(s.fake.http.url).port;
      await s.fake.close(); // the cloud goes away with the sandbox made and booting
      expect((await bed.waitForAll([jobId], 10_000)).get(jobId)).toBe('failed');
      await s.fake.listen(Number(port)); // and comes back
      expect(await cleanUpOf(jobId)).toMatchObject({ state: 'destroyed' });
      expect(s.live().filter((id) => !before.has(id))).toEqual([]);
    });
  });
}

// Each test has its own cloud fake, bed and worker processes: they run at once.
describe.concurrent('acquire never leaks a sandbox when its worker is killed right after the create left', () => {
  for (const [name, make] of Object.entries(SUBJECTS)) {
    it(`${name}: killed twice (past LEASE_OPS_MAX_STALLED), the acquire fails stalled_too_often and its sandbox is destroyed`, { timeout: 60_000 }, async () => {
      const s = await make();
      const bed = await TestBed.create();
      const workers: WorkerProcess[] = [];
      try {
        const env = workerEnv(bed, { ...QUICK_RECOVERY, ...s.env, LEASE_OPS_MAX_STALLED: '1' });
        const start = async () => {
          const w = new WorkerProcess(env);
          workers.push(w);
          await w.ready;
          return w;
        };
        const before = new Set(s.live());
        const first = await start();
        const held = gate();
        s.fake.failNextCreate({ kind: 'hold', until: held.promise });
        const created = s.fake.nextRequest('POST', s.createPath);
        const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: { provider: name, companyId: 'co', environmentId: 'env', leaseId: 'killed-twice' }, params: { runId: 'k2' } });
        await created;
        await first.kill();
        held.open();
        // The re-run looks its sandbox up, and dies at that moment too.
        const lookup = s.fake.nextRequest('GET', name === 'daytona' ? /^\/sandbox\/lease-ops-/ : /^\/v1\/sandboxes$/);
        const second = await start();
        await lookup;
        await second.kill();
        await start();
        expect((await bed.waitForAll([jobId], 30_000)).get(jobId)).toBe('failed');
        expect((await bed.ops.queue.getJob(jobId))!.failedReason).toMatch(/^stalled_too_often: /);
        const cleanUp = (await bed.ops.queue.getJobs(['waiting', 'delayed', 'active', 'completed'])).find((j) => j.name === 'abandon-acquire');
        expect(cleanUp).toBeDefined();
        expect((await bed.waitForAll([cleanUp!.id!], 20_000)).get(cleanUp!.id!)).toBe('completed');
        expect(s.live().filter((id) => !before.has(id))).toEqual([]);
      } finally {
        // Settled, not all: a worker that would not stop (killed by terminate) still leaves the bed and fake to close.
        await Promise.allSettled(workers.map((w) => (w.child.exitCode === null && w.child.signalCode === null ? w.terminate() : null)));
        await bed.close();
        await s.fake.close();
      }
    });
  }

  for (const [name, make] of Object.entries(SUBJECTS)) {
    it(`${name}: the next worker's attempt adopts the sandbox the killed one asked for`, { timeout: 60_000 }, async () => {
      const s = await make();
      const bed = await TestBed.create();
      const workers: WorkerProcess[] = [];
      try {
        const env = workerEnv(bed, { ...QUICK_RECOVERY, ...s.env });
        const first = new WorkerProcess(env);
        workers.push(first);
        await first.ready;
        const held = gate();
        s.fake.failNextCreate({ kind: 'hold', until: held.promise });
        const arrived = s.fake.nextRequest('POST', s.createPath);
        const before = new Set(s.live());
        const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: { provider: name, companyId: 'co', environmentId: 'env', leaseId: 'killed' }, params: { runId: 'killed' } });
        await arrived; // the create is at the cloud, which makes the sandbox
        await first.kill();
        held.open();
        const second = new WorkerProcess(env);
        workers.push(second);
        await second.ready;
        expect((await bed.waitForAll([jobId], 30_000)).get(jobId)).toBe('completed');
        const job = (await bed.ops.queue.getJob(jobId))!;
        const made = s.live().filter((id) => !before.has(id));
        expect(made).toEqual([(job.returnvalue as { providerLeaseId: string }).providerLeaseId]);
        if (name === 'daytona') expect(s.fake instanceof DaytonaFake && s.fake.stateOf(daytonaSandboxName(jobId))).toBe('started');
      } finally {
        // Settled, not all: a worker that would not stop (killed by terminate) still leaves the bed and fake to close.
        await Promise.allSettled(workers.map((w) => (w.child.exitCode === null && w.child.signalCode === null ? w.terminate() : null)));
        await bed.close();
        await s.fake.close();
      }
    });
  }
});

describe.concurrent('the clean-up after a failed acquire never touches a lease, and is not lost', () => {
  let fake: DaytonaFake;
  let bed: TestBed;
  let provider: LeaseProvider;
  let worker: Awaited<ReturnType<TestBed['startWorker']>>;
  beforeAll(async () => {
    fake = new DaytonaFake({ apiKey: 'k', timings: { create: 50, start: 20, stop: 20, forceStop: 0, destroy: 10 } });
    provider = createDaytonaProvider({ apiUrl: await fake.listen(), apiKey: 'k', timeoutMs: 2_000 });
    bed = await TestBed.create({ LEASE_OPS_SWEEP_INTERVAL_MS: '200', LEASE_OPS_INFLIGHT_GRACE_MS: '1000' });
    worker = await bed.startWorker(provider);
  });
  afterAll(async () => {
    await bed.close();
    await fake.close();
  });
  const identity = (leaseId: string) => ({ provider: provider.name, companyId: 'co', environmentId: 'env', leaseId });
  const cleanUps = async () => (await bed.ops.queue.getJobs(['waiting', 'delayed', 'active', 'completed', 'failed'])).filter((j) => j.name === 'abandon-acquire');

  it.sequential('a clean-up queued for an acquire that then completed after all (a crash between the two) leaves its sandbox alone', async () => {
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: identity('completed-anyway'), params: { runId: 'r' } });
    expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
    const sandbox = ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    // The state a crash leaves: the clean-up was queued, the acquire's re-run completed.
    const cleanUp = await bed.ops.enqueueAbandon(identity('completed-anyway'), jobId, {});
    expect((await bed.waitForAll([cleanUp.jobId])).get(cleanUp.jobId)).toBe('completed');
    expect((await bed.ops.queue.getJob(cleanUp.jobId))!.returnvalue).toEqual({ providerLeaseId: null, state: 'none' });
    expect(fake.stateOf(sandbox)).toBe('started');
  });

  it.sequential('a clean-up is not failed by the stall limit (its workers dying is no reason to leave the sandbox): its deadline bounds it', async () => {
    // A sandbox a failed acquire left, and its clean-up queued while no worker runs.
    const running = worker;
    await running.close();
    const acquireJobId = `${'x'.repeat(22)}.stalled-acquire`;
    const res = await fetch(`${fake.http.url}/sandbox`, {
      method: 'POST',
      headers: { authorization: 'Bearer k', 'content-type': 'application/json' },
      body: JSON.stringify({ name: daytonaSandboxName(acquireJobId), labels: { 'lease-ops/company': 'co', 'lease-ops/environment': 'env' } }),
    });
    const left = ((await res.json()) as { id: string }).id;
    const cleanUp = await bed.ops.enqueueAbandon(identity('stalled-cleanup'), acquireJobId, {});
    // As if two workers had died running it.
    await bed.redis.hset(bed.ops.queue.toKey(cleanUp.jobId), 'stc', 2);
    worker = await bed.startWorker(provider);
    expect((await bed.waitForAll([cleanUp.jobId], 10_000)).get(cleanUp.jobId)).toBe('completed');
    expect((await bed.ops.queue.getJob(cleanUp.jobId))!.returnvalue).toEqual({ providerLeaseId: left, state: 'destroyed' });
  });

  it.sequential('an acquire an operator removed while it backed off still gets its sandbox cleaned up', async () => {
    const before = new Set(fake.ids());
    fake.failNextCreate({ kind: 'slow-boot', bootMs: 60_000 }); // it stays creating: the acquire keeps backing off
    const arrived = fake.nextRequest('POST', /^\/sandbox$/);
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: identity('removed'), params: { runId: 'r' } });
    await arrived;
    // Removed while it backs off: a remove that found it running again (its delay can end
    // between the two reads on a loaded machine) removes nothing, and is tried at its next delay.
    await readUntil(async () => (await bed.ops.queue.getJobState(jobId)) === 'delayed' && (await bed.ops.queue.remove(jobId)) === 1, 20_000, 'the backing-off acquire removed');
    // Two sweeps a second apart find it gone (200 ms apart here; slower on a loaded machine).
    const cleanUp = await readUntil(async () => (await cleanUps()).find((j) => (j.data as { params: { acquireJobId: string } }).params.acquireJobId === jobId), 30_000, 'a clean-up for the removed acquire');
    // Daytona deletes it only once it is up: let it come up now.
    const made = fake.ids().filter((id) => !before.has(id));
    expect(made).toHaveLength(1);
    fake.control(made[0]!, { state: 'started' });
    expect((await bed.waitForAll([cleanUp.id!], 20_000)).get(cleanUp.id!)).toBe('completed');
    expect(fake.ids().filter((id) => !before.has(id))).toEqual([]);
  });

  it.sequential('a request is never sent after its operation\'s deadline, and none outlives it', async () => {
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: identity('slow-api'), params: { runId: 'r' } });
    await bed.waitForAll([jobId]);
    const sandbox = ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    fake.control(sandbox, { replyDelayMs: 20_000 });
    const started = Date.now();
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity(sandbox), params: { providerLeaseId: sandbox }, deadlineMs: 1_500 });
    const arrivals: number[] = [];
    // Its own sandbox's requests: another test's clean-up may still call the cloud meanwhile.
    const onRequest = (r: { path: string }) => r.path.includes(sandbox) && arrivals.push(Date.now());
    fake.http.on('request', onRequest);
    expect((await bed.waitForAll([stop.jobId], 12_000)).get(stop.jobId)).toBe('failed');
    fake.http.off('request', onRequest);
    // The request in flight is cut at the deadline, and the failure waits only
    // LEASE_OPS_INFLIGHT_GRACE_MS (1 s here; 5 s by default) more, as the cloud may still act on it.
    expect(Date.now() - started).toBeLessThan(1_500 + 1_000 + 2_500);
    expect(arrivals.length).toBeGreaterThan(0);
    expect(arrivals.filter((at) => at > started + 1_500)).toEqual([]);
    expect((await bed.ops.queue.getJob(stop.jobId))!.failedReason).toMatch(/^deadline_exceeded: /);
    fake.control(sandbox, { replyDelayMs: 0 });
  });
});

describe.concurrent('an acquire that BullMQ removes as it completes is never taken for one that vanished', () => {
  let fake: DaytonaFake;
  let bed: TestBed;
  beforeAll(async () => {
    fake = new DaytonaFake({ apiKey: 'k', timings: { create: 5, start: 5, stop: 5, forceStop: 0, destroy: 5 } });
    const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
    const provider = createDaytonaProvider({ apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced });
    // Completed jobs removed at once, and the sweep (which looks for vanished acquires) as often as it goes.
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '0', LEASE_OPS_SWEEP_INTERVAL_MS: '100', LEASE_OPS_CONCURRENCY: '20' });
    await Promise.all([bed.startWorker(provider), bed.startWorker(provider)]);
  });
  afterAll(async () => {
    await bed.close();
    await fake.close();
  });

  it('400 acquires on 400 leases: every sandbox handed out is still running, and nothing was cleaned up', async () => {
    const acquires = await Promise.all(
      Array.from({ length: 400 }, (_, i) => bed.ops.enqueue({ op: 'acquire', lease: { provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId: `handed-out-${i}` }, params: { runId: `r${i}` } })),
    );
    const ended = await bed.waitForAll(acquires.map((a) => a.jobId), 60_000);
    expect([...ended.values()].every((state) => state === 'completed')).toBe(true);
    // Once every acquire is marked completed (the mark outlives the job BullMQ removed; the
    // sweep may also forget an entry whose job it saw completed) and no lane has work, any
    // clean-up queued has run.
    const allMarkedCompleted = async () => {
      const entries = Object.values(await bed.redis.hgetall(bed.ops.lanes.acquiresKey));
      return entries.every((entry) => entry.startsWith('completed '));
    };
    await readUntil(async () => (await allMarkedCompleted()) && (await bed.ops.lanes.openLaneCount()) === 0, 10_000, 'every acquire marked completed');
    expect(fake.calls.filter((c) => c.method === 'DELETE')).toEqual([]);
    expect(fake.ids().filter((id) => fake.stateOf(id) !== 'started')).toEqual([]);
    expect(fake.ids()).toHaveLength(400);
  });
});
