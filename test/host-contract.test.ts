import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { PROBE_REUSE_MS } from '../src/queues/provider-probes.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { gate, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// The lease contract a control plane's host (paperclip's plugin SDK) expects, over the HTTP API.

const TOKEN = 'host-contract-token-0123456789';
let bed: TestBed;
let api: TestApi;
let fake: DaytonaFake;
const slow = new Map<string, ReturnType<typeof gate<void>>>();

const headers = (extra: Record<string, string> = {}) => ({ authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', ...extra });
const path = (provider: string, leaseId: string) => `/v1/leases/${provider}/acme/prod/${encodeURIComponent(leaseId)}/operations`;
async function enqueue(provider: string, leaseId: string, body: unknown, extra: Record<string, string> = {}) {
  const res = await fetch(`${api.base}${path(provider, leaseId)}`, { method: 'POST', headers: headers(extra), body: JSON.stringify(body) });
  return { status: res.status, headers: res.headers, body: (await res.json()) as Record<string, unknown> & { error?: { code: string; jobId?: string; message: string } } };
}

beforeAll(async () => {
  bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_MAX_WAIT_MS: '5000' });
  fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 20, stop: 20, forceStop: 0, destroy: 10, archive: 20 } });
  const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
  const apiUrl = await fake.listen();
  await bed.startWorker(
    createDaytonaProvider({ name: 'daytona', apiUrl, apiKey: 'k', rateLimits: unpaced }),
    createDaytonaProvider({ name: 'daytona-wrong-key', apiUrl, apiKey: 'not-the-key', rateLimits: unpaced }),
    createRecordingProvider({ behaviour: async ({ ctx }) => (await slow.get(ctx.lease.leaseId)?.promise, 'ok' as const) }).provider,
  );
  api = await startTestApi(bed);
});

afterAll(async () => {
  for (const g of slow.values()) g.open();
  await api?.close();
  await bed?.close();
  await fake?.close();
});

describe('the lease contract a host expects, over the HTTP API', () => {
  it('Prefer: wait answers 200 with the ended operation when it ends in time, 202 when it does not', async () => {
    const done = await enqueue('recording', 'w1', { op: 'stop', params: { providerLeaseId: 'w1' } }, { prefer: 'wait=5' });
    expect(done.status).toBe(200);
    expect(done.headers.get('preference-applied')).toBe('wait=5');
    expect(done.headers.get('location')).toBe(`/v1/operations/${encodeURIComponent(String(done.body.jobId))}`);
    expect(done.body).toMatchObject({ op: 'stop', state: 'completed', result: { providerLeaseId: 'w1', state: 'stopped' } });

    const held = gate();
    slow.set('w2', held);
    const started = Date.now();
    const late = await enqueue('recording', 'w2', { op: 'stop', params: { providerLeaseId: 'w2' } }, { prefer: 'respond-async, wait=1' });
    expect(late.status).toBe(202);
    expect(Date.now() - started).toBeGreaterThanOrEqual(900);
    expect(late.body).toMatchObject({ jobId: expect.any(String), location: expect.any(String) });
    held.open();
    // A wait longer than the cap is held to it; a malformed preference is ignored.
    const capped = await enqueue('recording', 'w3', { op: 'stop', params: { providerLeaseId: 'w3' } }, { prefer: 'wait=3600' });
    expect(capped.headers.get('preference-applied')).toBe('wait=5');
    const ignored = await enqueue('recording', 'w4', { op: 'stop', params: { providerLeaseId: 'w4' } }, { prefer: 'wait=soon' });
    expect(ignored.status).toBe(202);
    expect(ignored.headers.get('preference-applied')).toBeNull();
  });

  it("accepts the host's acquire fields and an expiry with an offset, and answers the service's own expiry", async () => {
    const asked = Date.now() + 45 * 60_000;
    const requestedExpiresAt = new Date(asked + 2 * 3_600_000).toISOString().replace('Z', '+02:00');
    const acquired = await enqueue(
      'daytona',
      'run-host',
      {
        op: 'acquire',
        params: {
          runId: 'run-host',
          requestedExpiresAt,
          agentId: 'agent-1',
          adapterType: 'claude_local',
          workspaceMode: 'isolated_workspace',
          requestedCwd: '/home/daytona/work',
          executionWorkspaceId: null,
          executionWorkspaceSettings: { branch: 'main' },
        },
      },
      { prefer: 'wait=5' },
    );
    expect(acquired.status).toBe(200);
    const lease = acquired.body.result as { providerLeaseId: string; expiresAt: string };
    expect(Date.parse(lease.expiresAt)).toBeLessThanOrEqual(asked);
    expect(Date.parse(lease.expiresAt)).toBeGreaterThan(asked - 61_000);
    expect(fake.sandboxes.get(lease.providerLeaseId)?.labels).toMatchObject({ 'lease-ops/agent': 'agent-1', 'lease-ops/adapter': 'claude_local' });
    // An unknown field is still refused, naming it.
    const junk = await enqueue('daytona', 'run-junk', { op: 'acquire', params: { runId: 'x', agentName: 'y' } });
    expect(junk.status).toBe(400);
    expect(junk.body.error?.message).toMatch(/agentName/);
  });

  it("resume answers the host's metadata with what was read over it; release answers in paperclip's words", async () => {
    const acquired = await enqueue('daytona', 'run-meta', { op: 'acquire', params: { runId: 'run-meta' } }, { prefer: 'wait=5' });
    const { providerLeaseId, metadata } = acquired.body.result as { providerLeaseId: string; metadata: Record<string, unknown> };
    const leaseMetadata = { ...metadata, remoteCwd: '/work', hostNote: 'kept', name: 'stale-name' };
    const resumed = await enqueue('daytona', providerLeaseId, { op: 'resume', params: { providerLeaseId, leaseMetadata } }, { prefer: 'wait=5' });
    expect(resumed.body.result).toMatchObject({ providerLeaseId, metadata: { remoteCwd: '/work', hostNote: 'kept', provider: 'daytona', name: metadata.name, resumed: true } });

    const kept = await enqueue('daytona', providerLeaseId, { op: 'release', params: { providerLeaseId, resourceDisposition: 'keep_running' } }, { prefer: 'wait=5' });
    expect(kept.body).toMatchObject({ state: 'completed', result: null });
    const contradiction = await enqueue('daytona', providerLeaseId, { op: 'release', params: { providerLeaseId, resourceDisposition: 'keep_running', cancelActiveWork: true } });
    expect(contradiction.status).toBe(400);
    expect(contradiction.body.error?.message).toMatch(/cancelActiveWork/);
    const archived = await enqueue('daytona', providerLeaseId, { op: 'release', params: { providerLeaseId, resourceDisposition: 'archive' } }, { prefer: 'wait=5' });
    expect(archived.body).toMatchObject({ state: 'completed', result: { providerLeaseId, state: 'stopped' } });
    expect(fake.stateOf(providerLeaseId)).toBe('archived');
    // A provider that cannot archive refuses it with a code, touching nothing.
    const refused = await enqueue('recording', 'no-archive', { op: 'release', params: { providerLeaseId: 'no-archive', resourceDisposition: 'archive' } }, { prefer: 'wait=5' });
    expect(refused.body).toMatchObject({ state: 'failed', error: { code: 'archive_unsupported' } });
  });

  it('a retry whose request changed (a recomputed expiry) is refused with 422 naming the operation its key names, which it can wait for', async () => {
    const key = { 'idempotency-key': 'paperclip:acquire:run-retry' };
    const first = await enqueue('daytona', 'run-retry', { op: 'acquire', params: { runId: 'run-retry', requestedExpiresAt: new Date(Date.now() + 3_600_000).toISOString() } }, key);
    expect(first.status).toBe(202);
    const retry = await enqueue('daytona', 'run-retry', { op: 'acquire', params: { runId: 'run-retry', requestedExpiresAt: new Date(Date.now() + 3_601_000).toISOString() } }, key);
    expect(retry.status).toBe(422);
    expect(retry.body.error).toMatchObject({ code: 'idempotency_key_reused', jobId: first.body.jobId });
    const read = await fetch(`${api.base}/v1/operations/${encodeURIComponent(retry.body.error!.jobId!)}?waitMs=5000`, { headers: headers() });
    expect(((await read.json()) as { state: string }).state).toBe('completed');
  });
});

describe('the providers a caller may use, and a probe of their credentials', () => {
  const get = async (p: string) => {
    const res = await fetch(`${api.base}${p}`, { headers: headers() });
    return { status: res.status, body: (await res.json()) as Record<string, unknown> };
  };

  it('lists each provider with what it can do', async () => {
    const { body } = await get('/v1/providers');
    const byName = Object.fromEntries((body.providers as { name: string; capabilities: unknown }[]).map((p) => [p.name, p.capabilities]));
    expect(byName.daytona).toEqual({ stop: true, pause: false, forceStop: true, expiry: true, resources: false, archive: true });
    expect(byName.recording).toMatchObject({ forceStop: true });
    expect((await get('/v1/providers/nope')).status).toBe(404);
  });

  it('a probe has a worker ask the service: accepted credentials are ok, refused ones say so, and the answer is shared for a while', async () => {
    const before = fake.calls.length;
    // The clock one second before a multiple of the reuse time, then two seconds on: the probes
    // were shared per fixed 30 s slice, and an ask just after a slice's end ran a new one (a CI run).
    const realNow = Date.now.bind(Date);
    let offset = PROBE_REUSE_MS - (realNow() % PROBE_REUSE_MS) - 1_000;
    const clock = vi.spyOn(Date, 'now').mockImplementation(() => realNow() + offset);
    let good: Awaited<ReturnType<typeof get>>;
    let again: Awaited<ReturnType<typeof get>>;
    try {
      good = await get('/v1/providers/daytona?probe=true');
      expect(good.body.probe).toMatchObject({ ok: true, code: 'ok' });
      const bad = await get('/v1/providers/daytona-wrong-key?probe=true');
      expect(bad.body.probe).toMatchObject({ ok: false, code: 'unauthorized' });
      expect(JSON.stringify(bad.body)).not.toContain('not-the-key');
      // Asked again at once: the same answer, no new request to the service.
      offset += 2_000;
      again = await get('/v1/providers/daytona?probe=true');
    } finally {
      clock.mockRestore();
    }
    expect(again.body.probe).toEqual(good.body.probe);
    const listCalls = fake.calls.slice(before).filter((c) => c.method === 'GET' && c.path === '/sandbox');
    expect(listCalls).toHaveLength(2);
    // A provider with nothing to check (no credentials) says so.
    expect((await get('/v1/providers/recording?probe=true')).body.probe).toMatchObject({ ok: true, code: 'nothing_to_check' });
  });
});
