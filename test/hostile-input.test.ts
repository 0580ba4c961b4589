import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { EnqueueBodySchema, LeasePathSchema } from '../src/api/schemas.ts';
import { InvalidRequestError, OPERATIONS } from '../src/index.ts';
import { gate, lease, scanKeys, TestBed } from './helpers/env.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

const SEED = 20261130;
const TOKEN = 'hostile-token-0123456789';

/** Strings a hostile or broken caller sends: unicode, control characters, huge, empty, path tricks. */
const nastyString = fc.oneof(
  fc.string({ unit: 'grapheme', maxLength: 40 }),
  fc.string({ unit: 'binary', maxLength: 40 }),
  fc.constantFrom('', ' ', '..', '../..', '%00', '\u0000', '\u001b[31m', '\r\n', 'null', '{}', '\u202e', '\ud800', 'a'.repeat(5_000)),
  fc.string({ minLength: 257, maxLength: 2_000 }),
);
const nastyValue = fc.oneof(nastyString, fc.integer(), fc.double(), fc.boolean(), fc.constant(null), fc.array(fc.anything(), { maxLength: 3 }), fc.object({ maxDepth: 2 }));
const nastyBody = fc.oneof(
  fc.record({ op: fc.oneof(fc.constantFrom(...OPERATIONS), nastyValue), params: fc.oneof(nastyValue, fc.dictionary(nastyString, nastyValue, { maxKeys: 4 })) }, { requiredKeys: [] }),
  fc.record({ op: fc.constantFrom(...OPERATIONS), params: fc.record({ providerLeaseId: nastyValue, runId: nastyValue, leaseMetadata: nastyValue, resourceDisposition: nastyValue }, { requiredKeys: [] }), deadlineMs: nastyValue, idempotencyKey: nastyValue }, { requiredKeys: ['op', 'params'] }),
  fc.anything(),
);

describe('hostile input (fast-check, fixed seed)', () => {
  let bed: TestBed;
  let api: TestApi;
  const hold = gate<void>();
  const victimsHeld = gate<void>();

  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_KEEP_COMPLETED_S: '600' });
    const { provider } = createRecordingProvider({
      behaviour: async ({ ctx }) => {
        // Keep hostile leases from running, so what was accepted is still there to count.
        if (ctx.lease.companyId === 'hostile') await hold.promise;
        // A victim's first operation holds its lane until the second one is corrupted.
        if (ctx.lease.leaseId.startsWith('victim-')) await victimsHeld.promise;
        return 'ok' as const;
      },
    });
    await bed.startWorker(provider);
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    hold.open();
    victimsHeld.open();
    await api?.close();
    await bed?.close();
  });

  /** Jobs in the queue, and jobs named by lanes: every accepted request is one of each. */
  const footprint = async () => {
    const jobs = Object.values(await bed.ops.queue.getJobCounts()).reduce((a, b) => a + b, 0);
    let inLanes = 0;
    for (const key of await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}:lane:*`)) {
      if (/:lane:[A-Za-z0-9_-]{22}$/.test(key)) inLanes += await bed.redis.llen(key);
    }
    return { jobs, inLanes };
  };

  it('the API answers every malformed, oversized or mistyped request with a 4xx and a code, and enqueues only valid ones', async () => {
    let valid = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.record({ provider: fc.oneof(fc.constant('recording'), nastyString), environmentId: nastyString, leaseId: nastyString }),
        fc.oneof(nastyBody, nastyBody.map((b) => JSON.stringify(b) ?? '{').map((t) => t.slice(0, Math.max(0, t.length - 1))), fc.string({ minLength: 70_000, maxLength: 70_001 })),
        async (path, body) => {
          // A lone surrogate cannot be put in a URL at all (encodeURIComponent throws): no
          // client can send one in a path, so only bodies carry those.
          const encodable = (s: string) => !/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(s);
          fc.pre([path.provider, path.environmentId, path.leaseId].every(encodable));
          const segments = [path.provider, 'hostile', path.environmentId, path.leaseId].map((s) => encodeURIComponent(s));
          const res = await fetch(`${api.base}/v1/leases/${segments.join('/')}/operations`, {
            method: 'POST',
            headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
            body: typeof body === 'string' ? body : JSON.stringify(body),
          });
          const answer = (await res.json()) as { jobId?: string; error?: { code: string; message: string } };
          const wellFormed =
            typeof body !== 'string' &&
            LeasePathSchema.safeParse({ ...path, companyId: 'hostile' }).success &&
            EnqueueBodySchema.safeParse(body).success;
          if (res.status === 202) {
            expect(wellFormed).toBe(true);
            valid++;
            return;
          }
          expect(res.status).toBeGreaterThanOrEqual(400);
          expect(res.status).toBeLessThan(500);
          expect(answer.error?.code).toMatch(/^[a-z_]+$/);
          expect(answer.error?.message.length).toBeGreaterThan(0);
        },
      ),
      { seed: SEED, numRuns: 300, endOnFailure: true },
    );
    // Nothing half-enqueued: exactly the accepted requests are jobs, and each is in its lane.
    const after = await footprint();
    expect(after.jobs).toBe(after.inLanes);
    expect(after.inLanes).toBeLessThanOrEqual(valid);
  });

  it('the client refuses bad operations with InvalidRequestError and writes nothing', async () => {
    const before = await footprint();
    await fc.assert(
      fc.asyncProperty(
        fc.oneof(fc.constantFrom(...OPERATIONS), nastyString),
        fc.record({ provider: nastyString, companyId: nastyString, environmentId: nastyString, leaseId: nastyString }),
        nastyValue,
        async (op, identity, params) => {
          const err = await bed.ops.enqueue({ op: op as never, lease: { ...identity, companyId: `x${identity.companyId}` }, params }).then(
            () => null,
            (e: unknown) => e,
          );
          // Random input is almost never valid; when it is, it was accepted like any other.
          if (err !== null) expect(err, String(err)).toSatisfy((e: unknown) => e instanceof Error && /invalid|Too big|expected|must/i.test((e as Error).message));
        },
      ),
      { seed: SEED, numRuns: 300 },
    );
    const after = await footprint();
    expect(after.jobs - before.jobs).toBe(after.inLanes - before.inLanes);
    // Through the public client the same input is an InvalidRequestError.
    await expect(api.client.enqueue('stop', { ...lease('x'), leaseId: '\u0000' }, { providerLeaseId: 'x' })).rejects.toBeInstanceOf(InvalidRequestError);
  });

  it('workers fail jobs whose data was replaced in Redis with garbage, keep running, and other leases are unaffected', async () => {
    const samples = fc.sample(fc.oneof(nastyValue, nastyBody), { seed: SEED, numRuns: 40 });
    const victims: string[] = [];
    const healthy: string[] = [];
    for (const [i, garbage] of samples.entries()) {
      // The first operation holds the lane; the second is corrupted while it waits.
      const first = await bed.ops.enqueue({ op: 'destroy', lease: lease(`victim-${i}`, 'hostile-w'), params: { providerLeaseId: `victim-${i}` } });
      const second = await bed.ops.enqueue({ op: 'destroy', lease: lease(`victim-${i}`, 'hostile-w'), params: { providerLeaseId: `victim-${i}` } });
      await bed.redis.hset(bed.ops.queue.toKey(second.jobId), 'data', i % 5 === 0 ? '{not json' : JSON.stringify(garbage) ?? 'null');
      victims.push(second.jobId);
      healthy.push(first.jobId, (await bed.ops.enqueue({ op: 'destroy', lease: lease(`bystander-${i}`, 'hostile-w'), params: { providerLeaseId: `bystander-${i}` } })).jobId);
    }
    victimsHeld.open();
    const ended = await bed.waitForAll([...victims, ...healthy], 30_000);
    for (const id of healthy) expect({ id, state: ended.get(id) }).toEqual({ id, state: 'completed' });
    for (const id of victims) {
      expect({ id, state: ended.get(id) }).toEqual({ id, state: 'failed' });
      const job = await bed.ops.queue.getJob(id);
      expect(job?.failedReason).toMatch(/^invalid_job_data: /);
      expect(job?.attemptsMade).toBe(1);
    }
    // The worker is still there and working.
    const after = await bed.ops.enqueue({ op: 'destroy', lease: lease('after', 'hostile-w'), params: { providerLeaseId: 'after' } });
    expect((await bed.waitForAll([after.jobId])).get(after.jobId)).toBe('completed');
  });
});
