import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { LeaseOpsClient } from '../src/client.ts';
import type { LeaseView, OperationView } from '../src/queues/inspect.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { gate, scanKeys, spyCommands, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

const ADMIN = 'admin-token-0123456789';
const ACME = 'acme-token-0123456789';
const ACME_PROD = 'acme-prod-token-0123456789';
const TOKENS = JSON.stringify([
  { token: ADMIN },
  { token: ACME, companyId: 'acme' },
  { token: ACME_PROD, companyId: 'acme', environmentIds: ['prod'] },
]);

let bed: TestBed;
let client: LeaseOpsClient;
let api: TestApi;
let base: string;
/** Leases whose provider calls wait until the test opens their gate. */
const held = new Map<string, ReturnType<typeof gate<void>>>();
/** Leases whose calls fail for good. */
const refusing = new Set<string>();

const auth = (token = ADMIN) => ({ authorization: `Bearer ${token}` });
const jsonHeaders = (token = ADMIN) => ({ ...auth(token), 'content-type': 'application/json' });
const leasePath = (company: string, env: string, leaseId: string) => `/v1/leases/recording/${company}/${env}/${encodeURIComponent(leaseId)}`;

async function post(path: string, body: unknown, headers: Record<string, string> = jsonHeaders()) {
  const res = await fetch(`${base}${path}`, { method: 'POST', headers, body: typeof body === 'string' ? body : JSON.stringify(body) });
  return { status: res.status, headers: res.headers, body: (await res.json()) as Record<string, unknown> & { error?: { code: string; details?: unknown[] } } };
}

async function get<T = Record<string, unknown>>(path: string, headers: Record<string, string> = auth()) {
  const res = await fetch(`${base}${path}`, { headers });
  const text = await res.text();
  let body: unknown = text;
  try {
    body = JSON.parse(text);
  } catch {
    // Not JSON (metrics): keep the text.
  }
  return { status: res.status, headers: res.headers, body: body as T & { error?: { code: string } } };
}

/** Every key a job or a lane could leave behind, to prove a rejected request wrote nothing. */
async function footprint(): Promise<number> {
  const counts = await bed.ops.queue.getJobCounts();
  const jobs = Object.values(counts).reduce((a, b) => a + b, 0);
  const lanes = await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}:lane*`);
  const idem = await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}:idem:*`);
  return jobs + lanes.length + idem.length;
}

beforeAll(async () => {
  bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKENS, LEASE_OPS_KEEP_COMPLETED_S: '600', LEASE_OPS_BULLMQ_METRICS: 'true' });
  const { provider } = createRecordingProvider({
    behaviour: async ({ ctx }) => {
      await held.get(ctx.lease.leaseId)?.promise;
      return refusing.has(ctx.lease.leaseId) ? 'permanent' : 'ok';
    },
  });
  await bed.startWorker(provider);
  api = await startTestApi(bed);
  client = api.client;
  base = api.base;
});

afterAll(async () => {
  for (const g of held.values()) g.open();
  await api?.close();
  await bed?.close();
});

describe('HTTP API', () => {
  it('enqueues with 202 and a Location, then reads the operation waiting for its end', async () => {
    const accepted = await post(`${leasePath('acme', 'prod', 'lease-1')}/operations`, { op: 'acquire', params: { runId: 'r1' } });
    expect(accepted.status).toBe(202);
    const location = accepted.headers.get('location');
    expect(location).toBe(`/v1/operations/${encodeURIComponent(String(accepted.body.jobId))}`);
    expect(accepted.body.location).toBe(location);
    const read = await get<OperationView>(`${location}?waitMs=10000`);
    expect(read.status).toBe(200);
    expect(read.body).toMatchObject({ jobId: accepted.body.jobId, op: 'acquire', state: 'completed', result: { providerLeaseId: 'lease-1' } });
    expect(read.body.lease).toEqual({ provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId: 'lease-1' });
  });

  it('returns the same operation for the same idempotency key (header or body)', async () => {
    const path = `${leasePath('acme', 'prod', 'lease-idem')}/operations`;
    const first = await post(path, { op: 'acquire', params: { runId: 'r' } }, { ...jsonHeaders(), 'idempotency-key': 'k-1' });
    const second = await post(path, { op: 'acquire', params: { runId: 'r' }, idempotencyKey: 'k-1' });
    expect(first.status).toBe(202);
    expect(second.status).toBe(202);
    expect(second.body.jobId).toBe(first.body.jobId);
    expect(second.body.deduplicated).toBe('idempotency-key');
  });

  it("shows a lease's lane: what executes and what waits, then the last observed result", async () => {
    const leaseId = 'lease-lane';
    const hold = gate();
    held.set(leaseId, hold);
    const path = leasePath('acme', 'prod', leaseId);
    const first = await post(`${path}/operations`, { op: 'acquire', params: { runId: 'r' } });
    const second = await post(`${path}/operations`, { op: 'stop', params: { providerLeaseId: leaseId } });
    // The first is picked up by the worker; wait for BullMQ to say so, not for a while.
    await client.getOperation(String(first.body.jobId));
    const events = await client.queueEventStream();
    const active = new Promise<void>((resolve) => {
      const onActive = ({ jobId }: { jobId: string }) => {
        if (jobId === first.body.jobId) {
          events.off('active', onActive);
          resolve();
        }
      };
      events.on('active', onActive);
    });
    if ((await client.getOperation(String(first.body.jobId)))?.state !== 'running') await active;
    // The lease's name is resolved to its lane once per read (it was read twice, one after the other).
    const { sent, restore } = spyCommands(client.ops.connection);
    let during: Awaited<ReturnType<typeof get<LeaseView>>>;
    try {
      during = await get<LeaseView>(path);
      expect(sent.filter((name) => name === 'getex')).toEqual(['getex']);
      sent.length = 0;
      expect((await client.getLeaseTimeline({ provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId })).executing?.jobId).toBe(first.body.jobId);
      expect(sent.filter((name) => name === 'getex')).toEqual(['getex']);
    } finally {
      restore();
    }
    expect(during.status).toBe(200);
    expect(during.body.executing?.jobId).toBe(first.body.jobId);
    expect(during.body.executing?.state).toBe('running');
    expect(during.body.queued.map((q) => q.jobId)).toEqual([second.body.jobId]);
    expect(during.body.queued[0]?.state).toBe('queued');
    expect(during.body.queuedTotal).toBe(1);
    hold.open();
    const done = await get<OperationView>(`/v1/operations/${second.body.jobId}?waitMs=10000`);
    expect(done.body.state).toBe('completed');
    const after = await get<LeaseView>(path);
    expect(after.body.executing).toBeNull();
    expect(after.body.queued).toEqual([]);
  });

  it('lists a lease whose last operation failed, with its code, until a later success clears it', async () => {
    const leaseId = 'lease-failing';
    refusing.add(leaseId);
    const path = leasePath('acme', 'prod', leaseId);
    const failed = await post(`${path}/operations`, { op: 'destroy', params: { providerLeaseId: leaseId } });
    const read = await get<OperationView>(`/v1/operations/${failed.body.jobId}?waitMs=10000`);
    expect(read.body.state).toBe('failed');
    expect(read.body.error?.code).toBe('refused');
    const attention = await get<{ items: { lease: { leaseId: string } | null; reason: string; detail: string }[] }>('/v1/attention');
    const item = attention.body.items.find((i) => i.lease?.leaseId === leaseId);
    expect(item?.reason).toBe('operation_failed');
    expect(item?.detail).toContain('refused');
    expect((await get<LeaseView>(path)).body.lastFailure?.jobId).toBe(failed.body.jobId);

    refusing.delete(leaseId);
    const ok = await post(`${path}/operations`, { op: 'destroy', params: { providerLeaseId: leaseId } });
    expect((await get<OperationView>(`/v1/operations/${ok.body.jobId}?waitMs=10000`)).body.state).toBe('completed');
    const later = await get<{ items: { lease: { leaseId: string } | null }[] }>('/v1/attention');
    expect(later.body.items.some((i) => i.lease?.leaseId === leaseId)).toBe(false);
    expect((await get<LeaseView>(path)).body.lastFailure).toBeNull();
  });

  it('answers every bad input with a 4xx and its code, and enqueues nothing', async () => {
    const before = await footprint();
    const ops = `${leasePath('acme', 'prod', 'lease-bad')}/operations`;
    const cases: [string, () => Promise<{ status: number; body: { error?: { code: string; details?: unknown[] } } }>, number, string][] = [
      ['malformed JSON', () => post(ops, '{"op": "acquire",'), 400, 'invalid_json'],
      ['not JSON', () => post(ops, 'op=acquire', { ...auth(), 'content-type': 'application/x-www-form-urlencoded' }), 415, 'unsupported_media_type'],
      ['unknown operation', () => post(ops, { op: 'explode', params: {} }), 400, 'invalid_request'],
      ['missing params', () => post(ops, { op: 'stop' }), 400, 'invalid_request'],
      ['wrong param type', () => post(ops, { op: 'stop', params: { providerLeaseId: 42 } }), 400, 'invalid_request'],
      ['unknown field', () => post(ops, { op: 'stop', params: { providerLeaseId: 'x' }, priority: 1 }), 400, 'invalid_request'],
      ['negative deadline', () => post(ops, { op: 'stop', params: { providerLeaseId: 'x' }, deadlineMs: -5 }), 400, 'invalid_request'],
      ['array body', () => post(ops, [1, 2]), 400, 'invalid_request'],
      ['control character in lease id', () => post(`${leasePath('acme', 'prod', 'bad\u0001id')}/operations`, { op: 'stop', params: { providerLeaseId: 'x' } }), 400, 'invalid_request'],
      ['huge lease id', () => post(`${leasePath('acme', 'prod', 'x'.repeat(300))}/operations`, { op: 'stop', params: { providerLeaseId: 'x' } }), 400, 'invalid_request'],
      ['provider not a key', () => post('/v1/leases/Not%20A%20Key/acme/prod/l/operations', { op: 'stop', params: { providerLeaseId: 'x' } }), 400, 'invalid_request'],
      ['oversized body', () => post(ops, { op: 'acquire', params: { runId: 'x'.repeat(100_000) } }), 413, 'payload_too_large'],
      ['empty idempotency key', () => post(ops, { op: 'stop', params: { providerLeaseId: 'x' } }, { ...jsonHeaders(), 'idempotency-key': '' }), 400, 'invalid_request'],
      ['waitMs not a number', () => get('/v1/operations/abc?waitMs=soon'), 400, 'invalid_request'],
      ['unknown query parameter', () => get('/v1/operations/abc?verbose=1'), 400, 'invalid_request'],
      ['unknown operation id', () => get('/v1/operations/AAAAAAAAAAAAAAAAAAAAAA.nothing'), 404, 'operation_not_found'],
      ['malformed operation id', () => get('/v1/operations/not-a-job'), 404, 'operation_not_found'],
      ['unknown route', () => get('/v1/nothing-here'), 404, 'not_found'],
      ['wrong method', () => get(ops), 404, 'not_found'],
    ];
    for (const [name, request, status, code] of cases) {
      const res = await request();
      expect({ name, status: res.status, code: res.body.error?.code }).toEqual({ name, status, code });
      if (code === 'invalid_request' && status === 400 && name !== 'empty idempotency key') {
        expect(res.body.error?.details?.length, name).toBeGreaterThan(0);
      }
    }
    expect(await footprint()).toBe(before);
  });

  it('refuses every route without a token or with a wrong one, and enqueues nothing', async () => {
    const before = await footprint();
    const routes: [string, string][] = [
      ['POST', `${leasePath('acme', 'prod', 'lease-x')}/operations`],
      ['GET', leasePath('acme', 'prod', 'lease-x')],
      ['GET', '/v1/operations/AAAAAAAAAAAAAAAAAAAAAA.x'],
      ['GET', '/v1/attention'],
      ['GET', '/v1/overview'],
      ['GET', '/board'],
    ];
    for (const [method, path] of routes) {
      for (const headers of [{}, auth('wrong-token-0123456789'), { authorization: `Basic ${Buffer.from(`u:wrong`).toString('base64')}` }, { authorization: ADMIN }]) {
        const res = await fetch(`${base}${path}`, {
          method,
          headers: { ...headers, 'content-type': 'application/json' },
          ...(method === 'POST' ? { body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'x' } }) } : {}),
        });
        expect({ path, status: res.status }).toEqual({ path, status: 401 });
        expect(((await res.json()) as { error: { code: string } }).error.code).toBe('unauthorized');
        expect(res.headers.get('www-authenticate')).toMatch(path === '/board' ? /^Basic/ : /^Bearer/);
      }
    }
    expect(await footprint()).toBe(before);
  });

  it("keeps a company-scoped token to its own company's leases and operations (404, not 403)", async () => {
    const mine = await post(`${leasePath('acme', 'prod', 'lease-s')}/operations`, { op: 'acquire', params: { runId: 'r' } }, jsonHeaders(ACME));
    const theirs = await post(`${leasePath('globex', 'prod', 'lease-s')}/operations`, { op: 'acquire', params: { runId: 'r' } });
    expect(mine.status).toBe(202);
    expect(theirs.status).toBe(202);
    expect((await get(`/v1/operations/${mine.body.jobId}`, auth(ACME))).status).toBe(200);
    const other = await get(`/v1/operations/${theirs.body.jobId}`, auth(ACME));
    expect([other.status, other.body.error?.code]).toEqual([404, 'operation_not_found']);
    const lease = await get(leasePath('globex', 'prod', 'lease-s'), auth(ACME));
    expect([lease.status, lease.body.error?.code]).toEqual([404, 'lease_not_found']);
    const before = await footprint();
    const enqueue = await post(`${leasePath('globex', 'prod', 'lease-s')}/operations`, { op: 'stop', params: { providerLeaseId: 'x' } }, jsonHeaders(ACME));
    expect([enqueue.status, enqueue.body.error?.code]).toEqual([404, 'lease_not_found']);
    expect(await footprint()).toBe(before);
    // An environment-scoped token sees only its environments.
    expect((await get(leasePath('acme', 'prod', 'lease-s'), auth(ACME_PROD))).status).toBe(200);
    expect((await get(leasePath('acme', 'staging', 'lease-s'), auth(ACME_PROD))).status).toBe(404);
    // Queue-wide views and the board are for admins.
    expect((await get('/v1/overview', auth(ACME))).status).toBe(403);
    expect((await get('/board', auth(ACME))).status).toBe(403);
  });

  it('shows the whole queue to an admin', async () => {
    const res = await get<{ counts: Record<string, number>; openLanes: number; attention: unknown[] }>('/v1/overview');
    expect(res.status).toBe(200);
    expect(res.body.counts.completed).toBeGreaterThan(0);
    expect(Object.keys(res.body.counts).sort()).toEqual(['backing-off', 'completed', 'failed', 'paused', 'queued', 'ready', 'running']);
  });

  it('serves health, readiness, Prometheus metrics and the OpenAPI document without a token', async () => {
    expect((await get('/healthz', {})).status).toBe(200);
    expect((await get('/readyz', {})).status).toBe(200);
    const metrics = await get<string>('/metrics', {});
    expect(metrics.status).toBe(200);
    expect(metrics.body).toMatch(/lease_ops_operations_total\{op="acquire",outcome="completed"\} [1-9]/);
    expect(metrics.body).toMatch(/lease_ops_operations_total\{op="destroy",outcome="failed"\} [1-9]/);
    expect(metrics.body).toMatch(/lease_ops_attempt_duration_seconds_bucket\{le="0.005",op="acquire",outcome="completed"\}/);
    expect(metrics.body).toMatch(/lease_ops_operations\{state="completed"\} [1-9]/);
    expect(metrics.body).toMatch(/lease_ops_leases_needing_attention\{reason="operation_failed"\}/);
    expect(metrics.body).toMatch(/lease_ops_leases_blocked \d/);
    expect(metrics.body).toMatch(/bullmq_job_count\{queue="ops", state="completed"\} [1-9]/);
    expect(metrics.body).toMatch(/bullmq_job_completed_total\{queue="ops"\} [1-9]/);

    const doc = await get<{ openapi: string; paths: Record<string, Record<string, unknown>>; components: { schemas: Record<string, unknown> } }>('/v1/openapi.json', {});
    expect(doc.body.openapi).toBe('3.1.0');
    expect(Object.keys(doc.body.paths).sort()).toEqual([
      '/v1/activities/{token}',
      '/v1/activities/{token}/heartbeat',
      '/v1/attention',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/acknowledge',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/activities',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/exec',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/operations',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/pause',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/timeline',
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/unpause',
      '/v1/operations/{jobId}',
      '/v1/operations/{jobId}/cancel',
      '/v1/operations/{jobId}/rerun',
      '/v1/overview',
      '/v1/providers',
      '/v1/providers/{name}',
    ]);
    expect(Object.keys(doc.body.components.schemas)).toEqual(expect.arrayContaining(['EnqueueRequest', 'Operation', 'Lease', 'Error']));
    // The enqueue schema in the document is the one requests are validated with: its ops are ours.
    expect(JSON.stringify(doc.body.components.schemas.EnqueueRequest)).toContain('force-stop');
  });
});
