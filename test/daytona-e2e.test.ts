import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import type { OperationName } from '../src/operations.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { TestBed } from './helpers/env.ts';
import { seededFraction } from './helpers/recording-provider.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const LEASES = 20;
const OPS_PER_LEASE = 12;

/** What a step leaves the sandbox in; `unchanged` for a release that keeps it as it is. */
type Step = { op: OperationName; params: (id: string) => unknown; leaves: 'started' | 'stopped' | 'gone' | 'unchanged' };
const STEPS: Step[] = [
  { op: 'stop', params: (id) => ({ providerLeaseId: id }), leaves: 'stopped' },
  { op: 'resume', params: (id) => ({ providerLeaseId: id, leaseMetadata: {} }), leaves: 'started' },
  { op: 'release', params: (id) => ({ providerLeaseId: id, leaseMetadata: {}, resourceDisposition: 'stop_and_retain' }), leaves: 'stopped' },
  { op: 'release', params: (id) => ({ providerLeaseId: id, leaseMetadata: {}, resourceDisposition: 'keep_running' }), leaves: 'unchanged' },
];
const DESTROY: Step = { op: 'destroy', params: (id) => ({ providerLeaseId: id }), leaves: 'gone' };

describe('end to end: several worker processes, the Daytona client, the Daytona fake', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  let workers: WorkerProcess[];

  beforeAll(async () => {
    bed = await TestBed.create();
    fake = new DaytonaFake({ apiKey: 'e2e-key', timings: { create: 30, start: 40, stop: 40, forceStop: 0, destroy: 20 } });
    const apiUrl = await fake.listen();
    const env = {
      REDIS_URL: bed.config.REDIS_URL,
      LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX,
      LEASE_OPS_PROVIDERS: 'daytona',
      DAYTONA_API_URL: apiUrl,
      DAYTONA_API_KEY: 'e2e-key',
      LEASE_OPS_CONCURRENCY: '10',
      LEASE_OPS_BACKOFF_BASE_MS: '20',
      LEASE_OPS_BACKOFF_CAP_MS: '100',
    };
    workers = [new WorkerProcess(env), new WorkerProcess(env), new WorkerProcess(env)];
    await Promise.all(workers.map((w) => w.ready));
  });
  afterAll(async () => {
    await Promise.all(workers.map((w) => w.terminate()));
    await fake.close();
    await bed.close();
  });

  it('ends every sandbox in the state its last operation asked for, with no overlapping calls per sandbox', async () => {
    const identity = (leaseId: string): LeaseIdentity => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });

    // Acquire the sandboxes (each acquire names its own lane).
    const acquires = await Promise.all(
      Array.from({ length: LEASES }, (_, i) => bed.ops.enqueue({ op: 'acquire', lease: identity(`new-${i}`), params: { runId: `run-${i}` } })),
    );
    const acquired = await bed.waitForAll(acquires.map((a) => a.jobId));
    expect([...acquired.values()].every((s) => s === 'completed')).toBe(true);
    const sandboxIds = await Promise.all(acquires.map(async (a) => ((await bed.ops.queue.getJob(a.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId));

    // A burst of mixed operations on every lease at once; the last one decides the end state.
    const expected = new Map<string, string>();
    const ids: string[] = [];
    await Promise.all(
      sandboxIds.map(async (id, l) => {
        let state = 'started';
        for (let i = 0; i < OPS_PER_LEASE; i++) {
          const r = seededFraction('e2e', `${l}:${i}`);
          const step = i === OPS_PER_LEASE - 1 && r < 0.25 ? DESTROY : STEPS[Math.floor(r * STEPS.length)]!;
          const { jobId } = await bed.ops.enqueue({ op: step.op, lease: identity(id), params: step.params(id) });
          ids.push(jobId);
          if (step.leaves !== 'unchanged') state = step.leaves;
        }
        expected.set(id, state);
      }),
    );
    const ended = await bed.waitForAll(ids, 120_000);
    const failed = [...ended].filter(([, s]) => s === 'failed');
    expect(await Promise.all(failed.map(async ([id]) => (await bed.ops.queue.getJob(id))?.failedReason))).toEqual([]);

    const actual = new Map(sandboxIds.map((id) => {
      const state = fake.stateOf(id);
      return [id, state === 'gone' ? 'gone' : state === 'started' ? 'started' : state === 'stopped' ? 'stopped' : state];
    }));
    expect(actual).toEqual(expected);
    expect(fake.http.overlaps()).toEqual([]);
    expect(fake.calls.length).toBeGreaterThan(LEASES * OPS_PER_LEASE);
    expect(await bed.laneKeys()).toEqual([]);
  });
});
