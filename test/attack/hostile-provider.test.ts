import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SettlingError, TransientError } from '../../src/providers/errors.ts';
import type { LeaseTimeline } from '../../src/queues/inspect.ts';
import { startTestApi, type TestApi } from '../helpers/api-server.ts';
import { TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

// What a provider says reaches the lease's history, its timeline (page and JSON), attention
// and Bull Board. Found by the attack on the timelines: codes and states of any length were
// kept whole, and Node's own error formats (unbracketed IPv6, host names, paths other than
// .js/.ts) went to tenants as they were.
const ADMIN = 'hostile-admin-token-0123456789';
const ACME = 'hostile-acme-token-0123456789';
const HUGE = 'x'.repeat(200_000);
const RAW = [
  'connect ECONNREFUSED ::1:6379',
  'getaddrinfo ENOTFOUND redis-primary.prod.internal.example',
  "open '/etc/lease-ops/credentials/daytona.key'",
  'C:\\Users\\svc\\key.pem',
  'fd00::1234',
  'token=sk-live-0123456789',
];

describe('a hostile or careless provider cannot bloat the history or leak infrastructure to tenants', () => {
  let bed: TestBed;
  let api: TestApi;

  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: ADMIN }, { token: ACME, companyId: 'acme' }]) });
    const base = createRecordingProvider().provider;
    await bed.startWorker({
      ...base,
      async stop(ctx, p) {
        if (p.providerLeaseId === 'huge') {
          ctx.observe(p.providerLeaseId, { kind: 'transitioning', providerState: HUGE });
          throw new SettlingError(HUGE, `still ${HUGE}`);
        }
        throw new TransientError('network', `request failed: ${RAW.join('; ')}`);
      },
    });
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
  });

  const timeline = async (leaseId: string) => {
    const res = await fetch(`${api.base}/v1/leases/recording/acme/prod/${leaseId}/timeline`, { headers: { authorization: `Bearer ${ACME}` } });
    expect(res.status).toBe(200);
    return { text: await res.clone().text(), body: (await res.json()) as LeaseTimeline };
  };

  it('bounds what it keeps of a provider\'s codes, states and messages', { timeout: 30_000 }, async () => {
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId: 'huge' }, params: { providerLeaseId: 'huge' }, deadlineMs: 1_500 });
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('failed');
    const { text, body } = await timeline('huge');
    expect(body.events.filter((e) => e.kind === 'backing-off').length).toBeGreaterThan(1);
    for (const e of body.events) {
      expect(e.code?.length ?? 0).toBeLessThanOrEqual(100);
      expect(e.providerState?.length ?? 0).toBeLessThanOrEqual(100);
      expect(e.message?.length ?? 0).toBeLessThanOrEqual(500);
    }
    expect(body.observed?.providerState.length).toBeLessThanOrEqual(100);
    // The whole answer stays small: no 200 KB field survives anywhere in it.
    expect(text.length).toBeLessThan(100_000);
    expect(await bed.redis.call('MEMORY', 'USAGE', `${bed.config.LEASE_OPS_PREFIX}:history:${body.laneId}`)).toBeLessThan(100_000);
  });

  it('shows tenants no addresses, host names, paths or secrets from a provider\'s errors', { timeout: 30_000 }, async () => {
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId: 'raw' }, params: { providerLeaseId: 'raw' }, deadlineMs: 1_200 });
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('failed');
    const { text } = await timeline('raw');
    const page = await (await fetch(`${api.base}/ui/leases/recording/acme/prod/raw`, { headers: { authorization: `Basic ${Buffer.from(`x:${ACME}`).toString('base64')}` } })).text();
    const attention = await (await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${ACME}` } })).text();
    const operation = await (await fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}`, { headers: { authorization: `Bearer ${ACME}` } })).text();
    for (const seen of [text, page, attention, operation]) {
      expect(seen).toContain('request failed');
      for (const secret of ['::1', 'redis-primary', '/etc/lease-ops', 'Users\\\\svc', 'Users\\svc', 'fd00', 'sk-live']) expect(seen).not.toContain(secret);
    }
  });
});
