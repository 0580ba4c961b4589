import type { ServerResponse } from 'node:http';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type * as Light from '../packages/client/src/index.ts';
import { LeaseOpsHttpClient, LeaseOpsRequestError } from '../packages/client/src/index.ts';
import type * as Full from '../src/index.ts';
import { freePort } from '../src/redis-server.ts';
import { gate, lease, readUntil, TestBed } from './helpers/env.ts';
import { HttpStub } from './helpers/http-stub.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// The light client (packages/client) against a real API over real HTTP, beside the full
// client on the same Redis: the two read one model of a lease, and fail with one shape.

// One truth at compile time: what the full client (and so the API) answers is what the light
// client's types say it answers. A field added to a view on one side and not the other fails `tsc`.
type Assignable<From, To> = [From] extends [To] ? true : false;
type Same<A, B> = Assignable<A, B> extends true ? Assignable<B, A> : false;
const typesAgree: [
  Assignable<Full.OperationView, Light.OperationView>,
  Assignable<Full.LeaseView, Light.LeaseView>,
  Assignable<Full.LeaseTimeline, Light.LeaseTimeline>,
  Assignable<Full.AttentionItem, Light.AttentionItem>,
  Assignable<Full.OperationResult, Light.OperationResult>,
  Assignable<Full.AcknowledgeResult, Light.AcknowledgeResult>,
  Same<keyof Full.LeaseView, keyof Light.LeaseView>,
  Same<keyof Full.LeaseTimeline, keyof Light.LeaseTimeline>,
  Same<keyof Full.OperationView, keyof Light.OperationView>,
  Same<Full.OperationState, Light.OperationState>,
  Same<Full.OperationName, Light.OperationName>,
  Same<Full.AttentionItem['reason'], Light.AttentionReason>,
  Same<Full.LeaseTimeline['events'][number]['kind'], Light.HistoryEventKind>,
] = [true, true, true, true, true, true, true, true, true, true, true, true, true];

const TOKEN = 'light-client-token-0123456789';
const OTHER = 'light-client-globex-0123456789';

describe('the light client (lease-ops-client) against the HTTP API', () => {
  let bed: TestBed;
  let api: TestApi;
  let light: LeaseOpsHttpClient;
  const hold = gate<void>();
  const holdOver = new Map<string, Promise<void>>();

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_KEEP_COMPLETED_S: '600',
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKEN }, { token: OTHER, companyId: 'globex' }]),
    });
    const { provider } = createRecordingProvider({
      behaviour: async ({ ctx, op }) => {
        if (ctx.lease.leaseId === 'held') await hold.promise;
        await holdOver.get(ctx.lease.leaseId);
        return ctx.lease.leaseId === 'refuses' && op === 'stop' ? 'permanent' : 'ok';
      },
    });
    await bed.startWorker(provider);
    api = await startTestApi(bed);
    light = new LeaseOpsHttpClient({ url: api.base, token: TOKEN });
  });

  afterAll(async () => {
    hold.open();
    await api?.close();
    await bed?.close();
  });

  it('holds its types to the full client’s (checked by tsc)', () => {
    expect(typesAgree.every(Boolean)).toBe(true);
  });

  it('enqueues, waits and reads a lease as the full client does: the same views', async () => {
    const acquired = await light.enqueue('acquire', lease('one'), { runId: 'r1' }, { idempotencyKey: 'light-1' });
    expect(acquired.location).toBe(`/v1/operations/${encodeURIComponent(acquired.jobId)}`);
    expect(await light.waitForResult(acquired.jobId, 10_000)).toEqual({ jobId: acquired.jobId, state: 'completed', result: expect.objectContaining({ providerLeaseId: 'one' }) });
    // The same key answers with the same operation.
    expect((await light.enqueue('acquire', lease('one'), { runId: 'r1' }, { idempotencyKey: 'light-1' })).jobId).toBe(acquired.jobId);
    expect(await light.getOperation(acquired.jobId)).toEqual(await api.client.getOperation(acquired.jobId));
    expect(await light.getLease(lease('one'))).toEqual(await api.client.getLease(lease('one')));
    const [viaHttp, direct] = await Promise.all([light.getLeaseTimeline(lease('one')), api.client.getLeaseTimeline(lease('one'))]);
    expect({ ...viaHttp, now: 0 }).toEqual({ ...direct, now: 0 });
    expect(viaHttp.events.map((e) => e.kind)).toContain('completed');
  });

  it('fails with one shape, { code, message }: an operation that failed, the API refusing, a missing one, a wait that ran out', async () => {
    const stop = await light.enqueue('stop', lease('refuses'), { providerLeaseId: 'refuses' });
    const viaLight = await light.waitForResult(stop.jobId, 10_000);
    const viaFull = await api.client.waitForResult(stop.jobId, 10_000);
    expect(viaLight.state).toBe('failed');
    expect(viaLight.error).toEqual({ code: 'refused', message: expect.stringContaining('refused stop') });
    // The full client's waitForResult, getOperation and the API's body: the same object.
    expect(viaFull.error).toEqual(viaLight.error);
    expect((await api.client.getOperation(stop.jobId))?.error).toEqual(viaLight.error);
    const body = (await (await fetch(`${api.base}/v1/operations/${encodeURIComponent(stop.jobId)}`, { headers: { authorization: `Bearer ${TOKEN}` } })).json()) as { error: unknown };
    expect(body.error).toEqual(viaLight.error);

    const refused = await light.enqueue('stop', lease('x'), { providerLeaseId: 42 }).catch((e: unknown) => e);
    expect(refused).toBeInstanceOf(LeaseOpsRequestError);
    expect(refused).toMatchObject({ code: 'invalid_request', status: 400 });
    expect((refused as Error).message).toMatch(/providerLeaseId/);
    // What the API sends for it is the same code and message.
    const raw = await fetch(`${api.base}/v1/leases/recording/co/env/x/operations`, { method: 'POST', headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' }, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 42 } }) });
    expect(((await raw.json()) as { error: Light.ErrorShape }).error).toMatchObject({ code: 'invalid_request', message: (refused as Error).message });

    expect(await light.getOperation('AAAAAAAAAAAAAAAAAAAAAA.none')).toBeNull();
    await expect(light.waitForResult('AAAAAAAAAAAAAAAAAAAAAA.none', 100)).rejects.toMatchObject({ code: 'operation_not_found' });
    const held = await light.enqueue('acquire', lease('held'), { runId: 'held' });
    await expect(light.waitForResult(held.jobId, 300)).rejects.toMatchObject({ code: 'wait_timeout', name: 'LeaseOpsRequestError' });
    hold.open();
    expect((await light.waitForResult(held.jobId, 10_000)).state).toBe('completed');

    // Another company's lease does not exist for its token; a wrong token is unauthorized; nobody home is unreachable.
    const globex = new LeaseOpsHttpClient({ url: api.base, token: OTHER });
    await expect(globex.getOperation(held.jobId)).resolves.toBeNull();
    await expect(new LeaseOpsHttpClient({ url: api.base, token: 'wrong-token-0123456789' }).getLease(lease('one'))).rejects.toMatchObject({ status: 401 });
    await expect(new LeaseOpsHttpClient({ url: 'http://127.0.0.1:9', token: TOKEN }).getLease(lease('one'))).rejects.toMatchObject({ code: 'unreachable', status: 0 });
  });

  it("waits for a result across a restart of the API: the wait asks again until its time is up, and the result comes", { timeout: 30_000 }, async () => {
    const restarting = await startTestApi(bed);
    const port = Number(new URL(restarting.base).port);
    let asked = 0;
    const counting: typeof fetch = (input, init) => {
      asked++;
      return fetch(input, init);
    };
    const client = new LeaseOpsHttpClient({ url: restarting.base, token: TOKEN, fetch: counting });
    const held = gate<void>();
    holdOver.set('held-over-restart', held.promise);
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('held-over-restart'), params: { providerLeaseId: 'held-over-restart' } });
    let restarted: TestApi | null = null;
    try {
      const result = client.waitForResult(jobId, 25_000);
      await readUntil(async () => asked >= 1, 5_000, 'the first long poll');
      await restarting.close(); // its connections cut, and nothing listening for a while
      await readUntil(async () => asked >= 3, 10_000, 'the wait asking again');
      restarted = await startTestApi(bed, undefined, { port });
      held.open();
      expect(await result).toMatchObject({ jobId, state: 'completed' });
    } finally {
      held.open();
      await restarted?.close();
    }
  });

  it('pauses, lists attention, acknowledges and unpauses, as the full client sees it', async () => {
    expect(await light.pauseLane(lease('one'))).toMatchObject({ paused: true, changed: true });
    expect((await api.client.getLease(lease('one'))).paused?.by).toMatch(/\(API\)$/);
    const { items } = await light.attention();
    expect(items.map((i) => `${i.reason} ${i.lease?.leaseId}`)).toEqual(expect.arrayContaining(['paused one', 'operation_failed refuses']));
    expect(await light.acknowledgeFailures(lease('refuses'))).toMatchObject({ acknowledged: [expect.objectContaining({ op: 'stop' })] });
    expect((await light.getLease(lease('refuses'))).lastFailure).toBeNull();
    expect(await light.unpauseLane(lease('one'))).toMatchObject({ paused: false, changed: true });
    expect((await api.client.getLease(lease('one'))).paused).toBeNull();
  });
});

// The tests mostly wait (on timeouts, backoffs and Retry-After), each against a stub of its own: they run at once.
describe.concurrent('the light client against a server that misbehaves', () => {
  const lease = { provider: 'p', companyId: 'c', environmentId: 'e', leaseId: 'l' };
  const shapeOf = (err: unknown) => ({ light: err instanceof LeaseOpsRequestError, code: (err as LeaseOpsRequestError).code, status: (err as LeaseOpsRequestError).status });

  it('turns a stalled body, a cut connection, a caller giving up and a non-object answer into LeaseOpsRequestError with a code', async ({ onTestFinished }) => {
    const stub = await HttpStub.startFor(onTestFinished);
    const base = stub.base;
    // Headers, then a body that never ends: the request's own timeout.
    stub.answer = (_req, res) => {
      res.writeHead(200, { 'content-type': 'application/json' });
      res.write('{"jobId":');
    };
    const stalled = await new LeaseOpsHttpClient({ url: base, token: 't', requestTimeoutMs: 300 }).getLease(lease).catch((e: unknown) => e);
    expect(shapeOf(stalled)).toEqual({ light: true, code: 'request_timeout', status: 0 });
    // The connection cut mid-body.
    stub.answer = (_req, res) => {
      res.writeHead(200, { 'content-type': 'application/json', 'content-length': '100' });
      res.write('{"jobId":', () => res.socket?.destroy());
    };
    expect(shapeOf(await new LeaseOpsHttpClient({ url: base, token: 't' }).getLease(lease).catch((e: unknown) => e))).toEqual({ light: true, code: 'unreachable', status: 0 });
    // The caller gives up: its own code, not "unreachable".
    stub.answer = () => undefined;
    const controller = new AbortController();
    const pending = new LeaseOpsHttpClient({ url: base, token: 't' }).exec(lease, { providerLeaseId: 'l', command: 'true' }, { signal: controller.signal }).catch((e: unknown) => e);
    controller.abort();
    expect(shapeOf(await pending)).toEqual({ light: true, code: 'aborted', status: 0 });
    // 200 with a JSON array, or with nothing: not a view.
    for (const body of ['[1,2]', '']) {
      stub.answer = (_req, res) => res.writeHead(200, { 'content-type': 'application/json' }).end(body);
      expect(shapeOf(await new LeaseOpsHttpClient({ url: base, token: 't' }).getLease(lease).catch((e: unknown) => e))).toEqual({ light: true, code: 'invalid_answer', status: 200 });
    }
  });

  it("waits for a result through what passes (a cut connection, 503 with Retry-After, 429, 502), not through what does not (401), and says unreachable, not wait_timeout, when nothing answered at the end", { timeout: 20_000 }, async ({ onTestFinished }) => {
    const stub = await HttpStub.startFor(onTestFinished);
    const base = stub.base;
    const ended = { jobId: 'j', op: 'stop', state: 'completed', result: { ok: true } };
    const answers: ((res: ServerResponse) => void)[] = [
      (res) => res.socket?.destroy(),
      (res) => res.writeHead(503, { 'content-type': 'application/json', 'retry-after': '0' }).end(JSON.stringify({ error: { code: 'client_closed', message: 'closing' } })),
      (res) => res.writeHead(429, { 'content-type': 'application/json', 'retry-after': '0' }).end(JSON.stringify({ error: { code: 'company_waits_full', message: 'full' } })),
      (res) => res.writeHead(502).end('<html>bad gateway</html>'),
      (res) => res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(ended)),
    ];
    let asked = 0;
    stub.answer = (_req, res) => answers[Math.min(asked++, answers.length - 1)]!(res);
    expect(await new LeaseOpsHttpClient({ url: base, token: 't' }).waitForResult('j', 10_000)).toEqual({ jobId: 'j', state: 'completed', result: { ok: true } });
    expect(asked).toBe(5);

    asked = 0;
    stub.answer = (_req, res) => {
      asked++;
      res.writeHead(401, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { code: 'unauthorized', message: 'no' } }));
    };
    expect(shapeOf(await new LeaseOpsHttpClient({ url: base, token: 't' }).waitForResult('j', 5_000).catch((e: unknown) => e))).toEqual({ light: true, code: 'unauthorized', status: 401 });
    expect(asked).toBe(1);

    // Nobody home for the whole wait: asked again (backing off) until the time is up, then unreachable.
    let tries = 0;
    const refusing: typeof fetch = (input, init) => {
      tries++;
      return fetch(input, init);
    };
    const t0 = Date.now();
    const away = await new LeaseOpsHttpClient({ url: `http://127.0.0.1:${await freePort()}`, token: 't', fetch: refusing }).waitForResult('j', 1_500).catch((e: unknown) => e);
    expect(shapeOf(away)).toEqual({ light: true, code: 'unreachable', status: 0 });
    expect((away as LeaseOpsRequestError).details).toEqual({ cause: 'ECONNREFUSED' });
    expect(Date.now() - t0).toBeGreaterThanOrEqual(1_400);
    expect(tries).toBeGreaterThan(2);
    expect(tries).toBeLessThan(20);
  });

  it("paces a wait that the server answers at once, whatever its Retry-After says (0, below 0, empty), ends within a second of its time against a server that never answers, and stops at once for a redirect, a 503 that does not pass, or its caller's signal (helper-37)", { timeout: 20_000 }, async ({ onTestFinished }) => {
    const stub = await HttpStub.startFor(onTestFinished);
    const base = stub.base;
    let asked = 0;
    const count = (answer: (res: ServerResponse) => void) => {
      asked = 0;
      stub.answer = (_req, res) => {
        asked++;
        answer(res);
      };
    };
    const client = new LeaseOpsHttpClient({ url: base, token: 't' });
    // 1,092 requests in 2 s with Retry-After: 0 before; backing off from 100 ms, about 4 in 0.8 s.
    for (const retryAfter of ['0', '-5', '']) {
      count((res) => res.writeHead(503, { 'content-type': 'application/json', 'retry-after': retryAfter }).end(JSON.stringify({ error: { code: 'client_closed', message: 'closing' } })));
      expect(shapeOf(await client.waitForResult('j', 800).catch((e: unknown) => e))).toEqual({ light: true, code: 'client_closed', status: 503 });
      expect({ retryAfter, asked: asked < 12 }).toEqual({ retryAfter, asked: true });
    }
    // A server whose waits are capped at 0 (LEASE_OPS_API_MAX_WAIT_MS=0): 8,264 polls in 2 s before.
    count((res) => res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ jobId: 'j', op: 'stop', state: 'running' })));
    expect(shapeOf(await client.waitForResult('j', 800).catch((e: unknown) => e))).toEqual({ light: true, code: 'wait_timeout', status: 0 });
    expect(asked).toBeLessThan(12);
    // Never an answer: request_timeout within a second of the wait's time (11 s for a 1 s wait before).
    count(() => undefined);
    const t0 = Date.now();
    expect(shapeOf(await client.waitForResult('j', 1_000).catch((e: unknown) => e))).toEqual({ light: true, code: 'request_timeout', status: 0 });
    expect(Date.now() - t0).toBeLessThan(2_500);
    // What does not pass: thrown after one request.
    count((res) => res.writeHead(302, { location: 'http://127.0.0.1:9/' }).end());
    expect(shapeOf(await client.waitForResult('j', 5_000).catch((e: unknown) => e))).toEqual({ light: true, code: 'unreachable', status: 0 });
    expect(asked).toBe(1);
    count((res) => res.writeHead(503, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { code: 'secrets_key_mismatch', message: 'the workers cannot open it' } })));
    expect(shapeOf(await client.waitForResult('j', 5_000).catch((e: unknown) => e))).toEqual({ light: true, code: 'secrets_key_mismatch', status: 503 });
    expect(asked).toBe(1);
    // The caller gives up, during a poll or a pause.
    for (const answer of [() => undefined, (res: ServerResponse) => res.writeHead(503, { 'retry-after': '30' }).end()]) {
      count(answer);
      const controller = new AbortController();
      const waiting = client.waitForResult('j', 10_000, { signal: controller.signal }).catch((e: unknown) => e);
      await readUntil(async () => asked >= 1, 5_000, 'the first poll');
      const aborted = Date.now();
      controller.abort();
      expect(shapeOf(await waiting)).toEqual({ light: true, code: 'aborted', status: 0 });
      expect(Date.now() - aborted).toBeLessThan(500);
    }
  });

  it('backs off from 100 ms to 2 s, not past it (helper-38: 3.2 s)', { timeout: 20_000 }, async ({ onTestFinished }) => {
    const stub = await HttpStub.startFor(onTestFinished);
    const base = stub.base;
    const at: number[] = [];
    stub.answer = (_req, res) => {
      at.push(Date.now());
      res.writeHead(503, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { code: 'redis_unavailable', message: 'away' } }));
    };
    await new LeaseOpsHttpClient({ url: base, token: 't' }).waitForResult('j', 6_000).catch(() => undefined);
    const gaps = at.slice(1).map((t, i) => t - at[i]!);
    expect(gaps.length).toBeGreaterThanOrEqual(6);
    expect(Math.max(...gaps.slice(0, -1))).toBeGreaterThanOrEqual(1_900);
    expect(Math.max(...gaps)).toBeLessThan(2_400);
  });

  it('refuses what it cannot send: a wait that is not a number, a lease id a URL would resolve away', async ({ onTestFinished }) => {
    const stub = await HttpStub.startFor(onTestFinished);
    const base = stub.base;
    const client = new LeaseOpsHttpClient({ url: base, token: 't' });
    expect(shapeOf(await client.waitForResult('j', Number.NaN).catch((e: unknown) => e))).toEqual({ light: true, code: 'invalid_request', status: 0 });
    expect(shapeOf(await client.getLease({ ...lease, leaseId: '..' }).catch((e: unknown) => e))).toEqual({ light: true, code: 'invalid_request', status: 0 });
    // The server refuses them too (400), for every client.
    const { LeaseIdentitySchema } = await import('../src/lease.ts');
    expect(LeaseIdentitySchema.safeParse({ ...lease, leaseId: '..' }).success).toBe(false);
    expect(LeaseIdentitySchema.safeParse({ ...lease, environmentId: '.' }).success).toBe(false);
  });
});
