import { randomBytes } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { ExecError, LeaseClosingError } from '../src/errors.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { InstanceProviders } from '../src/providers/instances/resolver.ts';
import { MasterKeys } from '../src/providers/instances/sealing.ts';
import { ProviderInstanceStore } from '../src/providers/instances/store.ts';
import { localRateLimiters } from '../src/providers/pacing.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { execQueueName, MAX_EXEC_OUTPUT_CHARS } from '../src/queues/exec-jobs.ts';
import { existsSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startTestApi } from './helpers/api-server.ts';
import { startApiServer } from '../src/api/server.ts';
import { loadConfig } from '../src/config.ts';
import { createLogger } from '../src/logger.ts';
import { readUntil, TestBed, type Finished } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';
import { serverFor } from './helpers/redis-process.ts';

// Issue 25 part 2: commands in a sandbox, bracketed by an activity gate, on the simulated
// cloud's toolbox (real processes). Seed 000 with a command that ignores its cancel for a while.

const lease = (leaseId: string) => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });

const TOKENS = { co: 'exec-co-token-0123456789abc', other: 'exec-other-token-0123456789' };

/**
 * A bed, a Daytona fake that runs commands on this machine, a worker and a client, closed when
 * the test ends (or by `close`, which a test may call first): the client, the cloud (its
 * commands end, so the worker's close does not wait for them), then the bed.
 */
async function setUp(finished: Finished, opts: { workerKeys?: boolean; env?: Record<string, string> } = {}) {
  const bed = await TestBed.create({ ...opts.env, LEASE_OPS_KEEP_COMPLETED_S: '600', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKENS.co, companyId: 'co' }, { token: TOKENS.other, companyId: 'other' }]) });
  const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 50, stop: 50, forceStop: 0, destroy: 10 }, execOnThisMachine: true });
  let client: LeaseOpsClient | undefined;
  let closing: Promise<void> | undefined;
  const close = () =>
    (closing ??= (async () => {
      await client?.close();
      await fake.close();
      await bed.close();
    })());
  finished(close);
  const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
  const registry = new ProviderRegistry([createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'k', rateLimits: unpaced })]);
  const keys = new MasterKeys(randomBytes(32));
  // The workers' master key, as a worker process holds it with its provider registry.
  if (opts.workerKeys !== false) registry.instances = new InstanceProviders(new ProviderInstanceStore(bed.redis, bed.config.LEASE_OPS_PREFIX, { keys, allowedApiUrls: [] }), { rateLimiters: localRateLimiters }, []);
  await bed.startWorkerWith(registry);
  client = new LeaseOpsClient(bed.config, { masterKeys: keys });
  const acquired = await client.enqueueAndWait('acquire', lease('run'), { runId: 'run' }, { waitMs: 10_000 });
  const id = (acquired.operation.result as { providerLeaseId: string }).providerLeaseId;
  return { bed, fake, client, id, keys, close };
}

// The tests mostly wait (on commands, timeouts and lifecycles), each with a bed, cloud and worker of its own: they run at once.
describe.concurrent('exec: commands in a sandbox', () => {
  it('a simulated cloud runs no commands unless told to (LEASE_OPS_SIMULATED_EXEC=true): they would run on its machine', async () => {
    const off = new DaytonaFake({ apiKey: 'k' });
    const url = await off.listen();
    try {
      const created = (await (await fetch(`${url}/sandbox`, { method: 'POST', headers: { authorization: 'Bearer k', 'content-type': 'application/json' }, body: '{}' })).json()) as { id: string };
      const res = await fetch(`${url}/toolbox/${created.id}/process/session`, { method: 'POST', headers: { authorization: 'Bearer k', 'content-type': 'application/json' }, body: JSON.stringify({ sessionId: 's' }) });
      expect(res.status).toBe(403);
    } finally {
      await off.close();
    }
  });

  it('runs a command and answers its exit code and output; env and stdin reach it, and never Redis in plaintext', async ({ onTestFinished }) => {
    const { bed, client, id } = await setUp(onTestFinished);
    expect(await client.exec(lease(id), { providerLeaseId: id, command: 'echo out; echo err >&2; exit 3' })).toEqual({ exitCode: 3, signal: null, timedOut: false, cancelled: false, stdout: 'out\n', stderr: 'err\n' });
    expect(await client.exec(lease(id), { providerLeaseId: id, command: 'printf', args: ['%s|%s', 'a b', "it's"] })).toMatchObject({ exitCode: 0, stdout: "a b|it's" });

    const secret = `s3cret-${randomBytes(8).toString('hex')}`;
    const running = client.exec(lease(id), { providerLeaseId: id, command: 'sleep 0.3; printf "%s:" "$GREETING"; cat', env: { GREETING: secret }, stdin: 'piped in' });
    // While it runs, its job is in Redis: no plaintext of the env or stdin in it.
    const queue = execQueueName(bed.config.LEASE_OPS_QUEUE);
    let seen = '';
    await readUntil(async () => {
      // The jobs' hashes only (their locks and logs share the prefix).
      const keys = (await bed.redis.keys(`${bed.config.LEASE_OPS_PREFIX}:${queue}:exec.*`)).filter((k) => /:exec\.[^:]+$/.test(k));
      seen = (await Promise.all(keys.map((k) => bed.redis.hget(k, 'data')))).join('');
      return seen.length > 0;
    }, 5_000, 'the exec job in Redis');
    expect(seen).not.toContain(secret);
    expect(seen).not.toContain('piped in');
    expect(await running).toMatchObject({ exitCode: 0, stdout: `${secret}:piped in` });
  });

  it("with a second worker that serves another provider only, every command and every probe reaches a worker that serves its provider (helper-57: that worker answered a third of them unknown_provider)", async ({ onTestFinished }) => {
    const { bed, client, id } = await setUp(onTestFinished);
    await bed.startWorker(createRecordingProvider({ name: 'other' }).provider);
    const ran = await Promise.all(Array.from({ length: 12 }, (_, i) => client.exec(lease(id), { providerLeaseId: id, command: 'echo', args: [String(i)] }).then((r) => r.stdout, (err: Error) => `${(err as { code?: string }).code ?? ''}: ${err.message}`)));
    expect(ran).toEqual(Array.from({ length: 12 }, (_, i) => `${i}\n`));
    // Probes of either worker's provider, each its own (a company of its own: not shared).
    const probes = await Promise.all(Array.from({ length: 12 }, (_, i) => client.probeProvider({ provider: i % 2 ? 'daytona' : 'other', companyId: `probe-${i}` })));
    expect(probes.map((p) => [p.ok, p.code])).toEqual(Array.from({ length: 12 }, (_, i) => [true, i % 2 ? 'ok' : 'nothing_to_check']));
  });

  it('a command passed on by a worker that does not serve its provider waits for the one that does, busy past 3 s (helper-58: answered unknown_provider at 3 s)', async ({ onTestFinished }) => {
    const { bed, client, id } = await setUp(onTestFinished, { env: { LEASE_OPS_EXEC_CONCURRENCY: '1' } });
    await bed.startWorker(createRecordingProvider({ name: 'other' }).provider);
    const busy = client.exec(lease(id), { providerLeaseId: id, command: 'sleep 4; echo slept' });
    await readUntil(async () => (await bed.redis.keys(`${bed.config.LEASE_OPS_PREFIX}:${execQueueName(bed.config.LEASE_OPS_QUEUE)}:exec.*:lock`)).length > 0, 5_000, 'the first command running');
    expect(await client.exec(lease(id), { providerLeaseId: id, command: 'echo', args: ['after'] })).toMatchObject({ exitCode: 0, stdout: 'after\n' });
    expect(await busy).toMatchObject({ stdout: 'slept\n' });
  });

  it('times a command out (SIGTERM), and refuses one with env when the worker holds no master key', async ({ onTestFinished }) => {
    const { client, id } = await setUp(onTestFinished, { workerKeys: false });
    const started = Date.now();
    expect(await client.exec(lease(id), { providerLeaseId: id, command: 'sleep 30', timeoutMs: 300 })).toMatchObject({ timedOut: true, cancelled: false, exitCode: 143 });
    // Its timeout, not its 30 s of sleep (a loaded CI run took 5.1 s).
    expect(Date.now() - started).toBeLessThan(15_000);
    await expect(client.exec(lease(id), { providerLeaseId: id, command: 'true', env: { A: 'b' } })).rejects.toMatchObject({ code: 'secrets_key_missing' });
    await expect(client.exec(lease(id), { providerLeaseId: 'not-a-sandbox', command: 'true' })).rejects.toBeInstanceOf(ExecError);
  });

  it('seed 000: a command that ignores its cancel for a while, a release with cancelActiveWork and a resume at once: the stop reaches the cloud only after the command exited, and no one sees an error', async ({ onTestFinished }) => {
    const { bed, fake, client, id } = await setUp(onTestFinished);
    const exec = client.exec(lease(id), { providerLeaseId: id, command: "trap '' TERM; sleep 4; echo finished", ttlMs: 3_000 });
    await readUntil(async () => fake.toolbox.alive(id) === 1, 5_000, 'the command running');
    const release = await client.enqueue('release', lease(id), { providerLeaseId: id, resourceDisposition: 'stop_and_retain', cancelActiveWork: true });
    const resume = await client.enqueue('resume', lease(id), { providerLeaseId: id });
    // No new command begins while the release is queued.
    await expect(client.exec(lease(id), { providerLeaseId: id, command: 'true' })).rejects.toBeInstanceOf(LeaseClosingError);
    const result = await exec;
    // Asked to cancel, it ignored the SIGTERM and finished its work (the shell around it did
    // not ignore it: the exit code is its 143). It sleeps 4 s: the cancel reaches it within that
    // on a loaded machine too (with 1.5 s a CI run saw it finish first: not cancelled).
    expect(result).toMatchObject({ cancelled: true, timedOut: false, stdout: 'finished\n' });
    const results = await bed.waitForAll([release.jobId, resume.jobId], 20_000);
    expect([...results.values()]).toEqual(['completed', 'completed']);
    const firstStop = fake.calls.find((c) => c.sandboxId === id && c.path.endsWith('/stop'))!.start;
    const [exited] = fake.toolbox.exits(id).sort((a, b) => (a > b ? -1 : 1));
    expect(firstStop).toBeGreaterThan(exited!);
    expect(fake.toolbox.alive(id)).toBe(0);
    // The cloud never had to say "still settling cancelled work" to the resume.
    expect(fake.calls.filter((c) => c.sandboxId === id && c.path.endsWith('/start') && c.status === 409)).toEqual([]);
    expect(fake.stateOf(id)).toBe('started');
  });
});

describe.concurrent('exec over the HTTP API', () => {
  it("refuses an exec through a provider nobody serves, or one that is admin-only to a company's token (422 unknown_provider), as an enqueue is (helper-58: it went round the workers, and ran through the operator's provider)", async ({ onTestFinished }) => {
    // Daytona is the operator's alone here: a company's token may use no configured provider.
    const { bed, id, keys } = await setUp(onTestFinished, { env: { LEASE_OPS_SHARED_PROVIDERS: '' } });
    const api = await startTestApi(bed, undefined, { masterKeys: keys });
    try {
      const exec = (provider: string) =>
        fetch(`${api.base}/v1/leases/${provider}/co/env/${id}/exec`, { method: 'POST', headers: { authorization: `Bearer ${TOKENS.co}`, 'content-type': 'application/json' }, body: JSON.stringify({ providerLeaseId: id, command: 'id' }) });
      for (const provider of ['daytona', 'nosuch']) {
        const refused = await exec(provider);
        expect([provider, refused.status, ((await refused.json()) as { error: { code: string } }).error.code]).toEqual([provider, 422, 'unknown_provider']);
      }
      // Nothing was queued for a worker.
      expect(await bed.redis.keys(`${bed.config.LEASE_OPS_PREFIX}:${execQueueName(bed.config.LEASE_OPS_QUEUE)}:exec.*`)).toEqual([]);
    } finally {
      await api.close();
    }
  });

  it("answers how the command ended; another company's token finds nothing; refused with 409 lease_closing while a stop is queued", async ({ onTestFinished }) => {
    const { bed, client, id, keys } = await setUp(onTestFinished);
    const api = await startTestApi(bed, undefined, { masterKeys: keys });
    try {
      const exec = (token: string, company: string, body: unknown) =>
        fetch(`${api.base}/v1/leases/daytona/${company}/env/${id}/exec`, { method: 'POST', headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' }, body: JSON.stringify(body) });
      const ran = await exec(TOKENS.co, 'co', { providerLeaseId: id, command: 'cat; echo " $X"', stdin: 'in', env: { X: 'y' } });
      expect([ran.status, await ran.json()]).toEqual([200, { exitCode: 0, signal: null, timedOut: false, cancelled: false, stdout: 'in y\n', stderr: '' }]);
      expect((await exec(TOKENS.other, 'co', { providerLeaseId: id, command: 'true' })).status).toBe(404);
      const bad = await exec(TOKENS.co, 'co', { providerLeaseId: id, command: 'true', env: { 'NOT-A-NAME': 'x' } });
      expect(bad.status).toBe(400);
      const { token } = await client.beginActivity(lease(id), 'hold', 5_000);
      await client.enqueue('stop', lease(id), { providerLeaseId: id });
      const closing = await exec(TOKENS.co, 'co', { providerLeaseId: id, command: 'true' });
      expect(closing.status).toBe(409);
      expect(closing.headers.get('retry-after')).toMatch(/^\d+$/);
      expect(((await closing.json()) as { error: { code: string } }).error.code).toBe('lease_closing');
      await client.endActivity(token);
    } finally {
      await api.close();
    }
  });
});

describe.concurrent('exec, as an independent attack tried it (helper-5)', () => {
  it("refuses a sandbox that is not the path lease's own (it would run outside that lease's gate)", async ({ onTestFinished }) => {
    const { client, id } = await setUp(onTestFinished);
    await expect(client.exec(lease('phantom'), { providerLeaseId: id, command: 'true' })).rejects.toMatchObject({ code: 'not_the_lease_sandbox' });
    // By the id its acquire ran under, the lease is the same one: allowed.
    expect(await client.exec(lease('run'), { providerLeaseId: id, command: 'echo same' })).toMatchObject({ exitCode: 0, stdout: 'same\n' });
  });

  it('a command that waited for a worker past its ttlMs never runs (its gate may have let a stop through)', async ({ onTestFinished }) => {
    const { client, fake, id } = await setUp(onTestFinished, { env: { LEASE_OPS_EXEC_CONCURRENCY: '1' } });
    const marker = join(mkdtempSync(join(tmpdir(), 'lease-ops-exec-')), 'ran');
    const busy = client.exec(lease(id), { providerLeaseId: id, command: 'sleep 2.5' });
    await readUntil(async () => fake.toolbox.alive(id) === 1, 5_000, 'the first command running');
    await expect(client.exec(lease(id), { providerLeaseId: id, command: `echo ran > ${marker}`, ttlMs: 1_000 })).rejects.toMatchObject({ code: 'activity_lapsed' });
    expect(existsSync(marker)).toBe(false);
    expect(await busy).toMatchObject({ exitCode: 0 });
  });

  it('caps output at 1 MiB a stream, says how much was cut, and keeps no output in Redis after the answer (nor in the event stream)', async ({ onTestFinished }) => {
    const { bed, client, id } = await setUp(onTestFinished);
    const flood = await client.exec(lease(id), { providerLeaseId: id, command: "head -c 3000000 /dev/zero | tr '\\0' a; echo marker-out-123 >&2" });
    expect(flood.stdout.length).toBeLessThan(MAX_EXEC_OUTPUT_CHARS + 100);
    expect(flood.stdout).toMatch(/\[lease-ops: \d+ more characters cut\]$/);
    expect(flood.stderr).toBe('marker-out-123\n');
    const queue = execQueueName(bed.config.LEASE_OPS_QUEUE);
    const events = JSON.stringify(await bed.redis.xrange(`${bed.config.LEASE_OPS_PREFIX}:${queue}:events`, '-', '+'));
    expect(events).not.toContain('marker-out-123');
    expect(await bed.redis.keys(`${bed.config.LEASE_OPS_PREFIX}:exec-outcome:*`)).toEqual([]);
    // NUL can reach no shell: refused before anything runs.
    await expect(client.exec(lease(id), { providerLeaseId: id, command: 'true', env: { TOKEN: 'secret\u0000' } })).rejects.toMatchObject({ code: 'invalid_request' });
  });

  it('a caller that hangs up cancels its command', async ({ onTestFinished }) => {
    const { bed, fake, id, keys } = await setUp(onTestFinished);
    const api = await startTestApi(bed, undefined, { masterKeys: keys });
    try {
      const hangUp = new AbortController();
      const call = fetch(`${api.base}/v1/leases/daytona/co/env/${id}/exec`, { method: 'POST', signal: hangUp.signal, headers: { authorization: `Bearer ${TOKENS.co}`, 'content-type': 'application/json' }, body: JSON.stringify({ providerLeaseId: id, command: 'sleep 20' }) });
      call.catch(() => undefined);
      await readUntil(async () => fake.toolbox.alive(id) === 1, 5_000, 'the command running');
      hangUp.abort();
      await readUntil(async () => fake.toolbox.alive(id) === 0, 5_000, 'the command cancelled');
    } finally {
      await api.close();
    }
  });

  it("an API closing with a command running answers it 503 client_closed at its 2 s cut, and the command is cancelled (helper-38: cut unanswered, and the command ran on)", { timeout: 20_000 }, async ({ onTestFinished }) => {
    const { bed, fake, id } = await setUp(onTestFinished);
    const config = loadConfig({ REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_QUEUE: bed.config.LEASE_OPS_QUEUE, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKENS.co, companyId: 'co' }]) });
    const server = await startApiServer(config, createLogger({ level: 'silent' }));
    const call = fetch(`${server.url}/v1/leases/daytona/co/env/${id}/exec`, { method: 'POST', headers: { authorization: `Bearer ${TOKENS.co}`, 'content-type': 'application/json' }, body: JSON.stringify({ providerLeaseId: id, command: 'sleep 20' }) });
    await readUntil(async () => fake.toolbox.alive(id) === 1, 5_000, 'the command running');
    const closing = server.close();
    const res = await call;
    expect(res.status).toBe(503);
    expect(res.headers.get('connection')).toBe('close');
    expect(((await res.json()) as { error: { code: string } }).error.code).toBe('client_closed');
    await closing;
    await readUntil(async () => fake.toolbox.alive(id) === 0, 5_000, 'the command cancelled');
  });

  it("an API closing with a command running while Redis takes no writes answers 502 exec_cut, not a 503 to retry: it could not cancel the command (helper-39: told client_closed, and the command ran to its end)", { timeout: 30_000 }, async ({ onTestFinished }) => {
    // Stopped last, once the test's bed, cloud and worker closed (onTestFinished runs the last given first).
    const redis = await serverFor(onTestFinished);
    const { bed, fake, id } = await setUp(onTestFinished, { env: { REDIS_URL: redis.url } });
    const config = loadConfig({ REDIS_URL: redis.url, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_QUEUE: bed.config.LEASE_OPS_QUEUE, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKENS.co, companyId: 'co' }]) });
    const server = await startApiServer(config, createLogger({ level: 'silent' }));
    const call = fetch(`${server.url}/v1/leases/daytona/co/env/${id}/exec`, { method: 'POST', headers: { authorization: `Bearer ${TOKENS.co}`, 'content-type': 'application/json' }, body: JSON.stringify({ providerLeaseId: id, command: 'sleep 20' }) });
    await readUntil(async () => fake.toolbox.alive(id) === 1, 5_000, 'the command running');
    const closing = server.close();
    // Redis takes no writes past the close's 2 s cut: the activity's end cannot land.
    await bed.redis.client('PAUSE', 3_500, 'WRITE');
    const res = await call;
    const body = (await res.json()) as { error: { code: string } };
    expect([res.status, body.error.code, res.headers.get('connection')]).toEqual([502, 'exec_cut', 'close']);
    await closing;
  });

  it('the simulated cloud kills what a stopped sandbox still runs (a command that ignores SIGTERM does not outlive the stop)', async ({ onTestFinished }) => {
    const { client, fake, id } = await setUp(onTestFinished);
    const exec = client.exec(lease(id), { providerLeaseId: id, command: "trap '' TERM; sleep 30", timeoutMs: 60_000 });
    await readUntil(async () => fake.toolbox.alive(id) === 1, 5_000, 'the command running');
    // Straight at the cloud, as a stop lease-ops did not gate would (another control plane, say).
    const stopped = await fetch(`${fake.http.url}/sandbox/${id}/stop`, { method: 'POST', headers: { authorization: 'Bearer k' } });
    expect(stopped.status).toBe(200);
    await readUntil(async () => fake.toolbox.alive(id) === 0, 5_000, 'the command killed with its sandbox');
    expect(await exec).toMatchObject({ exitCode: null, signal: 'SIGKILL', stderr: expect.stringContaining('the sandbox stopped while the command ran') });
  });
});
