import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CreateosFake } from '../src/fakes/createos-fake.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { LeaseOpsClient } from '../src/client.ts';
import { queueMetrics } from '../src/metrics.ts';
import { readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// Short thresholds so the scenarios stay quick: stuck after 1 s, scans every 300 ms.
const STUCK_MS = 1_000;
const SCAN_MS = 300;

// (b) to (e) run at once, each on sandboxes of its own (they mostly wait on backoffs and
// settling); (a), a latency bound, and (f), a count of what needs attention, run alone.
describe.concurrent('settling, deadlines and the stuck-stop watchdog, through the lane, with worker processes and the fakes', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  let createos: CreateosFake;
  let workers: WorkerProcess[];
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    fake = new DaytonaFake({ apiKey: 'wd', timings: { create: 20, start: 50, stop: 50, forceStop: 0, destroy: 10 } });
    createos = new CreateosFake({ apiKey: 'co', timings: { create: 20, pause: 800, resume: 100, destroy: 10 } });
    const env = workerEnv(bed, {
      LEASE_OPS_PROVIDERS: 'daytona,createos',
      DAYTONA_API_URL: await fake.listen(),
      DAYTONA_API_KEY: 'wd',
      CREATEOS_API_URL: await createos.listen(),
      CREATEOS_API_KEY: 'co',
      LEASE_OPS_KEEP_COMPLETED_S: '3600',
      LEASE_OPS_STUCK_STOPPING_MS: String(STUCK_MS),
      LEASE_OPS_WATCHDOG_INTERVAL_MS: String(SCAN_MS),
      LEASE_OPS_BACKOFF_BASE_MS: '50',
      LEASE_OPS_BACKOFF_CAP_MS: '300',
    });
    workers = [new WorkerProcess(env), new WorkerProcess(env)];
    await Promise.all(workers.map((w) => w.ready));
  });
  afterAll(async () => {
    await Promise.all(workers.map((w) => w.terminate()));
    await fake.close();
    await createos.close();
    await bed.close();
  });

  const identity = (leaseId: string): LeaseIdentity => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });
  async function startedSandbox(name: string): Promise<string> {
    const { jobId } = await bed.ops.enqueue({ op: 'acquire', lease: identity(name), params: { runId: name } });
    await bed.waitForAll([jobId]);
    return ((await bed.ops.queue.getJob(jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
  }
  const forceStops = (id: string) => fake.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/stop') && c.query.includes('force=true'));

  /** A graceful stop, then a resume queued behind it; resolves when the resume ended. */
  async function stopThenResume(id: string): Promise<{ resumeMs: number; states: Map<string, string> }> {
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity(id), params: { providerLeaseId: id } });
    const enqueuedAt = Date.now();
    const resume = await bed.ops.enqueue({ op: 'resume', lease: identity(id), params: { providerLeaseId: id, leaseMetadata: {} } });
    const states = await bed.waitForAll([stop.jobId, resume.jobId], 30_000);
    return { resumeMs: Date.now() - enqueuedAt, states: new Map([...states].map(([k, v]) => [k === stop.jobId ? 'stop' : 'resume', v])) };
  }

  it.sequential('(a) a stop stuck in stopping is forced once, and the resume queued behind it completes within threshold + scan + 2 s', async () => {
    const id = await startedSandbox('wd-a');
    fake.control(id, { stuckStoppingMs: 120_000 }); // a process that ignores SIGTERM
    const { resumeMs, states } = await stopThenResume(id);
    expect(states).toEqual(new Map([['stop', 'completed'], ['resume', 'completed']]));
    expect(resumeMs).toBeLessThan(STUCK_MS + SCAN_MS + 2_000);
    expect(forceStops(id)).toHaveLength(1);
    expect(fake.stateOf(id)).toBe('started');
    expect(fake.http.overlaps()).toEqual([]);
  });

  it('(b) a force-stop refused twice is retried and then accepted', async () => {
    const id = await startedSandbox('wd-b');
    fake.control(id, { stuckStoppingMs: 120_000, refuseForceStops: 2 });
    const { states } = await stopThenResume(id);
    expect(states).toEqual(new Map([['stop', 'completed'], ['resume', 'completed']]));
    const tries = forceStops(id);
    expect(tries.map((c) => c.status)).toEqual([409, 409, 200]);
    expect(fake.stateOf(id)).toBe('started');
    expect(fake.http.overlaps()).toEqual([]);
  });

  it('(c) a stop that settles on its own before the threshold is never forced', async () => {
    const id = await startedSandbox('wd-c');
    fake.control(id, { stuckStoppingMs: STUCK_MS * 0.6 });
    const { states } = await stopThenResume(id);
    expect(states).toEqual(new Map([['stop', 'completed'], ['resume', 'completed']]));
    expect(forceStops(id)).toEqual([]);
    expect(fake.http.overlaps()).toEqual([]);
  });

  const SETTLING = 'The stopped Daytona sandbox is still settling cancelled work. Retry shortly.';
  const stoppedSandbox = async (name: string) => {
    const id = await startedSandbox(name);
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: identity(id), params: { providerLeaseId: id } });
    await bed.waitForAll([jobId]);
    return id;
  };
  const starts = (id: string) => fake.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/start'));

  it('(d) a resume that meets "still settling cancelled work" for 3 s retries with backoff and succeeds', async () => {
    const id = await stoppedSandbox('wd-d');
    fake.control(id, { conflictUntil: { at: Date.now() + 3_000, message: SETTLING } });
    const { jobId } = await bed.ops.enqueue({ op: 'resume', lease: identity(id), params: { providerLeaseId: id, leaseMetadata: {} } });
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('completed');
    const tries = starts(id);
    expect(tries.filter((c) => c.status === 409).length).toBeGreaterThanOrEqual(3);
    expect(tries.at(-1)?.status).toBe(200);
    // Backoff: each gap between tries is at least the delay it was given, which doubles from
    // 50 ms to the 300 ms cap (less a quarter of jitter). A lower bound: a loaded machine only
    // lengthens a gap (one CI run's first gap was 491 ms, its later ones 302 ms, so "the later
    // gaps are longer than the first" failed while the backoff was right).
    const gaps = tries.slice(1).map((c, i) => Number(c.start - tries[i]!.start) / 1e6);
    gaps.forEach((gap, i) => expect(gap).toBeGreaterThanOrEqual(0.75 * Math.min(300, 50 * 2 ** i) - 1));
    expect(Math.max(...gaps)).toBeGreaterThanOrEqual(0.75 * 300 - 1);
    expect(fake.stateOf(id)).toBe('started');
  });

  it('(d) ...and one that meets it past its deadline fails, naming the error, with no try after the deadline', async () => {
    const id = await stoppedSandbox('wd-d2');
    fake.control(id, { conflictUntil: { at: Date.now() + 60_000, message: SETTLING } });
    const enqueuedAt = process.hrtime.bigint();
    const { jobId } = await bed.ops.enqueue({ op: 'resume', lease: identity(id), params: { providerLeaseId: id, leaseMetadata: {} }, deadlineMs: 1_500 });
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('failed');
    const reason = (await bed.ops.queue.getJob(jobId))?.failedReason ?? '';
    // The last attempt's error: the settling reply, or (on a busy machine, the last request
    // sent with little time left) that request cut at the deadline; either way after settling replies.
    expect(reason).toMatch(/^deadline_exceeded: last provider error: (.*still settling cancelled work|.*could not be reached \(ECONNABORTED\))/);
    expect(starts(id).length).toBeGreaterThanOrEqual(2);
    // No attempt began after the deadline. Judged by each attempt's first call as it arrived:
    // a request sent just before the deadline can arrive a moment after it on a busy machine.
    const deadline = enqueuedAt + 1_500_000_000n;
    const firstCallOf = new Map<string, bigint>();
    for (const c of fake.calls) if (c.sandboxId === id && c.attempt && !firstCallOf.has(c.attempt)) firstCallOf.set(c.attempt, c.start);
    expect([...firstCallOf.entries()].filter(([, start]) => start > deadline + 200_000_000n)).toEqual([]);
  });

  it('(e) a release and a resume enqueued at once never overlap: the resume runs after the cleanup', async () => {
    const identityOf = (leaseId: string): LeaseIdentity => ({ provider: 'createos', companyId: 'co', environmentId: 'env', leaseId });
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identityOf('e-new'), params: { runId: 'e' } });
    await bed.waitForAll([acquire.jobId]);
    const id = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    const [release, resume] = await Promise.all([
      bed.ops.enqueue({ op: 'release', lease: identityOf(id), params: { providerLeaseId: id, leaseMetadata: {}, resourceDisposition: 'stop_and_retain' } }),
      bed.ops.enqueue({ op: 'resume', lease: identityOf(id), params: { providerLeaseId: id, leaseMetadata: {} } }),
    ]);
    const ended = await bed.waitForAll([release.jobId, resume.jobId], 20_000);
    expect([...ended.values()]).toEqual(['completed', 'completed']);
    const releaseJob = await bed.ops.queue.getJob(release.jobId);
    const resumeJob = await bed.ops.queue.getJob(resume.jobId);
    // The release was accepted first, so it ran first: its end precedes the resume's start.
    expect(releaseJob!.finishedOn!).toBeLessThanOrEqual(resumeJob!.processedOn!);
    const calls = createos.calls.filter((c) => c.sandboxId === id);
    const pauses = calls.filter((c) => c.path.endsWith('/pause'));
    const resumes = calls.filter((c) => c.path.endsWith('/resume'));
    expect(pauses.length).toBe(1);
    expect(resumes.length).toBe(1);
    expect(pauses[0]!.end < resumes[0]!.start).toBe(true);
    expect(createos.http.overlaps()).toEqual([]);
    expect(createos.statusOf(id)).toBe('running');
  });

  it.sequential('(f) a sandbox stuck on its way to paused shows as stuck in attention and metrics, though CreateOS cannot force it', async () => {
    const identityOf = (leaseId: string): LeaseIdentity => ({ provider: 'createos', companyId: 'co', environmentId: 'env', leaseId });
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identityOf('f-new'), params: { runId: 'f' } });
    await bed.waitForAll([acquire.jobId]);
    const id = ((await bed.ops.queue.getJob(acquire.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
    createos.control(id, { pauseMs: 120_000 }); // its snapshot never finishes
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identityOf(id), params: { providerLeaseId: id }, deadlineMs: 30_000 });
    const client = new LeaseOpsClient({ ...bed.config, LEASE_OPS_STUCK_STOPPING_MS: STUCK_MS });
    try {
      // Named as it was acquired, whichever name the stop used.
      const item = await readUntil(async () => (await client.leasesNeedingAttention()).find((a) => a.laneId === acquire.laneId), 10_000, 'the stuck pause in attention');
      expect(item).toMatchObject({ reason: 'stuck_stopping', lease: { leaseId: 'f-new' } });
      expect(item.detail).toMatch(new RegExp(`sandbox ${id} has been pausing for \\d+ s`));
      expect(await queueMetrics(client, { bullmqTotals: false })()).toMatch(/^lease_ops_leases_needing_attention\{reason="stuck_stopping"\} 1$/m);
      // No force-stop was queued for it: CreateOS has none to offer.
      expect((await bed.ops.queue.getJobs(['waiting', 'delayed', 'active', 'completed', 'failed'])).filter((j) => j.name === 'force-stop' && j.data.lease.leaseId === id)).toEqual([]);
      // Once it pauses after all, the stop completes and the lease leaves the list.
      createos.control(id, { status: 'paused' });
      expect((await bed.waitForAll([stop.jobId], 15_000)).get(stop.jobId)).toBe('completed');
      expect((await client.leasesNeedingAttention()).find((a) => a.laneId === acquire.laneId)).toBeUndefined();
    } finally {
      await client.close();
    }
  });
});
