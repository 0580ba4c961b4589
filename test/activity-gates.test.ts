import { afterEach, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { ActivityNotFoundError, LeaseClosingError } from '../src/errors.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { runSimulatedCloud } from '../src/providers/simulated/index.ts';
import { freePort } from '../src/redis-server.ts';
import { gate, QUICK_RECOVERY, readUntil, TestBed, testConfig } from './helpers/env.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// Activity gates (issue 25, part 2): work inside a sandbox never outlives its stop (seed 000).

let bed: TestBed | undefined;
let fake: DaytonaFake | undefined;
let client: LeaseOpsClient | undefined;
afterEach(async () => {
  await client?.close();
  await bed?.close();
  await fake?.close();
  client = bed = fake = undefined;
});

const lease = (leaseId: string) => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });

async function setUp() {
  bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '600' });
  fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 50, stop: 50, forceStop: 0, destroy: 10 } });
  const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
  await bed.startWorker(createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced }));
  client = new LeaseOpsClient(bed.config);
  const acquired = await client.enqueue('acquire', lease('run'), { runId: 'run' });
  const id = ((await client.waitForResult(acquired.jobId, 10_000)).result as { providerLeaseId: string }).providerLeaseId;
  return { bed, fake, client, id };
}

/** When the fake was first asked to stop (or delete) the sandbox, on the shared clock. */
const firstStop = (f: DaytonaFake, id: string) => f.calls.find((c) => c.sandboxId === id && (c.path.endsWith('/stop') || c.method === 'DELETE'))?.start;

/**
 * An activity's holder: heartbeats until told to end; once a cancel is asked it keeps going
 * `ignoresCancelFor` heartbeats more (a process that ignores its cancel for a while), then ends.
 */
function holder(c: LeaseOpsClient, token: string, ignoresCancelFor = 0) {
  const done = gate<bigint>();
  let sawCancel = false;
  let left = ignoresCancelFor;
  const beat = async (): Promise<void> => {
    const { cancel } = await c.heartbeatActivity(token, 2_000);
    sawCancel ||= cancel;
    if (sawCancel && left-- <= 0) {
      await c.endActivity(token);
      done.open(process.hrtime.bigint());
      return;
    }
    setTimeout(() => void beat(), 50);
  };
  void beat();
  return { ended: done.promise, sawCancel: () => sawCancel };
}

describe('activity gates', () => {
  it('seed 000: an exec runs, a release with cancelActiveWork and a resume come at once: the release waits for the exec to end, the resume follows, and no one sees an error', async () => {
    const { bed, fake, client, id } = await setUp();
    const { token } = await client.beginActivity(lease(id), 'exec', 2_000);
    const release = await client.enqueue('release', lease(id), { providerLeaseId: id, resourceDisposition: 'stop_and_retain', cancelActiveWork: true });
    const resume = await client.enqueue('resume', lease(id), { providerLeaseId: id });
    const exec = holder(client, token, 5);
    const ended = await exec.ended;
    expect(exec.sawCancel()).toBe(true);
    const results = await bed.waitForAll([release.jobId, resume.jobId], 20_000);
    expect([...results.values()]).toEqual(['completed', 'completed']);
    // The sandbox was stopped only after the exec ended, and runs again.
    expect(firstStop(fake, id)!).toBeGreaterThan(ended);
    expect(fake.stateOf(id)).toBe('started');
    const timeline = await client.getLeaseTimeline(lease(id));
    expect(timeline.events.some((e) => e.kind === 'backing-off' && e.op === 'release' && /waiting for 1 activity in the sandbox \(exec; .*\) to end: asked to cancel/.test(e.message ?? ''))).toBe(true);
  });

  it('no activity begins while a stop, release or destroy of the lease is queued or runs (lease_closing); one begins again once it ended', async () => {
    const { bed, client, id } = await setUp();
    const { token } = await client.beginActivity(lease(id), 'exec', 5_000);
    const stop = await client.enqueue('stop', lease(id), { providerLeaseId: id });
    await expect(client.beginActivity(lease(id), 'sync', 5_000)).rejects.toBeInstanceOf(LeaseClosingError);
    // By its other name too: one lease.
    await expect(client.beginActivity(lease('run'), 'sync', 5_000)).rejects.toBeInstanceOf(LeaseClosingError);
    await client.endActivity(token);
    await bed.waitForAll([stop.jobId]);
    await expect(client.beginActivity(lease(id), 'sync', 5_000)).resolves.toMatchObject({ token: expect.any(String) });
  });

  it('a holder that died (no heartbeat) is gone at its TTL: the stop goes on then, and its late heartbeat is refused, never opening the gate again', async () => {
    const { bed, fake, client, id } = await setUp();
    const begunAt = process.hrtime.bigint();
    const { token } = await client.beginActivity(lease(id), 'exec', 1_500);
    const stop = await client.enqueue('stop', lease(id), { providerLeaseId: id });
    expect((await bed.waitForAll([stop.jobId], 20_000)).get(stop.jobId)).toBe('completed');
    expect(Number(firstStop(fake, id)! - begunAt) / 1e6).toBeGreaterThanOrEqual(1_400);
    await expect(client.heartbeatActivity(token, 5_000)).rejects.toBeInstanceOf(ActivityNotFoundError);
    // The next stop waits for nothing.
    const again = await client.enqueue('stop', lease(id), { providerLeaseId: id }, { idempotencyKey: 'again' });
    const before = Date.now();
    await bed.waitForAll([again.jobId], 10_000);
    expect(Date.now() - before).toBeLessThan(1_000);
  });

  it('200 activities on one lease: the stop waits for the last of them', async () => {
    const { bed, fake, client, id } = await setUp();
    const tokens = await Promise.all(Array.from({ length: 200 }, (_, i) => client.beginActivity(lease(id), `exec-${i}`, 10_000).then((a) => a.token)));
    expect(new Set(tokens).size).toBe(200);
    const stop = await client.enqueue('stop', lease(id), { providerLeaseId: id });
    await Promise.all(tokens.slice(0, 199).map((t) => client.endActivity(t)));
    await readUntil(async () => (await client.getLeaseTimeline(lease(id))).events.some((e) => e.kind === 'backing-off' && /waiting for 1 activity/.test(e.message ?? '')), 10_000, 'the stop waiting for the last one');
    expect(firstStop(fake, id)).toBeUndefined();
    const lastEnded = process.hrtime.bigint();
    await client.endActivity(tokens[199]!);
    expect((await bed.waitForAll([stop.jobId], 10_000)).get(stop.jobId)).toBe('completed');
    expect(firstStop(fake, id)!).toBeGreaterThan(lastEnded);
  });

  it('a force-stop waits for nothing, but a resume after it waits for the work of the episode it ended', async () => {
    const { bed, client, id } = await setUp();
    const { token } = await client.beginActivity(lease(id), 'exec', 10_000);
    const force = await client.enqueue('force-stop', lease(id), { providerLeaseId: id });
    expect((await bed.waitForAll([force.jobId], 10_000)).get(force.jobId)).toBe('completed');
    const resume = await client.enqueue('resume', lease(id), { providerLeaseId: id });
    await readUntil(async () => (await client.getLeaseTimeline(lease(id))).events.some((e) => e.kind === 'backing-off' && e.op === 'resume' && /of the stopped episode/.test(e.message ?? '')), 10_000, 'the resume waiting');
    const endedAt = process.hrtime.bigint();
    await client.endActivity(token);
    expect((await bed.waitForAll([resume.jobId], 10_000)).get(resume.jobId)).toBe('completed');
    // An activity begun after the stop belongs to the next episode: a resume does not wait for it.
    const next = await client.beginActivity(lease(id), 'exec', 10_000);
    const resumeAgain = await client.enqueue('resume', lease(id), { providerLeaseId: id }, { idempotencyKey: 'again' });
    expect((await bed.waitForAll([resumeAgain.jobId], 10_000)).get(resumeAgain.jobId)).toBe('completed');
    await client.endActivity(next.token);
    void endedAt;
  });
});

describe('activity gates across a Redis restart', () => {
  it('a stop waiting for an open activity keeps waiting across a Redis crash and restart (AOF always), and runs once the activity ends', { timeout: 120_000 }, async () => {
    const redis = await RedisProcess.start(['--appendonly', 'yes', '--appendfsync', 'always']);
    const cloudPort = await freePort();
    const cloud = await runSimulatedCloud(cloudPort, '127.0.0.1');
    const config = testConfig({ REDIS_URL: redis.url, ...QUICK_RECOVERY });
    const worker = new WorkerProcess({ REDIS_URL: redis.url, LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX, LEASE_OPS_PROVIDERS: 'simulated', LEASE_OPS_SIMULATED_URL: `http://127.0.0.1:${cloudPort}`, ...QUICK_RECOVERY });
    const restartClient = new LeaseOpsClient(config, { failFast: false });
    try {
      await worker.ready;
      const lease = (leaseId: string) => ({ provider: 'simulated', companyId: 'co', environmentId: 'env', leaseId });
      const acquired = await restartClient.enqueueAndWait('acquire', lease('run'), { runId: 'run' }, { waitMs: 20_000 });
      const id = (acquired.operation.result as { providerLeaseId: string }).providerLeaseId;
      const { token } = await restartClient.beginActivity(lease(id), 'exec', 30_000);
      const stop = await restartClient.enqueue('stop', lease(id), { providerLeaseId: id });
      // The stop is at its lane's head, waiting for the activity.
      await readUntil(
        async () => (await restartClient.getLeaseTimeline(lease(id))).events.some((e) => e.op === 'stop' && /waiting for 1 activity/.test(e.message ?? '')),
        20_000,
        'the stop waiting for the activity',
      );
      await redis.crash();
      await redis.restart();
      // Back: the activity and the stop survived; the stop still waits (no stop reached the cloud).
      expect((await restartClient.heartbeatActivity(token, 30_000)).cancel).toBe(false);
      await readUntil(async () => (await restartClient.getOperation(stop.jobId))?.state === 'backing-off', 20_000, 'the stop backing off again after the restart');
      expect(firstStop(cloud, id)).toBeUndefined();
      const ended = process.hrtime.bigint();
      await restartClient.endActivity(token);
      expect((await restartClient.waitForResult(stop.jobId, 20_000)).result).toMatchObject({ state: 'stopped' });
      expect(firstStop(cloud, id)!).toBeGreaterThan(ended);
    } finally {
      await restartClient.close();
      await worker.terminate();
      await cloud.close();
      await redis.stop();
    }
  });
});
