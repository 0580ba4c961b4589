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

    it('treats a sandbox of another environment as one that does not exist: expired on resume, gone on stop, and leaves it running', async (t) => {
      if (!s.verifiesOwnership) return t.skip();
      const { providerLeaseId } = await acquire('m1');
      expect(await s.provider.resume(ctx('m1', 'env-b'), { providerLeaseId, leaseMetadata: {} })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
      const missing = await s.provider.stop(ctx('m1', 'env-b'), { providerLeaseId: 'no-such-sandbox' }).then((r) => r, (e: unknown) => e);
      const foreign = await s.provider.stop(ctx('m1', 'env-b'), { providerLeaseId }).then((r) => r, (e: unknown) => e);
      expect(JSON.stringify(foreign).replaceAll(providerLeaseId, 'X')).toBe(JSON.stringify(missing).replaceAll('no-such-sandbox', 'X'));
      expect((await s.provider.status(ctx('m1'), { providerLeaseId })).kind).toBe('running');
      // Nor can another environment force it, destroy it, or release it destroying it.
      const other = ctx('m1', 'env-b');
      await s.provider.forceStop(other, { providerLeaseId }).catch(() => undefined);
      await s.provider.destroy(other, { providerLeaseId }).catch(() => undefined);
      await s.provider.release(other, { providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition: 'destroy' }).catch(() => undefined);
      expect((await s.provider.status(ctx('m1'), { providerLeaseId })).kind).toBe('running');
    });

    it('releases with each disposition', async () => {
      const keep = await acquire('rel-keep');
      expect(await settled(() => s.provider.release(ctx('rel-keep'), { providerLeaseId: keep.providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition: 'keep_running' }))).toMatchObject({ state: 'running' });
      expect((await s.provider.status(ctx('rel-keep'), keep)).kind).toBe('running');

      const retain = await acquire('rel-retain');
      expect(await settled(() => s.provider.release(ctx('rel-retain'), { providerLeaseId: retain.providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition: 'stop_and_retain' }))).toMatchObject({ state: 'stopped' });
      expect((await s.provider.status(ctx('rel-retain'), retain)).kind).toBe('stopped');

      const gone = await acquire('rel-destroy');
      expect(await settled(() => s.provider.release(ctx('rel-destroy'), { providerLeaseId: gone.providerLeaseId, leaseMetadata: {}, cancelActiveWork: false, resourceDisposition: 'destroy' }))).toMatchObject({ state: 'destroyed' });
      expect(await s.provider.status(ctx('rel-destroy'), gone)).toEqual({ kind: 'gone' });
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

    it('raises transient errors for 429 (with Retry-After) and 5xx', async (t) => {
      if (!s.inject) return t.skip();
      const { providerLeaseId } = await acquire('e1');
      s.inject(providerLeaseId, 429, 3);
      const limited = await s.provider.status(ctx('e1'), { providerLeaseId }).catch((e: unknown) => e);
      expect(limited).toBeInstanceOf(TransientError);
      expect((limited as TransientError).retryAfterMs).toBe(3_000);
      s.inject(providerLeaseId, 503);
      await expect(s.provider.stop(ctx('e1'), { providerLeaseId })).rejects.toBeInstanceOf(TransientError);
    });

    it('tells a refusal for this account (403: a quota, a permission) from bad credentials', async (t) => {
      if (!s.inject) return t.skip();
      const c = ctx('q1');
      const { providerLeaseId } = await settled(() => s.provider.acquire(c, { runId: 'r' }));
      s.inject(providerLeaseId, 403);
      await expect(s.provider.stop(ctx('q1'), { providerLeaseId })).rejects.toMatchObject({ kind: 'permanent', code: 'forbidden' });
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

describe('the README', () => {
  it('shows the example provider exactly as the contract tests run it', async () => {
    const { readFile } = await import('node:fs/promises');
    const readme = await readFile(new URL('../README.md', import.meta.url), 'utf8');
    const example = await readFile(new URL('../examples/memory-provider.ts', import.meta.url), 'utf8');
    expect(readme).toContain(example);
  });
});

describe('Daytona specifics', () => {
  let fake: DaytonaFake;
  let provider: LeaseProvider;
  beforeAll(async () => {
    fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 20, stop: 20, forceStop: 0, destroy: 10 } });
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

  it('a lost sandbox resumes as expired and destroys as already gone', async () => {
    const id = await fresh('lost');
    fake.control(id, { lost: true });
    expect(await provider.resume(ctx('lost'), { providerLeaseId: id, leaseMetadata: {} })).toEqual({ providerLeaseId: null, metadata: { expired: true } });
    expect(await provider.destroy(ctx('lost'), { providerLeaseId: id })).toEqual({ providerLeaseId: id, state: 'destroyed' });
  });
});
