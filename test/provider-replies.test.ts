import { readFileSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CreateosFake } from '../src/fakes/createos-fake.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createCreateosProvider } from '../src/providers/createos/index.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { loadProviders } from '../src/providers/registry.ts';
import { localRateLimiters, type RateLimiterFactory } from '../src/providers/pacing.ts';
import type { LeaseProvider, SandboxState } from '../src/providers/types.ts';
import { runOperation } from '../src/processors/index.ts';
import { providerContext, settled } from './helpers/provider-context.ts';

const fixture = (name: string) => JSON.parse(readFileSync(new URL(`./fixtures/${name}`, import.meta.url), 'utf8')) as Record<string, unknown>;
const typeOf = (v: unknown) => (v === null ? 'null' : Array.isArray(v) ? 'array' : typeof v);
/** Field name -> JSON type: what a reply's shape is, whatever its values. */
const shapeOf = (o: Record<string, unknown>) => Object.fromEntries(Object.entries(o).map(([k, v]) => [k, typeOf(v)]));

async function getJson(url: string, headers: Record<string, string>): Promise<Record<string, unknown>> {
  return (await (await fetch(url, { headers })).json()) as Record<string, unknown>;
}

describe('the Daytona fake answers as Daytona does', () => {
  let fake: DaytonaFake;
  let url: string;
  let provider: LeaseProvider;
  beforeAll(async () => {
    fake = new DaytonaFake({ apiKey: 'k' });
    url = await fake.listen();
    provider = createDaytonaProvider({ apiUrl: url, apiKey: 'k' });
  });
  afterAll(() => fake.close());
  const auth = { authorization: 'Bearer k' };

  it('sends the server DTO: every field, nullable ones as null, and fields newer than the client', async () => {
    const created = (await (await fetch(`${url}/sandbox`, { method: 'POST', headers: { ...auth, 'content-type': 'application/json' }, body: JSON.stringify({ name: 'fixture-check', labels: { a: 'b' } }) })).json()) as Record<string, unknown>;
    const { autoPauseInterval, kvm, ...createdKnown } = created;
    expect(shapeOf(createdKnown)).toEqual(shapeOf(fixture('daytona-sandbox.create.json')));
    expect({ autoPauseInterval, kvm, state: created.state, errorReason: created.errorReason }).toEqual({ autoPauseInterval: 0, kvm: false, state: 'creating', errorReason: null });
    await settled(async () => {
      if (fake.stateOf('fixture-check') !== 'started') throw new (await import('../src/providers/errors.ts')).SettlingError('x', 'not yet');
    });
    const { autoPauseInterval: _a, kvm: _k, ...read } = await getJson(`${url}/sandbox/fixture-check`, auth);
    expect(shapeOf(read)).toEqual(shapeOf(fixture('daytona-sandbox.get.json')));
  });

  it('takes a create fault aimed at one create (by its body) on that create only: tests that share the fake aim theirs at their own runs', async () => {
    const create = (name: string, run: string) => fetch(`${url}/sandbox`, { method: 'POST', headers: { ...auth, 'content-type': 'application/json' }, body: JSON.stringify({ name, labels: { 'lease-ops/run': run } }) });
    fake.failNextCreate({ kind: 'status', status: 504 }, (body) => (body as { labels?: Record<string, string> }).labels?.['lease-ops/run'] === 'run-b');
    expect((await create('aimed-a', 'run-a')).status).toBe(200);
    expect((await create('aimed-b', 'run-b')).status).toBe(504);
    // Taken once: the run's next create is answered as usual.
    expect((await create('aimed-b2', 'run-b')).status).toBe(200);
    // A matcher that throws on a body it did not expect matches nothing (helper-50: a create
    // with no body got a 400 from the fake), and the aimed fault waits for its own create.
    const aimedAt = (run: string) => (body: unknown) => (body as { labels: Record<string, string> }).labels['lease-ops/run'] === run;
    fake.failNextCreate({ kind: 'status', status: 504 }, aimedAt('run-c'));
    fake.failNextCreate({ kind: 'status', status: 503 });
    expect((await fetch(`${url}/sandbox`, { method: 'POST', headers: auth })).status).toBe(503);
    expect((await create('aimed-c', 'run-c')).status).toBe(504);
    // The fault aimed at a create goes to it before one aimed at none that was queued first.
    fake.failNextCreate({ kind: 'status', status: 503 });
    fake.failNextCreate({ kind: 'status', status: 504 }, aimedAt('run-e'));
    expect((await create('aimed-e', 'run-e')).status).toBe(504);
    expect((await create('aimed-f', 'run-f')).status).toBe(503);
    // A create refused before it made a sandbox (its name taken) leaves the fault for the next.
    fake.failNextCreate({ kind: 'status', status: 504 }, aimedAt('run-d'));
    expect((await create('aimed-a', 'run-d')).status).toBe(409);
    expect((await create('aimed-d', 'run-d')).status).toBe(504);
  });

  it('answers the error body of its newer filter, and 404 once destroyed', async () => {
    const missing = await fetch(`${url}/sandbox/nope`, { headers: auth });
    expect(missing.status).toBe(404);
    expect(await missing.json()).toMatchObject({ statusCode: 404, source: 'DAYTONA_API', code: 'NOT_FOUND', error: 'Not Found', message: 'Sandbox with ID or name nope not found', method: 'GET' });
  });

  // Every state of Daytona's SandboxState (0.218.0), a state newer than this client, and
  // stable states still on their way somewhere: what each reply means to lease-ops.
  const CASES: [state: string, desired: string | undefined, expected: SandboxState][] = [
    ['creating', undefined, { kind: 'transitioning', providerState: 'creating', toward: 'running' }],
    ['restoring', undefined, { kind: 'transitioning', providerState: 'restoring', toward: 'running' }],
    ['destroying', undefined, { kind: 'transitioning', providerState: 'destroying', toward: 'gone' }],
    ['destroyed', undefined, { kind: 'gone' }],
    ['started', undefined, { kind: 'running' }],
    ['stopped', undefined, { kind: 'stopped', providerState: 'stopped' }],
    ['starting', undefined, { kind: 'transitioning', providerState: 'starting', toward: 'running' }],
    ['stopping', undefined, { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' }],
    ['error', undefined, { kind: 'error', providerState: 'error', recoverable: false }],
    ['build_failed', undefined, { kind: 'error', providerState: 'build_failed', recoverable: false }],
    ['pending_build', undefined, { kind: 'transitioning', providerState: 'pending_build', toward: 'running' }],
    ['building_snapshot', undefined, { kind: 'transitioning', providerState: 'building_snapshot', toward: 'running' }],
    ['unknown', 'stopped', { kind: 'transitioning', providerState: 'unknown', toward: 'running' }],
    ['pulling_snapshot', undefined, { kind: 'transitioning', providerState: 'pulling_snapshot', toward: 'running' }],
    ['archived', undefined, { kind: 'stopped', providerState: 'archived' }],
    ['archiving', undefined, { kind: 'transitioning', providerState: 'archiving' }],
    ['resizing', undefined, { kind: 'transitioning', providerState: 'resizing' }],
    ['snapshotting', undefined, { kind: 'transitioning', providerState: 'snapshotting' }],
    ['forking', undefined, { kind: 'transitioning', providerState: 'forking' }],
    ['pausing', undefined, { kind: 'transitioning', providerState: 'pausing', toward: 'stopped' }],
    ['paused', undefined, { kind: 'stopped', providerState: 'paused' }],
    ['resuming', undefined, { kind: 'transitioning', providerState: 'resuming', toward: 'running' }],
    ['hibernating', undefined, { kind: 'transitioning', providerState: 'hibernating' }],
    ['archived', 'started', { kind: 'transitioning', providerState: 'archived', toward: 'running' }],
    ['paused', 'stopped', { kind: 'transitioning', providerState: 'paused', toward: 'stopped' }],
  ];

  it.each(CASES)('reads %s (desired %s) as the kind Daytona means', async (state, desired, expected) => {
    const c = providerContext(`st-${state}-${desired ?? ''}`);
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    fake.control(providerLeaseId, { state, ...(desired ? { desiredState: desired } : {}) });
    expect(await provider.status(providerContext(`st-${state}`), { providerLeaseId })).toEqual(expected);
  });

  it('reads a recoverable error as recoverable, and recovers it on resume', async () => {
    const c = providerContext('rec');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    fake.control(providerLeaseId, { error: { recoverable: true, reason: 'disk full' } });
    expect(await provider.status(providerContext('rec'), { providerLeaseId })).toEqual({ kind: 'error', providerState: 'error', recoverable: true });
    expect((await settled(() => provider.resume(providerContext('rec'), { providerLeaseId, leaseMetadata: {} }))).providerLeaseId).toBe(providerLeaseId);
  });

  it('gives no receipt for a 404 that does not name a sandbox (a wrong API URL, a gateway)', async () => {
    const c = providerContext('gw');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    const misrouted = createDaytonaProvider({ apiUrl: `${url}/gateway`, apiKey: 'k' });
    await expect(misrouted.stop(providerContext('gw'), { providerLeaseId })).rejects.toMatchObject({ kind: 'permanent', code: 'unexpected_not_found' });
    await expect(misrouted.resume(providerContext('gw'), { providerLeaseId, leaseMetadata: {} })).rejects.toMatchObject({ code: 'unexpected_not_found' });
    await expect(misrouted.destroy(providerContext('gw'), { providerLeaseId })).rejects.toMatchObject({ code: 'unexpected_not_found' });
    expect(fake.stateOf(providerLeaseId)).toBe('started');
  });

  it('gives a stopped receipt for a sandbox being archived (nothing runs in it)', async () => {
    const c = providerContext('arch');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    fake.control(providerLeaseId, { state: 'archiving', desiredState: 'archived' });
    expect(await provider.stop(providerContext('arch'), { providerLeaseId })).toEqual({ providerLeaseId, state: 'stopped' });
  });

  it('a clean-up waits out a create that may still be on its way, then finds nothing', async () => {
    const c = providerContext('in-flight');
    await expect(provider.findAcquired!(c, { jobId: 'never-created.job', checkpoint: { createSentAt: String(Date.now()) } })).rejects.toMatchObject({ kind: 'settling', code: 'create_may_be_in_flight' });
    expect(await provider.findAcquired!(c, { jobId: 'never-created.job', checkpoint: { createSentAt: String(Date.now() - 3_600_000) } })).toBeNull();
    expect(await provider.findAcquired!(c, { jobId: 'never-created.job', checkpoint: {} })).toBeNull();
  });

  it('waits out a state it has never heard of instead of acting on it', async () => {
    const c = providerContext('new-state');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    fake.control(providerLeaseId, { state: 'hibernating' });
    const before = fake.calls.length;
    await expect(provider.stop(providerContext('new-state'), { providerLeaseId })).rejects.toMatchObject({ kind: 'settling' });
    await expect(provider.resume(providerContext('new-state'), { providerLeaseId, leaseMetadata: {} })).rejects.toMatchObject({ kind: 'settling' });
    // Only reads: no stop or start was sent to a sandbox in an unknown state.
    expect(fake.calls.slice(before).every((c) => c.method === 'GET')).toBe(true);
  });
});

describe('the CreateOS fake answers as CreateOS does', () => {
  let fake: CreateosFake;
  let url: string;
  let provider: LeaseProvider;
  beforeAll(async () => {
    fake = new CreateosFake({ apiKey: 'k' });
    url = await fake.listen();
    provider = createCreateosProvider({ apiUrl: url, apiKey: 'k', requestsPerMinute: 60_000 });
  });
  afterAll(() => fake.close());
  const auth = { 'x-api-key': 'k' };

  it('creates synchronously with no status and no region in the reply; GET has both and omits what is unset', async () => {
    const res = await fetch(`${url}/v1/sandboxes`, { method: 'POST', headers: { ...auth, 'content-type': 'application/json' }, body: JSON.stringify({ shape: 's-1vcpu-1gb', name: 'fixture-check', auto_pause_after_seconds: 600 }) });
    expect(res.status).toBe(200);
    const created = (await res.json()) as { status: string; data: Record<string, unknown> };
    expect(shapeOf(created.data)).toEqual(shapeOf(fixture('createos-sandbox.create.json').data as Record<string, unknown>));
    const read = await getJson(`${url}/v1/sandboxes/${created.data.id as string}`, auth);
    expect(shapeOf(read.data as Record<string, unknown>)).toEqual(shapeOf(fixture('createos-sandbox.get.json').data as Record<string, unknown>));
    expect(Object.values(read.data as object)).not.toContain(null);
  });

  it('refuses a shape outside the catalog, as CreateOS does', async () => {
    const res = await fetch(`${url}/v1/sandboxes`, { method: 'POST', headers: { ...auth, 'content-type': 'application/json' }, body: JSON.stringify({ shape: 'small' }) });
    expect(res.status).toBe(400);
    expect(await res.json()).toEqual({ status: 'fail', data: { shape: 'unknown shape: small' } });
  });

  const CASES: [status: string, expected: SandboxState][] = [
    ['creating', { kind: 'transitioning', providerState: 'creating', toward: 'running' }],
    ['running', { kind: 'running' }],
    ['pausing', { kind: 'transitioning', providerState: 'pausing', toward: 'stopped' }],
    ['paused', { kind: 'stopped', providerState: 'paused' }],
    ['resuming', { kind: 'transitioning', providerState: 'resuming', toward: 'running' }],
    ['forking', { kind: 'transitioning', providerState: 'forking' }],
    ['error', { kind: 'error', providerState: 'error', recoverable: true }],
    ['destroying', { kind: 'transitioning', providerState: 'destroying', toward: 'gone' }],
    ['destroyed', { kind: 'gone' }],
    ['failed', { kind: 'error', providerState: 'failed', recoverable: false }],
    ['hibernating', { kind: 'transitioning', providerState: 'hibernating' }],
  ];
  it.each(CASES)('reads %s as the kind CreateOS means', async (status, expected) => {
    const { providerLeaseId } = await settled(() => provider.acquire(providerContext(`st-${status}`), { runId: 'r' }));
    fake.control(providerLeaseId, { status });
    expect(await provider.status(providerContext(`st-${status}`), { providerLeaseId })).toEqual(expected);
  });

  it('resumes a sandbox in `error` (not fatal on CreateOS), and calls a failed one expired', async () => {
    const a = await settled(() => provider.acquire(providerContext('err'), { runId: 'r' }));
    fake.control(a.providerLeaseId, { status: 'error' });
    expect((await settled(() => provider.resume(providerContext('err'), { providerLeaseId: a.providerLeaseId, leaseMetadata: a.metadata }))).providerLeaseId).toBe(a.providerLeaseId);
    expect(fake.statusOf(a.providerLeaseId)).toBe('running');
    fake.control(a.providerLeaseId, { status: 'failed' });
    expect(await provider.resume(providerContext('err'), { providerLeaseId: a.providerLeaseId, leaseMetadata: a.metadata })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
    // A failed sandbox runs nothing any more: stopping it is a receipt, not an error.
    expect(await provider.stop(providerContext('err'), { providerLeaseId: a.providerLeaseId })).toEqual({ providerLeaseId: a.providerLeaseId, state: 'destroyed' });
  });

  it('takes lease metadata from a fresh read, so a resume with the lease\'s own metadata finds its paused sandbox', async () => {
    const acquired = await settled(() => provider.acquire(providerContext('meta'), { runId: 'r' }));
    expect(acquired.metadata).toMatchObject({ region: 'us', shape: 's-1vcpu-1gb', rootfs: 'devbox:1' });
    await settled(() => provider.stop(providerContext('meta'), { providerLeaseId: acquired.providerLeaseId }));
    const resumed = await settled(() => provider.resume(providerContext('meta'), { providerLeaseId: acquired.providerLeaseId, leaseMetadata: acquired.metadata }));
    expect(resumed.providerLeaseId).toBe(acquired.providerLeaseId);
    // Metadata of older leases that recorded no region still resumes.
    await settled(() => provider.stop(providerContext('meta'), { providerLeaseId: acquired.providerLeaseId }));
    const old = await settled(() => provider.resume(providerContext('meta'), { providerLeaseId: acquired.providerLeaseId, leaseMetadata: { ...acquired.metadata, region: null } }));
    expect(old.providerLeaseId).toBe(acquired.providerLeaseId);
  });

  it('waits out `error` on a stop (CreateOS may recover it) instead of failing it', async () => {
    const a = await settled(() => provider.acquire(providerContext('err-stop'), { runId: 'r' }));
    fake.control(a.providerLeaseId, { status: 'error' });
    await expect(provider.stop(providerContext('err-stop'), { providerLeaseId: a.providerLeaseId })).rejects.toMatchObject({ kind: 'settling' });
    fake.control(a.providerLeaseId, { status: 'running' });
    expect(await settled(() => provider.stop(providerContext('err-stop'), { providerLeaseId: a.providerLeaseId }))).toEqual({ providerLeaseId: a.providerLeaseId, state: 'stopped' });
  });

  it('gives no receipt for a 404 that does not say the sandbox is unknown', async () => {
    const a = await settled(() => provider.acquire(providerContext('gw'), { runId: 'r' }));
    const misrouted = createCreateosProvider({ apiUrl: `${url}/gateway`, apiKey: 'k', requestsPerMinute: 60_000 });
    await expect(misrouted.stop(providerContext('gw'), { providerLeaseId: a.providerLeaseId })).rejects.toMatchObject({ kind: 'permanent', code: 'unexpected_not_found' });
    await expect(misrouted.resume(providerContext('gw'), { providerLeaseId: a.providerLeaseId, leaseMetadata: {} })).rejects.toMatchObject({ code: 'unexpected_not_found' });
    expect(fake.statusOf(a.providerLeaseId)).toBe('running');
  });

  it('a clean-up finds the live sandbox an acquire made after the one it checkpointed failed', async () => {
    const c = providerContext('recreated');
    const first = await settled(() => provider.acquire(c, { runId: 'r' }));
    const saved = { ...(await c.checkpoint.read()) };
    fake.control(first.providerLeaseId, { status: 'failed' });
    // The name is free again once its sandbox is terminal: a later create may reuse it.
    const second = await settled(() => provider.acquire(c, { runId: 'r' }));
    expect(second.providerLeaseId).not.toBe(first.providerLeaseId);
    expect(await provider.findAcquired!(c, { jobId: c.jobId, checkpoint: saved })).toBe(second.providerLeaseId);
    // And with its checkpoint lost (its job removed), by the name alone.
    expect(await provider.findAcquired!(c, { jobId: c.jobId, checkpoint: null })).toBe(second.providerLeaseId);
  });

  it('accepts an API URL that ends in /v1', async () => {
    const p = createCreateosProvider({ apiUrl: `${url}/v1/`, apiKey: 'k', requestsPerMinute: 60_000 });
    const before = fake.calls.length;
    const { providerLeaseId } = await settled(() => p.acquire(providerContext('v1'), { runId: 'r' }));
    expect(providerLeaseId).toMatch(/^sb-/);
    expect(fake.calls.slice(before).every((c) => c.path.startsWith('/v1/') && !c.path.startsWith('/v1/v1'))).toBe(true);
  });

  it('gives up at once on a shape that is not a CreateOS shape, naming the catalog', () => {
    expect(() => createCreateosProvider({ apiUrl: url, apiKey: 'k', shape: 'small' })).toThrow(/s-1vcpu-256mb/);
  });
});

describe('every operation with default settings, through the providers a worker builds', () => {
  let daytona: DaytonaFake;
  let createos: CreateosFake;
  beforeAll(async () => {
    daytona = new DaytonaFake({ apiKey: 'dk' });
    createos = new CreateosFake({ apiKey: 'ck' });
    await Promise.all([daytona.listen(), createos.listen()]);
  });
  afterAll(async () => {
    await Promise.all([daytona.close(), createos.close()]);
  });

  it('acquire, stop, resume, release, force-stop and destroy each work (or refuse as documented)', async () => {
    const registry = await loadProviders('daytona,createos', {
      DAYTONA_API_URL: daytona.http.url,
      DAYTONA_API_KEY: 'dk',
      CREATEOS_API_URL: createos.http.url,
      CREATEOS_API_KEY: 'ck',
    });
    for (const name of ['daytona', 'createos']) {
      const provider = registry.get(name)!;
      const run = <T>(leaseId: string, op: Parameters<typeof runOperation>[2]['op'], params: unknown) => {
        const c = providerContext(leaseId); // one per operation: its retries are one job's attempts
        return settled(() => runOperation(provider, c, { op, params, lease: { provider: name, companyId: 'co', environmentId: 'env-a', leaseId }, acceptedAt: 0, deadlineAt: Date.now() + 60_000 } as Parameters<typeof runOperation>[2]) as Promise<T>);
      };
      const lease = await run<{ providerLeaseId: string; metadata: Record<string, unknown> }>('l', 'acquire', { runId: 'r' });
      const id = lease.providerLeaseId;
      expect(await run(id, 'stop', { providerLeaseId: id })).toEqual({ providerLeaseId: id, state: 'stopped' });
      expect(await run(id, 'resume', { providerLeaseId: id, leaseMetadata: lease.metadata })).toMatchObject({ providerLeaseId: id });
      expect(await run(id, 'release', { providerLeaseId: id, leaseMetadata: lease.metadata, cancelActiveWork: false, resourceDisposition: 'stop_and_retain' })).toMatchObject({ state: 'stopped' });
      expect(await run(id, 'resume', { providerLeaseId: id, leaseMetadata: lease.metadata })).toMatchObject({ providerLeaseId: id });
      if (provider.capabilities.forceStop) expect(await run(id, 'force-stop', { providerLeaseId: id })).toEqual({ providerLeaseId: id, state: 'stopped' });
      else await expect(run(id, 'force-stop', { providerLeaseId: id })).rejects.toMatchObject({ code: 'force_stop_unsupported' });
      expect(await run(id, 'destroy', { providerLeaseId: id })).toEqual({ providerLeaseId: id, state: 'destroyed' });
      // Expiry as paperclip defines it, asked with an offset: Daytona bounds the sandbox and says
      // when; CreateOS cannot, and answers no expiry (or refuses, with requireExpiry).
      const asked = Date.now() + 3_600_000;
      const withOffset = new Date(asked + 2 * 3_600_000).toISOString().replace('Z', '+02:00');
      const bounded = await run<{ expiresAt: string | null }>('x', 'acquire', { runId: 'x', requestedExpiresAt: withOffset });
      if (name === 'daytona') expect(Date.parse(bounded.expiresAt!)).toBeLessThanOrEqual(asked);
      else expect(bounded.expiresAt).toBeNull();
      // A size neither provider can promise, or a required expiry CreateOS cannot, is refused before anything is made.
      const sandboxesBefore = name === 'daytona' ? daytona.ids().length : createos.live().length;
      if (name === 'createos') await expect(run('e', 'acquire', { runId: 'r', requestedExpiresAt: withOffset, requireExpiry: true })).rejects.toMatchObject({ code: 'expiry_unsupported' });
      await expect(run('e', 'acquire', { runId: 'r', resources: { cpu: 8, memoryGiB: 16 } })).rejects.toMatchObject({ code: 'resources_unsupported' });
      expect(name === 'daytona' ? daytona.ids().length : createos.live().length).toBe(sandboxesBefore);
    }
    await registry.close();
  });
});

describe("a create whose turn came after its operation's deadline", () => {
  // The create waits for its turn (a busy budget, a stalled Redis) past its deadline: the
  // pacer refuses it, and it is never sent. That is no unknown outcome.
  const lateTurns = (isLate: (bucket: string) => boolean): RateLimiterFactory => (scope, limits) => {
    const real = localRateLimiters(scope, limits);
    return {
      async take(bucket, opts) {
        if (isLate(bucket) && opts?.deadlineAt !== undefined) await new Promise((r) => setTimeout(r, Math.max(0, opts.deadlineAt! - Date.now()) + 5));
        return real.take(bucket, opts);
      },
      holdOff: real.holdOff,
    };
  };
  const cases: [string, () => Promise<[DaytonaFake | CreateosFake, (late: RateLimiterFactory) => LeaseProvider, (bucket: string) => boolean]>][] = [
    [
      'Daytona',
      async () => {
        const fake = new DaytonaFake({ apiKey: 'k' });
        const url = await fake.listen();
        // Its create has a budget of its own.
        return [fake, (limiters) => createDaytonaProvider({ apiUrl: url, apiKey: 'k' }, limiters), (bucket) => bucket === 'sandbox-create'];
      },
    ],
    [
      'CreateOS',
      async () => {
        const fake = new CreateosFake({ apiKey: 'k' });
        const url = await fake.listen();
        // One budget for every request: the create is a first attempt's first (its checkpoint has nothing to look up).
        return [fake, (limiters) => createCreateosProvider({ apiUrl: url, apiKey: 'k', requestsPerMinute: 60_000 }, limiters), () => fake.calls.length === 0];
      },
    ],
  ];
  for (const [service, serve] of cases) {
    it(`${service}: fails with deadline_passed, not create_outcome_unknown, sends no create, and leaves its clean-up nothing to wait out`, async () => {
      const [fake, make, isCreate] = await serve();
      try {
        let asked = false;
        const provider = make(lateTurns((bucket) => isCreate(bucket) && (asked = true)));
        const ctx = providerContext('late-create', 'env-a', { deadlineAt: Date.now() + 2_000 });
        const refused = await provider.acquire(ctx, { runId: 'r' }).then(
          () => null,
          (err: unknown) => err as { code?: string; message?: string },
        );
        expect(asked).toBe(true);
        expect(refused?.code, refused?.message).toBe('deadline_passed');
        expect(fake.calls.filter((c) => c.method === 'POST')).toEqual([]);
        // Nothing was sent, so its clean-up has no create to wait out: it finds nothing at once
        // instead of looking again for up to one and a half create timeouts.
        const checkpoint = await ctx.checkpoint.read();
        expect(checkpoint).not.toHaveProperty('createSentAt');
        await expect(make(localRateLimiters).findAcquired!(providerContext('late-create'), { jobId: ctx.jobId, checkpoint })).resolves.toBeNull();
      } finally {
        await fake.close();
      }
    });

    it(`${service}: a create whose checkpoint write outlasted the deadline is not sent after it (helper-48)`, async () => {
      const [fake, make] = await serve();
      try {
        const provider = make(localRateLimiters);
        const ctx = providerContext('slow-checkpoint', 'env-a', { deadlineAt: Date.now() + 500 });
        // Redis slow to take the note that the create is being sent: the deadline passes meanwhile.
        const write = ctx.checkpoint.write;
        ctx.checkpoint.write = async (values) => {
          if ('createSentAt' in values) await new Promise((r) => setTimeout(r, Math.max(0, ctx.deadlineAt - Date.now()) + 50));
          await write(values);
        };
        const refused = await provider.acquire(ctx, { runId: 'r' }).then(
          () => null,
          (err: unknown) => err as { code?: string; message?: string },
        );
        expect(fake.calls.filter((c) => c.method === 'POST')).toEqual([]);
        expect(refused?.code, refused?.message).toBe('deadline_passed');
        // The note stays: its clean-up waits out a create that, as far as it knows, may have gone.
        expect(await ctx.checkpoint.read()).toHaveProperty('createSentAt');
      } finally {
        await fake.close();
      }
    });
  }
});
