import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { TestBed, workerEnv } from './helpers/env.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// Short thresholds so the scenarios stay quick: stuck after 1 s, scans every 300 ms.
const STUCK_MS = 1_000;
const SCAN_MS = 300;

describe('the stuck-stop watchdog, through the lane, with worker processes and the Daytona fake', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  let workers: WorkerProcess[];
  beforeAll(async () => {
    bed = await TestBed.create();
    fake = new DaytonaFake({ apiKey: 'wd', timings: { create: 20, start: 50, stop: 50, forceStop: 0, destroy: 10 } });
    const env = workerEnv(bed, {
      LEASE_OPS_PROVIDERS: 'daytona',
      DAYTONA_API_URL: await fake.listen(),
      DAYTONA_API_KEY: 'wd',
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

  it('(a) a stop stuck in stopping is forced once, and the resume queued behind it completes within threshold + scan + 2 s', async () => {
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
});
