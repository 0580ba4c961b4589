import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { pluginManifestV1Schema } from '@paperclipai/shared';
import { assertEnvironmentEventOrder, assertLeaseLifecycle, createEnvironmentTestHarness, type EnvironmentTestHarness } from '@paperclipai/plugin-sdk/testing';
import type { PluginEnvironmentAcquireLeaseParams, PluginEnvironmentExecuteParams, PluginEnvironmentReleaseLeaseParams } from '@paperclipai/plugin-sdk';
import { randomBytes } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CreateosFake } from '../src/fakes/createos-fake.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { LeaseOpsClient } from '../src/client.ts';
import { laneIdOf } from '../src/lease.ts';
import { createLeaseOpsPlugin, DRIVER_KEY, manifest } from '../src/paperclip/index.ts';
import type { AcquireParams, ReleaseParams } from '../src/paperclip/driver.ts';
import { QUICK_RECOVERY, readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// lease-ops as a paperclip plugin, driven by paperclip's own SDK harness
// (@paperclipai/plugin-sdk/testing) against a real lease-ops: its API and two workers in their
// own processes, serving the simulated cloud, the Daytona fake and the CreateOS fake.

const BIN = fileURLToPath(new URL('../bin/lease-ops.js', import.meta.url));
const ADMIN = 'paperclip-admin-token-0123456789';
const COMPANIES = ['acme', 'globex', 'initech', 'umbrella'];
const tokenOf = (company: string) => `paperclip-${company}-token-0123456789`;
/** The deployment's master key: the host's execute env travels sealed with it. */
const SECRETS_KEY = randomBytes(32).toString('hex');

let bed: TestBed;
let daytona: DaytonaFake;
let createos: CreateosFake;
let simulated: DaytonaFake;
let api: ChildProcess;
let apiUrl: string;
const workers: WorkerProcess[] = [];

function startWorker(): WorkerProcess {
  const worker = new WorkerProcess(
    workerEnv(bed, {
      ...QUICK_RECOVERY,
      LEASE_OPS_PROVIDERS: 'simulated,daytona,createos',
      LEASE_OPS_SIMULATED_URL: simulated.http.url,
      DAYTONA_API_URL: daytona.http.url,
      DAYTONA_API_KEY: 'dk',
      DAYTONA_RATE_LIMITS: JSON.stringify({ 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null }),
      CREATEOS_API_URL: createos.http.url,
      CREATEOS_API_KEY: 'ck',
      CREATEOS_REQUESTS_PER_MINUTE: '60000',
      LEASE_OPS_CONCURRENCY: '50',
      // The host's graceful stop budget: a stop still stopping after it is forced.
      LEASE_OPS_STUCK_STOPPING_MS: '30000',
      LEASE_OPS_WATCHDOG_INTERVAL_MS: '1000',
      LEASE_OPS_SECRETS_KEY: SECRETS_KEY,
      LEASE_OPS_SIMULATED_EXEC: 'true',
    }),
  );
  workers.push(worker);
  return worker;
}

beforeAll(async () => {
  const tokens = [{ token: ADMIN }, ...COMPANIES.map((companyId) => ({ token: tokenOf(companyId), companyId }))];
  bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify(tokens) });
  daytona = new DaytonaFake({ apiKey: 'dk', timings: { create: 50, start: 300, stop: 300, forceStop: 0, destroy: 50, archive: 50 }, execOnThisMachine: true });
  createos = new CreateosFake({ apiKey: 'ck', timings: { create: 50, pause: 300, resume: 300, destroy: 50 } });
  simulated = new DaytonaFake({ apiKey: 'simulated-cloud-key', timings: { create: 50, start: 200, stop: 200, forceStop: 0, destroy: 50 }, execOnThisMachine: true });
  await Promise.all([daytona.listen(), createos.listen(), simulated.listen()]);
  api = spawn(process.execPath, [BIN, 'api'], {
    env: { ...process.env, REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_API_TOKENS: JSON.stringify(tokens), LEASE_OPS_API_PORT: '0', LEASE_OPS_LOG_LEVEL: 'warn', LEASE_OPS_SECRETS_KEY: SECRETS_KEY },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  apiUrl = await new Promise<string>((resolve, reject) => {
    createInterface({ input: api.stdout! }).on('line', (line) => {
      const m = /lease-ops API on (http:\/\/\S+)\/v1/.exec(line);
      if (m) resolve(m[1]!);
    });
    api.once('exit', (code) => reject(new Error(`the API exited (${code})`)));
  });
  await Promise.all([startWorker().ready, startWorker().ready]);
}, 60_000);

afterAll(async () => {
  await Promise.all(workers.map((w) => w.terminate().catch(() => w.kill())));
  if (api && api.exitCode === null) {
    api.kill('SIGTERM');
    await once(api, 'exit');
  }
  await Promise.all([daytona?.close(), createos?.close(), simulated?.close()]);
  await bed?.close();
});

/** One paperclip environment of one company, with the plugin as its driver, under paperclip's harness. */
function environment(company: string, environmentId: string, provider: string, extra: Record<string, unknown> = {}, client?: LeaseOpsClient) {
  const plugin = createLeaseOpsPlugin(client ? { client } : {});
  const d = plugin.definition;
  const harness: EnvironmentTestHarness = createEnvironmentTestHarness({
    manifest,
    environmentDriver: {
      driverKey: DRIVER_KEY,
      onValidateConfig: d.onEnvironmentValidateConfig,
      onProbe: d.onEnvironmentProbe,
      onAcquireLease: d.onEnvironmentAcquireLease,
      onResumeLease: d.onEnvironmentResumeLease,
      onReleaseLease: d.onEnvironmentReleaseLease,
      onDestroyLease: d.onEnvironmentDestroyLease,
      onExecute: d.onEnvironmentExecute,
    },
  });
  const config = { leaseOpsUrl: apiUrl, token: tokenOf(company), provider, reuseLease: true, ...extra };
  const base = { driverKey: DRIVER_KEY, companyId: company, environmentId, config };
  return {
    harness,
    config,
    base,
    acquire: (runId: string, more: Partial<AcquireParams> = {}) => harness.acquireLease({ ...base, runId, ...more } as PluginEnvironmentAcquireLeaseParams),
    resume: (providerLeaseId: string, leaseMetadata: Record<string, unknown> = {}) => harness.resumeLease({ ...base, providerLeaseId, leaseMetadata }),
    release: (providerLeaseId: string, more: Partial<ReleaseParams> = {}) => harness.releaseLease({ ...base, providerLeaseId, ...more } as PluginEnvironmentReleaseLeaseParams) as Promise<unknown>,
    destroy: (providerLeaseId: string) => harness.destroyLease({ ...base, providerLeaseId }) as Promise<unknown>,
    execute: (providerLeaseId: string, command: string, more: Record<string, unknown> = {}) => harness.execute({ ...base, lease: { providerLeaseId }, command, ...more } as PluginEnvironmentExecuteParams),
  };
}

describe('the plugin, as paperclip sees it', () => {
  it("its manifest passes paperclip's own manifest validator, with one sandbox_provider driver", () => {
    const parsed = pluginManifestV1Schema.safeParse(manifest);
    expect(parsed.success, JSON.stringify(parsed.error?.issues)).toBe(true);
    expect(manifest.environmentDrivers).toEqual([expect.objectContaining({ driverKey: DRIVER_KEY, kind: 'sandbox_provider' })]);
  });

  it('refuses a config with no provider or a bad URL, and one naming a provider lease-ops does not serve; warns of unknown keys', async () => {
    const env = environment('acme', 'cfg', 'simulated');
    expect(await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: env.config })).toMatchObject({ ok: true, warnings: [] });
    expect((await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: { ...env.config, provider: undefined } })).ok).toBe(false);
    expect((await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: { ...env.config, leaseOpsUrl: 'ftp://x' } })).ok).toBe(false);
    expect(await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: { ...env.config, provider: 'daytonna' } })).toMatchObject({ ok: false, errors: [expect.stringMatching(/daytonna/)] });
    expect(await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: { ...env.config, token: 'paperclip-nobody-token-0123456789' } })).toMatchObject({ ok: false, errors: [expect.stringMatching(/^token: /)] });
    expect((await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: { ...env.config, image: 'x' } })).warnings).toEqual(['image: not a lease-ops setting (ignored)']);
  });
});

describe.concurrent('lease lifecycles through the plugin hooks, with paperclip\'s harness against a real lease-ops', () => {
  for (const provider of ['simulated', 'daytona', 'createos']) {
    it(`${provider}: validateConfig, probe, acquire, resume, release (a receipt), resume, destroy (a receipt)`, { timeout: 60_000 }, async () => {
      const env = environment('acme', `life-${provider}`, provider);
      expect((await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: env.config })).ok).toBe(true);
      const probe = await env.harness.probe(env.base);
      expect(probe).toMatchObject({ ok: true, metadata: { provider, capabilities: expect.any(Object) } });
      const lease = await env.acquire(`run-${provider}`, { agentId: 'agent-1', adapterType: 'claude_local', requestedExpiresAt: new Date(Date.now() + 3_600_000).toISOString() });
      expect(lease.providerLeaseId).toMatch(/\S/);
      // Daytona (and the simulated cloud, a Daytona) bound the sandbox; CreateOS cannot, and says so with no expiry.
      if (provider === 'createos') expect(lease.expiresAt).toBeNull();
      else expect(Date.parse(lease.expiresAt!)).toBeLessThanOrEqual(Date.now() + 3_600_000);
      const id = lease.providerLeaseId!;
      const resumed = await env.resume(id, { ...lease.metadata, hostKept: 'yes' });
      expect(resumed).toMatchObject({ providerLeaseId: id, metadata: { hostKept: 'yes' } });
      expect(await env.release(id)).toEqual({ providerLeaseId: id, state: 'stopped' });
      expect((await env.resume(id, resumed.metadata)).providerLeaseId).toBe(id);
      expect(await env.destroy(id)).toEqual({ providerLeaseId: id, state: 'destroyed' });
      assertLeaseLifecycle(env.harness.environmentEvents, `life-${provider}`);
      assertEnvironmentEventOrder(env.harness.environmentEvents, ['validateConfig', 'probe', 'acquireLease', 'resumeLease', 'releaseLease', 'resumeLease', 'destroyLease']);
      expect(env.harness.environmentEvents.filter((e) => e.error)).toEqual([]);
    });
  }

  it('seed 000: a resume called while the previous stop still settles (the cloud answers "still settling cancelled work") ends running, with no error to the host', { timeout: 60_000 }, async () => {
    const env = environment('acme', 'seed-000', 'daytona');
    const { providerLeaseId: id } = await env.acquire('run-000');
    daytona.control(id!, { conflictUntil: { at: Date.now() + 1_500, message: 'The stopped Daytona sandbox is still settling cancelled work. Retry shortly.' } });
    const released = env.release(id!);
    await readUntil(async () => daytona.calls.some((c) => c.sandboxId === id && c.path.endsWith('/stop')), 10_000, 'the stop reaching the cloud');
    const resumed = await env.resume(id!);
    expect(resumed.providerLeaseId).toBe(id);
    expect(await released).toEqual({ providerLeaseId: id, state: 'stopped' });
    expect(daytona.stateOf(id!)).toBe('started');
    expect(env.harness.environmentEvents.filter((e) => e.error)).toEqual([]);
  });

  it("execute: the host's command runs in the sandbox (its env, stdin, exit code and output), bracketed by an activity", { timeout: 60_000 }, async () => {
    const env = environment('acme', 'exec', 'simulated');
    const { providerLeaseId: id } = await env.acquire('run-exec');
    expect(await env.execute(id!, 'printf "%s/" "$GREETING"; cat; exit 2', { env: { GREETING: 'hi' }, stdin: 'piped', timeoutMs: 10_000 })).toEqual({ exitCode: 2, signal: null, timedOut: false, stdout: 'hi/piped', stderr: '', metadata: { cancelled: false } });
    expect(await env.execute(id!, 'printf', { args: ['%s', "it's quoted"] })).toMatchObject({ exitCode: 0, stdout: "it's quoted" });
    expect(env.harness.environmentEvents.filter((e) => e.error)).toEqual([]);
  });

  it('seed 000 as it happened: an execute whose command ignores its cancel, then a release with cancelActiveWork and a resume at once: both end, no error to the host, and the stop waits for the command', { timeout: 60_000 }, async () => {
    const env = environment('acme', 'seed-000-exec', 'daytona');
    const { providerLeaseId: id } = await env.acquire('run-000-exec');
    const executed = env.execute(id!, "trap '' TERM; sleep 1.5; echo done", { timeoutMs: 30_000 });
    await readUntil(async () => daytona.toolbox.alive(id!) === 1, 10_000, 'the command running in the sandbox');
    const released = env.release(id!, { cancelActiveWork: true, resourceDisposition: 'stop_and_retain' });
    const resumed = env.resume(id!);
    expect(await executed).toMatchObject({ timedOut: false, stdout: 'done\n', metadata: { cancelled: true } });
    expect(await released).toEqual({ providerLeaseId: id, state: 'stopped' });
    expect((await resumed).providerLeaseId).toBe(id);
    const [exited] = daytona.toolbox.exits(id!);
    const stop = daytona.calls.find((c) => c.sandboxId === id && c.path.endsWith('/stop'))!;
    expect(stop.start).toBeGreaterThan(exited!);
    expect(daytona.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/start') && c.status === 409)).toEqual([]);
    expect(env.harness.environmentEvents.filter((e) => e.error)).toEqual([]);
  });

  it("seed 002: a resume called while a release's clean-up (CreateOS' pause) runs ends running, with no error to the host", { timeout: 60_000 }, async () => {
    const env = environment('acme', 'seed-002', 'createos');
    const { providerLeaseId: id } = await env.acquire('run-002');
    createos.control(id!, { pauseMs: 1_500 });
    const released = env.release(id!);
    await readUntil(async () => createos.statusOf(id!) === 'pausing', 10_000, 'the pause under way');
    const resumed = await env.resume(id!);
    expect(resumed.providerLeaseId).toBe(id);
    expect(await released).toEqual({ providerLeaseId: id, state: 'stopped' });
    expect(createos.statusOf(id!)).toBe('running');
    expect(env.harness.environmentEvents.filter((e) => e.error)).toEqual([]);
  });

  it('seed 001: with a stop whose process ignores SIGTERM, the resume hook returns within 33 s of its call, running', { timeout: 60_000 }, async () => {
    const env = environment('acme', 'seed-001', 'daytona');
    const { providerLeaseId: id } = await env.acquire('run-001');
    daytona.control(id!, { stuckStoppingMs: 30 * 60_000 });
    const released = env.release(id!);
    await readUntil(async () => daytona.stateOf(id!) === 'stopping', 10_000, 'the sandbox stopping');
    const called = Date.now();
    const resumed = await env.resume(id!);
    const took = Date.now() - called;
    expect(resumed.providerLeaseId).toBe(id);
    expect(took).toBeLessThan(33_000);
    expect(await released).toEqual({ providerLeaseId: id, state: 'stopped' });
    expect(daytona.calls.filter((c) => c.sandboxId === id && c.query.includes('force=true')).length).toBeGreaterThanOrEqual(1);
  });

  it('a sandbox deleted behind lease-ops\' back: resume answers expired (a result), release and destroy a receipt', { timeout: 60_000 }, async () => {
    const env = environment('acme', 'lost', 'daytona');
    const { providerLeaseId: id } = await env.acquire('run-lost');
    daytona.control(id!, { lost: true });
    expect(await env.resume(id!)).toEqual({ providerLeaseId: null, metadata: { expired: true } });
    expect(await env.release(id!)).toEqual({ providerLeaseId: id, state: 'destroyed' });
    expect(await env.destroy(id!)).toEqual({ providerLeaseId: id, state: 'destroyed' });
  });

  it('an acquire hook repeated after a host timeout (its expiry recomputed) joins the first: one sandbox', { timeout: 60_000 }, async () => {
    const env = environment('acme', 'repeat', 'daytona');
    const first = env.acquire('run-repeat', { requestedExpiresAt: new Date(Date.now() + 3_600_000).toISOString() });
    await readUntil(async () => daytona.calls.some((c) => c.method === 'POST' && c.path === '/sandbox' && (c.body as { labels?: Record<string, string> })?.labels?.['lease-ops/run'] === 'run-repeat'), 10_000, 'the create');
    const second = env.acquire('run-repeat', { requestedExpiresAt: new Date(Date.now() + 3_650_000).toISOString() });
    const [a, b] = await Promise.all([first, second]);
    expect(b.providerLeaseId).toBe(a.providerLeaseId);
    expect([...daytona.sandboxes.values()].filter((sb) => sb.labels['lease-ops/run'] === 'run-repeat')).toHaveLength(1);
  });

  it('4 companies x 2 environments in parallel, each with its own scoped token; no company reaches another\'s sandbox', { timeout: 60_000 }, async () => {
    const envs = COMPANIES.flatMap((company) => ['blue', 'green'].map((environmentId) => ({ company, environmentId, env: environment(company, environmentId, 'simulated') })));
    const leases = await Promise.all(
      envs.map(async ({ company, environmentId, env }) => {
        const lease = await env.acquire(`run-${company}-${environmentId}`);
        expect((await env.resume(lease.providerLeaseId!)).providerLeaseId).toBe(lease.providerLeaseId);
        return lease.providerLeaseId!;
      }),
    );
    // globex names acme's sandbox: under its own company it is refused, never stopped.
    const globex = envs.find((e) => e.company === 'globex' && e.environmentId === 'blue')!.env;
    const acmeSandbox = leases[0]!;
    await expect(globex.destroy(acmeSandbox)).rejects.toThrow(/lease_environment_mismatch/);
    await expect(globex.release(acmeSandbox)).rejects.toThrow(/lease_environment_mismatch/);
    // With acme's company in the hook but globex's token: the API does not let it near the lease.
    const spoofed = environment('globex', 'blue', 'simulated');
    await expect(spoofed.harness.destroyLease({ ...spoofed.base, companyId: 'acme', environmentId: 'blue', providerLeaseId: acmeSandbox })).rejects.toThrow(/lease_not_found/);
    expect(simulated.stateOf(acmeSandbox)).toBe('started');
    // Every environment ends its own lease with a receipt.
    await Promise.all(envs.map(async ({ env }, i) => expect(await env.destroy(leases[i]!)).toEqual({ providerLeaseId: leases[i], state: 'destroyed' })));
  });
});

// This and the next two blocks run beside the lifecycles above (seed 001 waits 30 s for a
// stuck stop to be forced): each works on leases and sandboxes of its own (a fault at the shared
// cloud is aimed at its own run's create). The worker kill runs alone, last.
describe.concurrent('in-process: the plugin on the typed client of a lease-ops in the host\'s own process', () => {
  it('runs the same lifecycle with no URL and no token', { timeout: 30_000 }, async () => {
    const client = new LeaseOpsClient(bed.config);
    try {
      const env = environment('acme', 'in-process', 'simulated', { leaseOpsUrl: undefined, token: undefined }, client);
      expect((await env.harness.validateConfig({ driverKey: DRIVER_KEY, config: env.config })).ok).toBe(true);
      expect((await env.harness.probe(env.base)).ok).toBe(true);
      const lease = await env.acquire('run-in-process');
      expect(await env.release(lease.providerLeaseId!)).toEqual({ providerLeaseId: lease.providerLeaseId, state: 'stopped' });
      expect(await env.destroy(lease.providerLeaseId!)).toEqual({ providerLeaseId: lease.providerLeaseId, state: 'destroyed' });
      assertLeaseLifecycle(env.harness.environmentEvents, 'in-process');
      expect(simulated.stateOf(lease.providerLeaseId!)).toBe('gone');
    } finally {
      await client.close();
    }
  });
});

describe.concurrent('activity gates across processes', () => {
  it('an activity begun over the API holds a release run by a worker process; a holder process SIGKILLed, the release goes on at its TTL', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const env = environment('acme', 'gates', 'daytona');
    const { providerLeaseId: id } = await env.acquire('run-gates');
    const api = (path: string, init: RequestInit, token = tokenOf('acme')) =>
      fetch(`${apiUrl}${path}`, { ...init, headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' } });
    const begun = await api(`/v1/leases/daytona/acme/gates/${id}/activities`, { method: 'POST', body: JSON.stringify({ kind: 'exec', ttlMs: 5_000 }) });
    expect(begun.status).toBe(201);
    const { token } = (await begun.json()) as { token: string };
    // Another company cannot see it, nor end it.
    expect((await api(`/v1/activities/${token}/heartbeat`, { method: 'POST', body: JSON.stringify({ ttlMs: 5_000 }) }, tokenOf('globex'))).status).toBe(404);
    // A holder in a process of its own: `lease-ops activity run` around a command that ignores SIGTERM.
    const holder = spawn(
      process.execPath,
      [BIN, 'activity', 'run', '--provider', 'daytona', '--company', 'acme', '--environment', 'gates', '--lease', id!, '--kind', 'exec', '--ttl-ms', '1500', '--', process.execPath, '-e', "process.on('SIGTERM', () => {}); setInterval(() => {}, 1000)"],
      { env: { ...process.env, REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX }, stdio: 'ignore', detached: true },
    );
    // Killed with its command if the test fails before it does (a failed run left it running).
    onTestFinished(() => {
      try {
        process.kill(-holder.pid!, 'SIGKILL');
      } catch {
        // Gone already (the test killed it).
      }
    });
    // The lease's lane is its acquire's.
    const lane = laneIdOf({ provider: 'daytona', companyId: 'acme', environmentId: 'gates', leaseId: 'run-gates' });
    const activities = async () => Object.keys(await bed.redis.hgetall(`${bed.config.LEASE_OPS_PREFIX}:activity:${lane}`)).filter((k) => !k.startsWith('~'));
    await readUntil(async () => (await activities()).length === 2, 10_000, 'the holder process begun');
    process.kill(-holder.pid!, 'SIGKILL');
    const killedAt = process.hrtime.bigint();
    expect((await api(`/v1/activities/${token}`, { method: 'DELETE' })).status).toBe(204);
    expect(await env.release(id!)).toEqual({ providerLeaseId: id, state: 'stopped' });
    // The dead holder's activity held the release until its TTL passed (1.5 s after its last heartbeat).
    const stoppedAt = daytona.calls.find((c) => c.sandboxId === id && c.path.endsWith('/stop'))!.start;
    expect(Number(stoppedAt - killedAt) / 1e6).toBeGreaterThanOrEqual(900);
  });
});

describe.concurrent('faults a host meets', () => {
  it('an acquire hook the host gives up on (its hookTimeoutMs) cancels the acquire: the sandbox it made is destroyed, and no other is made', { timeout: 60_000 }, async () => {
    // The hook gives up while the sandbox boots: 3 s leaves the acquire time to reach the cloud
    // on a loaded machine (with 1.5 s, a CI run's cancel once came before it started, and nothing
    // was made to clean up), and the boot outlasts it.
    // The acquire's own share of a hook's time is hookTimeoutMs - min(3 s, hookTimeoutMs / 4) - 1 s
    // (driver.ts: ABANDON_MS, ANSWER_MARGIN_MS): 1.25 s of 3 s, 5 s of 8 s.
    const env = environment('acme', 'abandoned', 'daytona', { hookTimeoutMs: 8_000 });
    // Its own create only: the lifecycles beside it create sandboxes on the same fake.
    daytona.failNextCreate({ kind: 'slow-boot', bootMs: 10_000 }, (body) => (body as { labels?: Record<string, string> }).labels?.['lease-ops/run'] === 'run-abandoned');
    const started = Date.now();
    await expect(env.acquire('run-abandoned')).rejects.toThrow(/^lease-ops: hook_timeout: /);
    // Within the hook's own time, its cancel included.
    expect(Date.now() - started).toBeLessThan(8_500);
    const made = () => [...daytona.sandboxes.values()].filter((sb) => sb.labels['lease-ops/run'] === 'run-abandoned');
    expect(made()).toHaveLength(1);
    await readUntil(async () => made().length === 1 && made().every((sb) => daytona.stateOf(sb.id) === 'gone'), 30_000, 'the clean-up destroying the sandbox');
    // The host asks again for the run: a new acquire, a new sandbox (the cancelled one is not joined).
    const again = await environment('acme', 'abandoned', 'daytona').acquire('run-abandoned');
    expect(daytona.stateOf(again.providerLeaseId!)).toBe('started');
    expect(made()).toHaveLength(2);
  });

  it('a hook whose lease-ops is down fails within its timeout with a message the host can show', async () => {
    const env = environment('acme', 'down', 'simulated', { leaseOpsUrl: 'http://127.0.0.1:9', hookTimeoutMs: 2_000 });
    const started = Date.now();
    await expect(env.acquire('run-down')).rejects.toThrow(/^lease-ops: unreachable: lease-ops at http:\/\/127\.0\.0\.1:9 did not answer/);
    expect(Date.now() - started).toBeLessThan(4_000);
    expect((await env.harness.probe(env.base)).ok).toBe(false);
  });

  it('bad input reaches the host as a distinct code: an unknown provider, a token of another company, a malformed expiry', async () => {
    await expect(environment('acme', 'bad', 'daytonna').acquire('run-bad')).rejects.toThrow(/^lease-ops: unknown_provider: /);
    const wrongToken = environment('acme', 'bad', 'simulated', { token: tokenOf('globex') });
    await expect(wrongToken.acquire('run-bad')).rejects.toThrow(/^lease-ops: lease_not_found: /);
    await expect(environment('acme', 'bad', 'simulated').acquire('run-bad', { requestedExpiresAt: 'tomorrow' })).rejects.toThrow(/^lease-ops: invalid_request: .*requestedExpiresAt/s);
  });
});

// Alone, after the rest: it kills every worker the others' hooks run on.
describe('faults a host meets: the workers die', () => {
  it('the workers SIGKILLed while an acquire hook waits (its create at the cloud): the hook still returns one running sandbox', { timeout: 60_000 }, async () => {
    const env = environment('acme', 'killed', 'daytona');
    const hook = env.acquire('run-killed');
    await readUntil(async () => daytona.calls.some((c) => c.method === 'POST' && c.path === '/sandbox' && (c.body as { labels?: Record<string, string> })?.labels?.['lease-ops/run'] === 'run-killed'), 10_000, 'the create');
    // Every worker that could hold the acquire dies; new ones take it over once its lock lapses.
    await Promise.all(workers.splice(0).map((w) => w.kill()));
    await Promise.all([startWorker().ready, startWorker().ready]);
    const lease = await hook;
    expect(daytona.stateOf(lease.providerLeaseId!)).toBe('started');
    expect([...daytona.sandboxes.values()].filter((sb) => sb.labels['lease-ops/run'] === 'run-killed')).toHaveLength(1);
  });
});
