import { readFile } from 'node:fs/promises';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../../src/fakes/daytona-fake.ts';
import { WorkerProcess } from '../helpers/worker-process.ts';
import { MAX_JSON_DEPTH } from '../../src/json-limits.ts';
import { startTestApi, type TestApi } from '../helpers/api-server.ts';
import { laneIdOfJobId } from '../../src/lease.ts';
import { gate, lease, readUntil, scanKeys, TestBed, workerEnv } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

const TOKEN = 'nesting-token-0123456789';
/** `{"a":{"a":...}}`, `levels` objects deep, as JSON text (JSON.stringify itself recurses). */
const nested = (levels: number): string => `${'{"a":'.repeat(levels - 1)}{}${'}'.repeat(levels - 1)}`;

describe('scenario 18: deeply nested JSON has a documented limit at the boundary, and nothing overflows a stack', () => {
  let bed: TestBed;
  let api: TestApi;
  const held = gate();
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    // The lease's first operation holds its lane while the test rewrites the next one.
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ ctx, op }) => (ctx.lease.leaseId === 'deep-redis' && op === 'resume' ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
    api = await startTestApi(bed);
  });
  afterAll(async () => {
    await api.close();
    await bed.close();
  });
  const enqueue = (leaseMetadata: string) =>
    fetch(`${api.base}/v1/leases/recording/co/env/deep/operations`, {
      method: 'POST',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
      body: `{"op":"resume","params":{"providerLeaseId":"deep","leaseMetadata":${leaseMetadata}}}`,
    });

  it.each([MAX_JSON_DEPTH + 1, 1_100, 5_000])('metadata %i levels deep is refused with 400 invalid_request, naming the limit', async (levels) => {
    const res = await enqueue(nested(levels));
    expect(res.status).toBe(400);
    const body = (await res.json()) as { error: { code: string; message: string; details: { message: string }[] } };
    expect(body.error.code).toBe('invalid_request');
    expect(body.error.details.map((d) => d.message)).toContain(`leaseMetadata must nest at most ${MAX_JSON_DEPTH} levels deep`);
  });

  it('metadata at the limit is accepted and runs', async () => {
    const res = await enqueue(nested(MAX_JSON_DEPTH));
    expect(res.status).toBe(202);
    const { jobId } = (await res.json()) as { jobId: string };
    expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
  });

  it('job data made deeper than the limit in Redis fails its job as invalid_job_data, and the lane goes on', async () => {
    const first = await bed.ops.enqueue({ op: 'resume', lease: lease('deep-redis'), params: { providerLeaseId: 'deep-redis' } });
    const second = await bed.ops.enqueue({ op: 'stop', lease: lease('deep-redis'), params: { providerLeaseId: 'deep-redis' } });
    // Written behind lease-ops' back, past anything the boundary lets through (and past cjson's own 1,000 levels).
    const job = (await bed.ops.queue.getJob(second.jobId))!;
    const { params: _params, ...rest } = job.data as Record<string, unknown>;
    const data = `${JSON.stringify(rest).slice(0, -1)},"params":{"providerLeaseId":"deep-redis","leaseMetadata":${nested(4_200)}}}`;
    await bed.redis.hset(bed.ops.queue.toKey(second.jobId), 'data', data);
    // Not a stop: a stop queued behind the second would coalesce with it.
    const third = await bed.ops.enqueue({ op: 'destroy', lease: lease('deep-redis'), params: { providerLeaseId: 'deep-redis' } });
    expect(third.jobId).not.toBe(second.jobId);
    held.open();
    const ended = await bed.waitForAll([second.jobId, third.jobId]);
    expect(ended.get(second.jobId)).toBe('failed');
    expect((await bed.ops.queue.getJob(second.jobId))!.failedReason).toMatch(/^invalid_job_data: /);
    expect(ended.get(third.jobId)).toBe('completed');
  });
});

describe('scenario 16: the failures index shrinks', () => {
  it('an entry goes when BullMQ no longer keeps the failed job it names, and attention lists the newest first', async () => {
    const bed = await TestBed.create({ LEASE_OPS_KEEP_FAILED_S: '1' });
    try {
      await bed.startWorker(createRecordingProvider({ behaviour: () => 'permanent' }).provider);
      const old = await bed.ops.enqueue({ op: 'stop', lease: lease('old'), params: { providerLeaseId: 'old' } });
      await bed.waitForAll([old.jobId]);
      expect(await bed.ops.lanes.failureCount()).toBe(1);
      await new Promise((r) => setTimeout(r, 1_100)); // older than the retention of failed jobs
      const fresh = await bed.ops.enqueue({ op: 'stop', lease: lease('fresh'), params: { providerLeaseId: 'fresh' } });
      await bed.waitForAll([fresh.jobId]);
      expect(await bed.ops.lanes.failures()).toEqual([{ laneId: fresh.laneId, jobId: fresh.jobId, at: expect.any(Number), kinds: [{ op: 'stop', jobId: fresh.jobId, at: expect.any(Number) }] }]);
      expect(await bed.ops.lanes.failureCount()).toBe(1);
    } finally {
      await bed.close();
    }
  });
});

describe('scenario 17: a release never brings a removed job back', () => {
  it('an attempt whose job was removed while it ran (its lock gone) releases without recreating the job\'s hash', async () => {
    const held = gate();
    const bed = await TestBed.create();
    try {
      const started = gate();
      await bed.startWorker(createRecordingProvider({ behaviour: async () => (started.open(), await held.promise, 'ok' as const) }).provider);
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('removed'), params: { providerLeaseId: 'removed' } });
      await started.promise;
      // Its lock lost (a stall), an operator removes it while the attempt still runs.
      await bed.redis.del(`${bed.ops.queue.toKey(jobId)}:lock`);
      await bed.ops.queue.remove(jobId);
      held.open();
      await readUntil(async () => !(await bed.ops.lanes.view(laneIdOfJobId(jobId)!)).holder, 10_000, 'the release');
      expect(await bed.redis.exists(bed.ops.queue.toKey(jobId))).toBe(0);
    } finally {
      held.open();
      await bed.close();
    }
  });
});

describe("scenario 19: every key lease-ops writes is in the key table of docs/design.md, and an idle lane leaves no lane key", () => {
  /** The key table of docs/design.md, as patterns for this test's prefix and queue. */
  async function documentedKeys(prefix: string, queue: string): Promise<{ key: string; pattern: RegExp }[]> {
    const readme = await readFile(new URL('../../docs/design.md', import.meta.url), 'utf8');
    const table = readme.slice(readme.indexOf('Keys under the prefix'), readme.indexOf('A lane id is a hash'));
    const keys = [...table.matchAll(/^\| ([^|]+) \|/gm)].flatMap((row) => [...row[1]!.matchAll(/`([^`]+)`/g)].map((m) => m[1]!));
    const escape = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
    return keys.map((key) => ({
      key,
      pattern: new RegExp(
        `^${escape(key)
          .replace(escape('<prefix>'), escape(prefix))
          .replace(escape('<queue>'), escape(queue))
          .replace(escape('<laneId>'), '[A-Za-z0-9_-]{22}')
          .replace(escape('<hash>'), '[A-Za-z0-9_-]+')
          .replace(/<[a-zA-Z]+>/g, '.+')
          .replace(/\\\*/g, '.*')}$`,
      ),
    }));
  }

  it('through acquires, stuck stops forced by the watchdog, failures, idempotency keys and pacing', async () => {
    const bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '60' });
    const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 10, stop: 10, forceStop: 0, destroy: 10 } });
    const worker = new WorkerProcess(
      workerEnv(bed, {
        LEASE_OPS_PROVIDERS: 'daytona',
        DAYTONA_API_URL: await fake.listen(),
        DAYTONA_API_KEY: 'k',
        LEASE_OPS_STUCK_STOPPING_MS: '300',
        LEASE_OPS_WATCHDOG_INTERVAL_MS: '200',
        LEASE_OPS_SWEEP_INTERVAL_MS: '200',
        LEASE_OPS_SWEEP_STALE_MS: '200',
        LEASE_OPS_BACKOFF_BASE_MS: '50',
        LEASE_OPS_BACKOFF_CAP_MS: '200',
        LEASE_OPS_KEEP_COMPLETED_S: '60',
      }),
    );
    try {
      await worker.ready;
      const documented = await documentedKeys(bed.config.LEASE_OPS_PREFIX, bed.config.LEASE_OPS_QUEUE);
      const undocumented = new Set<string>();
      const look = async () => {
        for (const key of await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}*`)) {
          if (!documented.some((d) => d.pattern.test(key))) undocumented.add(key);
        }
      };
      const daytonaLease = (leaseId: string) => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });
      const acquired = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('keys'), params: { runId: 'keys' }, idempotencyKey: 'keys-acquire' });
      await look(); // an acquire in flight
      await bed.waitForAll([acquired.jobId]);
      const id = ((await bed.ops.queue.getJob(acquired.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
      fake.control(id, { stuckStoppingMs: 600_000 });
      const stop = await bed.ops.enqueue({ op: 'stop', lease: daytonaLease(id), params: { providerLeaseId: id } });
      const resume = await bed.ops.enqueue({ op: 'resume', lease: daytonaLease(id), params: { providerLeaseId: id } });
      await look(); // a lane with work, a stop backing off
      await bed.waitForAll([stop.jobId, resume.jobId]);
      // Daytona sizes sandboxes by their snapshot: the acquire fails for good, and its clean-up runs.
      const refused = await bed.ops.enqueue({ op: 'acquire', lease: daytonaLease('refused'), params: { runId: 'refused', resources: { cpu: 2 } } });
      expect((await bed.waitForAll([refused.jobId])).get(refused.jobId)).toBe('failed');
      await look(); // a failure, a forced stop, records
      expect([...undocumented]).toEqual([]);
      expect(documented.filter((d) => d.key.includes('force') || d.key.includes('claim'))).toEqual([]);

      // Idle: every lane ended, so no lane key is left, and none of the watchdog's.
      await readUntil(async () => (await bed.ops.lanes.openLaneCount()) === 0, 10_000, 'every lane idle');
      const left = await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}*`);
      expect(left.filter((key) => key.includes(':lane:') || key.endsWith(':lanes') || key.endsWith(':backing-off'))).toEqual([]);
      expect(forcedStops(fake, id)).toBe(1);
    } finally {
      await worker.terminate();
      await fake.close();
      await bed.close();
    }
  });
});

const forcedStops = (fake: DaytonaFake, id: string) => fake.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/stop') && c.query.includes('force=true')).length;
