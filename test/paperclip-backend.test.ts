import type { ServerResponse } from 'node:http';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { httpBackend, LeaseOpsHookError } from '../src/paperclip/backend.ts';
import { HttpStub } from './helpers/http-stub.ts';

// The paperclip plugin's HTTP backend against a server that answers as a lease-ops under load
// or in trouble would, over real HTTP: what passes is asked through until the hook's deadline,
// what does not fails the hook at once.

describe("the paperclip plugin's HTTP backend, against a lease-ops busy or in trouble", () => {
  let stub: HttpStub;
  const json = (res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}) =>
    res.writeHead(status, { 'content-type': 'application/json', ...headers }).end(JSON.stringify(body));

  beforeAll(async () => {
    stub = await HttpStub.start();
  });
  afterAll(() => stub?.close());

  const lease = { provider: 'p', companyId: 'c', environmentId: 'e', leaseId: 'l' };
  const ended = { jobId: 'j', op: 'acquire', state: 'completed', result: { providerLeaseId: 'sb-1' } };

  it("waits through the company's waits at their budget (429 company_waits_full): the hook failed with that code before, while its operation went on without it", async () => {
    stub.asked = 0;
    stub.answer = (_req, res) => (stub.asked <= 2 ? json(res, 429, { error: { code: 'company_waits_full', message: 'full' } }, { 'retry-after': '0' }) : json(res, 200, ended));
    const view = await httpBackend(stub.base, 't').wait('j', 1_000, Date.now() + 10_000);
    expect(view).toMatchObject({ state: 'completed', result: { providerLeaseId: 'sb-1' } });
    expect(stub.asked).toBe(3);
  });

  it('asks a busy lease-ops again at a pace until the deadline, then fails with hook_timeout naming the last answer', async () => {
    stub.asked = 0;
    stub.answer = (_req, res) => json(res, 429, { error: { code: 'company_rate_limited', message: 'slow down' } }, { 'retry-after': '0' });
    const failed = await httpBackend(stub.base, 't').wait('j', 1_000, Date.now() + 1_500).catch((e: unknown) => e);
    expect(failed).toBeInstanceOf(LeaseOpsHookError);
    expect(failed).toMatchObject({ code: 'hook_timeout', message: expect.stringContaining('HTTP 429 company_rate_limited') });
    expect(stub.asked).toBeGreaterThan(2);
    expect(stub.asked).toBeLessThan(12);
  });

  it("fails at once on a 503 that does not pass (a deployment's fault), with its code, where it was asked until the deadline", async () => {
    stub.asked = 0;
    stub.answer = (_req, res) => json(res, 503, { error: { code: 'secrets_key_mismatch', message: 'the workers cannot open what this API seals' } });
    const t0 = Date.now();
    const failed = await httpBackend(stub.base, 't').enqueue({ op: 'acquire', lease, params: { runId: 'r' }, idempotencyKey: 'k' }, 0, Date.now() + 5_000).catch((e: unknown) => e);
    expect(failed).toMatchObject({ code: 'secrets_key_mismatch' });
    expect(stub.asked).toBe(1);
    expect(Date.now() - t0).toBeLessThan(1_000);
    // One that passes (the API closing) is asked again, under the same idempotency key.
    stub.asked = 0;
    const keys: (string | undefined)[] = [];
    stub.answer = (req, res) => {
      keys.push(req.headers['idempotency-key'] as string | undefined);
      if (stub.asked === 1) json(res, 503, { error: { code: 'client_closed', message: 'closing' } }, { 'retry-after': '0' });
      else json(res, 202, { jobId: 'j' });
    };
    expect(await httpBackend(stub.base, 't').enqueue({ op: 'acquire', lease, params: { runId: 'r' }, idempotencyKey: 'k' }, 0, Date.now() + 5_000)).toMatchObject({ jobId: 'j', operation: null });
    expect(keys).toEqual(['k', 'k']);
  });
});
