import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { PermanentError, SettlingError, TransientError } from '../src/providers/errors.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { createCreateosProvider } from '../src/providers/createos/index.ts';
import { CreateosFake } from '../src/fakes/createos-fake.ts';
import { loadProviderModule } from '../src/providers/registry.ts';
import { createSimulatedProvider } from '../src/providers/simulated/index.ts';
import type { LeaseProvider, OperationContext } from '../src/providers/types.ts';
import { providerContext, settled } from './helpers/provider-context.ts';

/** What a contract run needs from one provider, and what its fake can be told to do. */
interface Subject {
  provider: LeaseProvider;
  /** Makes the next call about this sandbox fail with an HTTP status (fakes only). */
  inject?: (id: string, status: number, retryAfterS?: number) => void;
  lose?: (id: string) => void;
  /** The same provider with a wrong credential, where credentials exist. */
  withWrongKey?: () => LeaseProvider;
  /** The provider itself can tell whose sandbox it is (Daytona labels; not CreateOS). */
  verifiesOwnership: boolean;
  close: () => Promise<void>;
}

const ctx = (leaseId: string, environmentId = 'env-a'): OperationContext => providerContext(leaseId, environmentId);

const SUBJECTS: Record<string, () => Promise<Subject>> = {
  daytona: async () => {
    const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 20, start: 30, stop: 30, forceStop: 0, destroy: 10 } });
    const apiUrl = await fake.listen();
    return {
      provider: createDaytonaProvider({ apiUrl, apiKey: 'k' }),
      inject: (id, status, retryAfterS) => fake.control(id, { failNext: [{ status, retryAfterS }] }),
      lose: (id) => fake.control(id, { lost: true }),
      withWrongKey: () => createDaytonaProvider({ apiUrl, apiKey: 'wrong' }),
      verifiesOwnership: true,
      close: () => fake.close(),
    };
  },
  createos: async () => {
    const fake = new CreateosFake({ apiKey: 'k', timings: { create: 20, pause: 30, resume: 30, destroy: 10 } });
    const apiUrl = await fake.listen();
    return {
      provider: createCreateosProvider({ apiUrl, apiKey: 'k', requestsPerMinute: 6_000 }),
      inject: (id, status, retryAfterS) => fake.control(id, { failNext: [{ status, retryAfterS }] }),
      lose: (id) => fake.control(id, { lost: true }),
      withWrongKey: () => createCreateosProvider({ apiUrl, apiKey: 'wrong' }),
      // CreateOS keeps no labels: the sandbox's name carries its company and environment.
      verifiesOwnership: true,
      close: () => fake.close(),
    };
  },
  simulated: async () => {
    const provider = await createSimulatedProvider({});
    return { provider, verifiesOwnership: true, close: async () => provider.close?.() };
  },
  'README example (examples/memory-provider.ts)': async () => {
    const path = fileURLToPath(new URL('../examples/memory-provider.ts', import.meta.url));
    const provider = await loadProviderModule(path, { MEMORY_PROVIDER_TRANSITION_MS: '20' });
    return { provider, verifiesOwnership: true, close: async () => undefined };
  },
};

for (const [name, make] of Object.entries(SUBJECTS)) {
  describe(`provider contract: ${name}`, () => {
    let s: Subject;
    beforeAll(async () => {
      s = await make();
    });
    afterAll(async () => {
      await s.close();
    });

    // One context per operation: its retries keep the job id, as the lane's retries do.
    const acquire = async (leaseId: string) => {
      const c = ctx(leaseId);
      return settled(() => s.provider.acquire(c, { runId: `run-${leaseId}` }));
    };

    it('acquires a running sandbox and reads it fresh', async () => {
      const lease = await acquire('a1');
      expect(lease.providerLeaseId).toMatch(/\S/);
      expect(await s.provider.status(ctx('a1'), { providerLeaseId: lease.providerLeaseId })).toEqual({ kind: 'running' });
    });

    it('stops a started sandbox with a receipt only once it is stopped, and stops a stopped one again', async () => {
      const { providerLeaseId } = await acquire('s1');
      const receipt = await settled(() => s.provider.stop(ctx('s1'), { providerLeaseId }));
      expect(receipt).toEqual({ providerLeaseId, state: 'stopped' });
      expect((await s.provider.status(ctx('s1'), { providerLeaseId })).kind).toBe('stopped');
      expect(await s.provider.stop(ctx('s1'), { providerLeaseId })).toEqual({ providerLeaseId, state: 'stopped' });
    });

    it('resumes a stopped sandbox, and calls a gone one expired', async () => {
      const { providerLeaseId } = await acquire('r1');
      await settled(() => s.provider.stop(ctx('r1'), { providerLeaseId }));
      const resumed = await settled(() => s.provider.resume(ctx('r1'), { providerLeaseId, leaseMetadata: {} }));
      expect(resumed.providerLeaseId).toBe(providerLeaseId);
      expect((await s.provider.status(ctx('r1'), { providerLeaseId })).kind).toBe('running');
      await settled(() => s.provider.destroy(ctx('r1'), { providerLeaseId }));
      expect(await s.provider.resume(ctx('r1'), { providerLeaseId, leaseMetadata: {} })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
    });

    it('refuses a sandbox of another environment (lease_environment_mismatch) on stop, force-stop, destroy and release, with nothing of it recorded; resumes it as expired; and it runs on', async (t) => {
      if (!s.verifiesOwnership) return t.skip();
      const { providerLeaseId } = await acquire('m1');
      expect(await s.provider.resume(ctx('m1', 'env-b'), { providerLeaseId, leaseMetadata: {} })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
      const calls: [string, (c: OperationContext) => Promise<unknown>][] = [
        ['stop', (c) => s.provider.stop(c, { providerLeaseId })],
        ['force-stop', (c) => s.provider.forceStop(c, { providerLeaseId })],
        ['destroy', (c) => s.provider.destroy(c, { providerLeaseId })],
        ...(['keep_running', 'stop_and_retain', 'destroy'] as const).map(
          (resourceDisposition) => [`release ${resourceDisposition}`, (c: OperationContext) => s.provider.release(c, { providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition })] as [string, (c: OperationContext) => Promise<unknown>],
        ),
      ];
      for (const [what, call] of calls) {
        const other = ctx('m1', 'env-b');
        const outcome = await call(other).then((r) => ({ receipt: r }), (e: unknown) => ({ error: e as { code?: string; message?: string } }));
        if (what === 'force-stop' && !s.provider.capabilities.forceStop) continue;
        expect(outcome, what).toMatchObject({ error: { code: 'lease_environment_mismatch' } });
        // Nothing of it is recorded (ctx.observe) or said beyond the code and the id asked for.
        expect((other as unknown as { observed: unknown[] }).observed, what).toEqual([]);
        expect((outcome as { error: { message: string } }).error.message).not.toMatch(/env-a|started|running|co\b/);
      }
      expect((await s.provider.status(ctx('m1'), { providerLeaseId })).kind).toBe('running');
      // A missing sandbox is not a foreign one: it is gone, which a destroy counts as success.
      expect(await s.provider.destroy(ctx('m1', 'env-b'), { providerLeaseId: 'no-such-sandbox' })).toEqual({ providerLeaseId: 'no-such-sandbox', state: 'destroyed' });
    });

    it('releases with each disposition: a receipt once execution ended, null when the sandbox keeps running', async () => {
      const release = (leaseId: string, providerLeaseId: string, resourceDisposition: 'keep_running' | 'stop_and_retain' | 'archive' | 'destroy') =>
        settled(() => s.provider.release(ctx(leaseId), { providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition }));
      const keep = await acquire('rel-keep');
      expect(await release('rel-keep', keep.providerLeaseId, 'keep_running')).toBeNull();
      expect((await s.provider.status(ctx('rel-keep'), keep)).kind).toBe('running');

      const retain = await acquire('rel-retain');
      expect(await release('rel-retain', retain.providerLeaseId, 'stop_and_retain')).toEqual({ providerLeaseId: retain.providerLeaseId, state: 'stopped' });
      expect((await s.provider.status(ctx('rel-retain'), retain)).kind).toBe('stopped');
      // Kept running after it stopped: what it is now, a receipt.
      expect(await release('rel-retain', retain.providerLeaseId, 'keep_running')).toEqual({ providerLeaseId: retain.providerLeaseId, state: 'stopped' });

      const gone = await acquire('rel-destroy');
      expect(await release('rel-destroy', gone.providerLeaseId, 'destroy')).toEqual({ providerLeaseId: gone.providerLeaseId, state: 'destroyed' });
      expect(await s.provider.status(ctx('rel-destroy'), gone)).toEqual({ kind: 'gone' });

      if (s.provider.capabilities.archive) {
        const archived = await acquire('rel-archive');
        expect(await release('rel-archive', archived.providerLeaseId, 'archive')).toEqual({ providerLeaseId: archived.providerLeaseId, state: 'stopped' });
        expect(await s.provider.status(ctx('rel-archive'), archived)).toEqual({ kind: 'stopped', providerState: 'archived' });
        // An archived sandbox resumes (Daytona restores it).
        expect((await settled(() => s.provider.resume(ctx('rel-archive'), { providerLeaseId: archived.providerLeaseId, leaseMetadata: {} }))).providerLeaseId).toBe(archived.providerLeaseId);
      }
    });

    it('bounds a sandbox at requestedExpiresAt where the service can, with its own expiry; answers no expiry where it cannot', async () => {
      const asked = Date.now() + 30.5 * 60_000;
      const c = ctx('x1');
      const lease = await settled(() => s.provider.acquire(c, { runId: 'x1', requestedExpiresAt: new Date(asked).toISOString() }));
      if (!s.provider.capabilities.expiry) {
        expect(lease.expiresAt).toBeNull();
        return;
      }
      expect(lease.expiresAt).not.toBeNull();
      const at = Date.parse(lease.expiresAt!);
      // Whole minutes from when it was set, rounded down: at or before the time asked, within a minute of it.
      expect(at).toBeLessThanOrEqual(asked);
      expect(at).toBeGreaterThan(asked - 61_000);
      // Less than a minute away cannot be bounded in Daytona's minutes: no expiry is claimed.
      const c2 = ctx('x2');
      const soon = await settled(() => s.provider.acquire(c2, { runId: 'x2', requestedExpiresAt: new Date(Date.now() + 30_000).toISOString() }));
      expect(soon.expiresAt).toBeNull();
    });

    it('force-stops, or refuses at once where the provider cannot', async () => {
      const { providerLeaseId } = await acquire('f1');
      if (!s.provider.capabilities.forceStop) {
        await expect(s.provider.forceStop(ctx('f1'), { providerLeaseId })).rejects.toMatchObject({ kind: 'permanent', code: 'force_stop_unsupported' });
        return;
      }
      expect(await settled(() => s.provider.forceStop(ctx('f1'), { providerLeaseId }))).toEqual({ providerLeaseId, state: 'stopped' });
      expect((await s.provider.status(ctx('f1'), { providerLeaseId })).kind).toBe('stopped');
    });

    it('destroys twice: the second time the sandbox is already gone, which is success', async () => {
      const { providerLeaseId } = await acquire('d1');
      expect(await settled(() => s.provider.destroy(ctx('d1'), { providerLeaseId }))).toEqual({ providerLeaseId, state: 'destroyed' });
      expect(await s.provider.destroy(ctx('d1'), { providerLeaseId })).toEqual({ providerLeaseId, state: 'destroyed' });
    });

    it('raises settling while a transition runs', async () => {
      const { providerLeaseId } = await acquire('t1');
      if (s.inject) {
        s.inject(providerLeaseId, 409);
        await expect(s.provider.stop(ctx('t1'), { providerLeaseId })).rejects.toBeInstanceOf(SettlingError);
      } else {
        // Providers without an HTTP fake: catch one mid-stop.
        await expect(s.provider.stop(ctx('t1'), { providerLeaseId })).rejects.toBeInstanceOf(SettlingError);
        await expect(s.provider.resume(ctx('t1'), { providerLeaseId, leaseMetadata: {} })).rejects.toBeInstanceOf(SettlingError);
      }
    });

    it('tells a refusal for this account (403: a quota, a permission) from bad credentials', async (t) => {
      if (!s.inject) return t.skip();
      const c = ctx('q1');
      const { providerLeaseId } = await settled(() => s.provider.acquire(c, { runId: 'r' }));
      s.inject(providerLeaseId, 403);
      await expect(s.provider.stop(ctx('q1'), { providerLeaseId })).rejects.toMatchObject({ kind: 'permanent', code: 'forbidden' });
    });

    // Last but one: the 429's Retry-After holds this account's budget, and no request of this
    // test waits for it (the next test's provider has another key, and so another budget).
    it('raises transient errors for 5xx and 429 (with Retry-After)', async (t) => {
      if (!s.inject) return t.skip();
      const { providerLeaseId } = await acquire('e1');
      s.inject(providerLeaseId, 503);
      await expect(s.provider.stop(ctx('e1'), { providerLeaseId })).rejects.toBeInstanceOf(TransientError);
      s.inject(providerLeaseId, 429, 2);
      const limited = await s.provider.status(ctx('e1'), { providerLeaseId }).catch((e: unknown) => e);
      expect(limited).toBeInstanceOf(TransientError);
      expect((limited as TransientError).retryAfterMs).toBe(2_000);
    });

    it('raises a permanent error for bad credentials', async (t) => {
      if (!s.withWrongKey) return t.skip();
      await expect(s.withWrongKey().acquire(ctx('k1'), { runId: 'r' })).rejects.toMatchObject({ kind: 'permanent', code: 'unauthorized' });
    });
  });
}

describe('CreateOS specifics', () => {
  let fake: CreateosFake;
  let apiUrl: string;
  beforeAll(async () => {
    fake = new CreateosFake({ apiKey: 'k', timings: { create: 10, pause: 200, resume: 200, destroy: 10 }, rateLimit: { limit: 120, windowMs: 60_000 } });
    apiUrl = await fake.listen();
  });
  afterAll(() => fake.close());

  it('treats an asynchronous pause reply as not done: settling until a fresh read says paused', async () => {
    const provider = createCreateosProvider({ apiUrl, apiKey: 'k', requestsPerMinute: 6_000 });
    const c = ctx('p1');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    await expect(provider.stop(ctx('p1'), { providerLeaseId })).rejects.toBeInstanceOf(SettlingError);
    expect(fake.statusOf(providerLeaseId)).toBe('pausing');
    expect(await settled(() => provider.stop(ctx('p1'), { providerLeaseId }))).toEqual({ providerLeaseId, state: 'stopped' });
  });

  it('cannot end the work in a sandbox it keeps (a pause suspends it): cancelActiveWork with stop_and_retain is refused, as is archive', async () => {
    const provider = createCreateosProvider({ apiUrl, apiKey: 'k', requestsPerMinute: 6_000 });
    const { providerLeaseId } = await settled(() => provider.acquire(ctx('cx'), { runId: 'r' }));
    await expect(provider.release(ctx('cx'), { providerLeaseId, leaseMetadata: {}, cancelActiveWork: true, resourceDisposition: 'stop_and_retain' })).rejects.toMatchObject({ code: 'cancel_unsupported' });
    await expect(provider.release(ctx('cx'), { providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition: 'archive' })).rejects.toMatchObject({ code: 'archive_unsupported' });
    expect(fake.statusOf(providerLeaseId)).toBe('running');
  });

  it('refuses a lease of another environment, and calls a sandbox of another shape expired', async () => {
    const provider = createCreateosProvider({ apiUrl, apiKey: 'k', requestsPerMinute: 6_000 });
    const c = ctx('p2');
    const lease = await settled(() => provider.acquire(c, { runId: 'r' }));
    await expect(provider.resume(ctx('p2', 'env-b'), { providerLeaseId: lease.providerLeaseId, leaseMetadata: lease.metadata })).rejects.toMatchObject({ code: 'lease_environment_mismatch' });
    expect(await provider.resume(ctx('p2'), { providerLeaseId: lease.providerLeaseId, leaseMetadata: { ...lease.metadata, shape: 'large' } })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
  });

  it('paces its requests under the rate limit instead of running into 429s', async () => {
    // The fake allows 120 requests a minute; the client paces itself to the same, two a
    // second, so a burst of six is spread over three seconds and none is refused.
    const provider = createCreateosProvider({ apiUrl, apiKey: 'k', requestsPerMinute: 120, burst: 1 });
    const c = ctx('p3');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    const before = fake.rateLimited;
    const started = Date.now();
    await Promise.all(Array.from({ length: 6 }, () => provider.status(ctx('p3'), { providerLeaseId })));
    expect(fake.rateLimited).toBe(before);
    // Two requests a second: six take at least two seconds.
    expect(Date.now() - started).toBeGreaterThanOrEqual(1_900);
  });

  it('checks the fence when a paced request gets its slot, so one superseded while it waited is never sent', async () => {
    const provider = createCreateosProvider({ apiUrl, apiKey: 'k', requestsPerMinute: 60, burst: 1 });
    const c = ctx('p4');
    const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
    let superseded = false;
    const fenced = {
      ...ctx('p4'),
      attemptId: 'paced-attempt:1',
      fence: async () => {
        if (superseded) throw Object.assign(new Error('a newer attempt holds the lease'), { code: 'stale_attempt' });
      },
    };
    // One request a second: the first takes this second's slot, the second waits for the next.
    const first = provider.status(fenced, { providerLeaseId });
    const second = provider.status(fenced, { providerLeaseId }).then(
      () => 'sent',
      (err: unknown) => (err as { code?: string }).code,
    );
    await first;
    superseded = true;
    expect(await second).toBe('stale_attempt');
    expect(fake.calls.filter((call) => call.attempt === 'paced-attempt:1')).toHaveLength(1);
  });
});

describe('docs/providers.md', () => {
  it('shows the example provider exactly as the contract tests run it', async () => {
    const { readFile } = await import('node:fs/promises');
    const readme = await readFile(new URL('../docs/providers.md', import.meta.url), 'utf8');
    const example = await readFile(new URL('../examples/memory-provider.ts', import.meta.url), 'utf8');
    expect(readme).toContain(example);
  });
});

describe('Daytona specifics', () => {
  let fake: DaytonaFake;
  let provider: LeaseProvider;
  beforeAll(async () => {
    fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 20, stop: 20, forceStop: 0, destroy: 10, archive: 20 } });
    provider = createDaytonaProvider({ apiUrl: await fake.listen(), apiKey: 'k' });
  });
  afterAll(() => fake.close());
  const fresh = async (leaseId: string) => {
    const c = ctx(leaseId);
    return (await settled(() => provider.acquire(c, { runId: 'r' }))).providerLeaseId;
  };

  it('stop-and-retain disables auto-delete, and confirms it, before stopping', async () => {
    const id = await fresh('ret');
    await settled(() => provider.release(ctx('ret'), { providerLeaseId: id, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition: 'stop_and_retain' }));
    expect(fake.sandboxes.get(id)?.autoDeleteInterval).toBe(-1);
    const calls = fake.calls.filter((c) => c.sandboxId === id).map((c) => `${c.method} ${c.path.replace(id, ':id')}`);
    expect(calls.indexOf('POST /sandbox/:id/autodelete/-1')).toBeLessThan(calls.indexOf('POST /sandbox/:id/stop'));
  });

  it('recovers a sandbox in a recoverable error on resume, and fails on an unrecoverable one', async () => {
    const a = await fresh('err-a');
    fake.control(a, { error: { recoverable: true, reason: 'disk full' } });
    const resumed = await settled(() => provider.resume(ctx('err-a'), { providerLeaseId: a, leaseMetadata: {} }));
    expect(resumed.providerLeaseId).toBe(a);
    expect(fake.stateOf(a)).toBe('started');
    const b = await fresh('err-b');
    fake.control(b, { error: { recoverable: false, reason: 'host lost' } });
    await expect(provider.resume(ctx('err-b'), { providerLeaseId: b, leaseMetadata: {} })).rejects.toMatchObject({ kind: 'permanent', code: 'sandbox_unrecoverable' });
  });

  it('a stop that ignores SIGTERM stays settling; a force-stop ends it; a refused force-stop is settling too', async () => {
    const id = await fresh('stuck');
    fake.control(id, { stuckStoppingMs: 60_000, refuseForceStops: 1 });
    await expect(provider.stop(ctx('stuck'), { providerLeaseId: id })).rejects.toBeInstanceOf(SettlingError);
    await expect(provider.stop(ctx('stuck'), { providerLeaseId: id })).rejects.toBeInstanceOf(SettlingError);
    expect(fake.stateOf(id)).toBe('stopping');
    await expect(provider.forceStop(ctx('stuck'), { providerLeaseId: id })).rejects.toMatchObject({ kind: 'settling', code: 'state_change_in_progress' });
    expect(await provider.forceStop(ctx('stuck'), { providerLeaseId: id })).toEqual({ providerLeaseId: id, state: 'stopped' });
    const stops = fake.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/stop'));
    expect(stops.length).toBe(3); // the graceful stop once (then only reads), two force attempts
  });

  it('a TTL destroys the sandbox at its expiry whatever its state, and the expiry is the one the service reports', async () => {
    const c = ctx('ttl');
    const lease = await settled(() => provider.acquire(c, { runId: 'ttl', requestedExpiresAt: new Date(Date.now() + 10 * 60_000 + 5_000).toISOString() }));
    const id = lease.providerLeaseId;
    const created = fake.calls.find((call) => call.method === 'POST' && call.path === '/sandbox' && call.sandboxId === id);
    expect(created?.body).toMatchObject({ ttlMinutes: 10 });
    expect(lease.expiresAt).toBe(new Date(fake.sandboxes.get(id)!.autoDestroyAt!).toISOString());
    // A sandbox acquired again (its create retried) with a later TTL gets it re-anchored.
    fake.sandboxes.get(id)!.autoDestroyAt = Date.now() + 60 * 60_000;
    const again = await settled(() => provider.acquire(c, { runId: 'ttl', requestedExpiresAt: new Date(Date.now() + 10 * 60_000 + 5_000).toISOString() }));
    expect(Date.parse(again.expiresAt!)).toBeLessThanOrEqual(Date.now() + 10 * 60_000 + 5_000);
    expect(fake.calls.some((call) => call.sandboxId === id && call.path === `/sandbox/${id}/ttl/10`)).toBe(true);
    // When it elapses the sandbox is gone, stopped or not.
    await settled(() => provider.stop(ctx('ttl'), { providerLeaseId: id }));
    fake.sandboxes.get(id)!.autoDestroyAt = Date.now() - 1;
    expect(await provider.status(ctx('ttl'), { providerLeaseId: id })).toEqual({ kind: 'gone' });
  });

  it('hands the host fields of an acquire over as labels, and picks the snapshot by adapter type', async () => {
    const byAdapter = createDaytonaProvider({ apiUrl: fake.http.url, apiKey: 'k', snapshot: 'base', snapshotsByAdapter: { claude_local: 'claude-snap' } });
    const c = ctx('host');
    const lease = await settled(() =>
      byAdapter.acquire(c, { runId: 'host', agentId: 'agent-7', adapterType: 'claude_local', issueId: 'iss-1', executionWorkspaceId: 'ew-1', workspaceMode: 'isolated', requestedCwd: '/work' }),
    );
    const created = fake.calls.find((call) => call.method === 'POST' && call.path === '/sandbox' && call.sandboxId === lease.providerLeaseId);
    expect(created?.body).toMatchObject({
      snapshot: 'claude-snap',
      labels: { 'lease-ops/agent': 'agent-7', 'lease-ops/adapter': 'claude_local', 'lease-ops/issue': 'iss-1', 'lease-ops/execution-workspace': 'ew-1', 'lease-ops/run': 'host' },
    });
    expect(lease.metadata).toMatchObject({ adapterType: 'claude_local', snapshot: 'claude-snap' });
    const c2 = ctx('host2');
    const plain = await settled(() => byAdapter.acquire(c2, { runId: 'host2', adapterType: 'codex_local' }));
    expect(fake.calls.find((call) => call.method === 'POST' && call.path === '/sandbox' && call.sandboxId === plain.providerLeaseId)?.body).toMatchObject({ snapshot: 'base' });
  });

  it('cancelActiveWork on a stop-and-retain release kills instead of asking the work to end', async () => {
    const id = await fresh('cancel');
    fake.control(id, { stuckStoppingMs: 60_000 });
    expect(await settled(() => provider.release(ctx('cancel'), { providerLeaseId: id, leaseMetadata: {}, cancelActiveWork: true, resourceDisposition: 'stop_and_retain' }))).toEqual({ providerLeaseId: id, state: 'stopped' });
    expect(fake.calls.filter((call) => call.sandboxId === id && call.path.endsWith('/stop')).map((call) => call.query)).toEqual(['?force=true']);
  });

  it('takes a sandbox by its id only: named by its Daytona name, every operation is refused (one sandbox, one lease)', async () => {
    const id = await fresh('by-name');
    const sandboxName = fake.sandboxes.get(id)!.name;
    for (const call of [
      () => provider.stop(ctx('by-name'), { providerLeaseId: sandboxName }),
      () => provider.destroy(ctx('by-name'), { providerLeaseId: sandboxName }),
      () => provider.resume(ctx('by-name'), { providerLeaseId: sandboxName, leaseMetadata: {} }),
    ]) {
      await expect(call()).rejects.toMatchObject({ kind: 'permanent', code: 'not_a_sandbox_id' });
    }
    expect(fake.stateOf(id)).toBe('started');
  });

  it('refuses, before any request, what cannot be a sandbox id (capitals, paths, its own names): no other lease\'s calls meet this one\'s', async () => {
    const id = await fresh('not-ids');
    const before = fake.calls.length;
    for (const notAnId of [id.toUpperCase(), `${id}/pause`, `${id}?x=1`, `../${id}`, `${id} `, id.replaceAll('-', '%2D'), fake.sandboxes.get(id)!.name]) {
      await expect(provider.stop(ctx('not-ids'), { providerLeaseId: notAnId })).rejects.toMatchObject({ kind: 'permanent', code: 'not_a_sandbox_id' });
    }
    expect(fake.calls.length).toBe(before);
  });

  it('an adapter type that is no own entry of snapshotsByAdapter (constructor, __proto__) gets the configured snapshot', async () => {
    const configured = createDaytonaProvider({ apiUrl: fake.http.url, apiKey: 'k', snapshot: 'operator-hardened', snapshotsByAdapter: { claude_local: 'claude-snap' } });
    for (const adapterType of ['constructor', 'toString', '__proto__']) {
      const c = ctx(`proto-${adapterType}`);
      const lease = await settled(() => configured.acquire(c, { runId: `proto-${adapterType}`, adapterType }));
      expect(fake.calls.find((call) => call.method === 'POST' && call.path === '/sandbox' && call.sandboxId === lease.providerLeaseId)?.body).toMatchObject({ snapshot: 'operator-hardened' });
    }
  });

  it('requireExpiry with an expiry less than a minute away is refused before anything is made', async () => {
    const before = fake.sandboxes.size;
    await expect(provider.acquire(ctx('soon'), { runId: 'soon', requestedExpiresAt: new Date(Date.now() + 30_000).toISOString(), requireExpiry: true })).rejects.toMatchObject({ code: 'expiry_unsupported' });
    expect(fake.sandboxes.size).toBe(before);
  });

  it('a probe says whether the service takes the key, and names no address', async () => {
    const good = await provider.probe!(ctx('probe'));
    expect(good).toMatchObject({ ok: true, code: 'ok' });
    expect(good.message).not.toMatch(/127\.0\.0\.1|localhost/);
    expect(await createDaytonaProvider({ apiUrl: fake.http.url, apiKey: 'wrong' }).probe!(ctx('probe'))).toMatchObject({ ok: false, code: 'unauthorized' });
  });

  it('a lost sandbox resumes as expired and destroys as already gone', async () => {
    const id = await fresh('lost');
    fake.control(id, { lost: true });
    expect(await provider.resume(ctx('lost'), { providerLeaseId: id, leaseMetadata: {} })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
    expect(await provider.destroy(ctx('lost'), { providerLeaseId: id })).toEqual({ providerLeaseId: id, state: 'destroyed' });
  });
});
