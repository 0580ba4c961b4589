// Issue 12, secrets and the HTTP edge: each case failed on 42ab3f3.
import { execFile } from 'node:child_process';
import { once } from 'node:events';
import { createConnection, type Socket } from 'node:net';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterEach, describe, expect, it } from 'vitest';
import { TokenAuthority } from '../../src/api/auth.ts';
import { startApiServer } from '../../src/api/server.ts';
import { ConfigError, loadConfig } from '../../src/config.ts';
import { createLogger } from '../../src/logger.ts';
import { DaytonaFake } from '../../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../../src/providers/daytona/index.ts';
import { ProviderRegistry } from '../../src/providers/registry.ts';
import { LeaseWorker } from '../../src/queues/worker.ts';
import { serveWorkerMetrics } from '../../src/runtime.ts';
import { freePort } from '../../src/redis-server.ts';
import { redactQuery, withoutInfrastructure } from '../../src/secrets.ts';
import { startTestApi } from '../helpers/api-server.ts';
import { captureLog } from '../helpers/log-capture.ts';
import { spyCommands, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

const BIN = fileURLToPath(new URL('../../bin/lease-ops.js', import.meta.url));
const TOKEN = 'adm_0123456789-secret-token';
const PASSWORD = 'redis-pa55word-secret';

let bed: TestBed | undefined;
afterEach(async () => {
  await bed?.close();
  bed = undefined;
});

describe('issue 12, scenario 6: configuration errors name the variable and the problem, never a secret', () => {
  const messageOf = (env: Record<string, string>) => {
    try {
      loadConfig(env);
    } catch (err) {
      expect(err).toBeInstanceOf(ConfigError);
      return (err as Error).message;
    }
    throw new Error('the configuration was accepted');
  };

  it.each([
    ['a token list that is not JSON', { LEASE_OPS_API_TOKENS: `[{"token":"${TOKEN}"` }, 'LEASE_OPS_API_TOKENS', [TOKEN]],
    ['a token entry with a wrong field', { LEASE_OPS_API_TOKENS: `[{"token":"${TOKEN}","companyId":5},{"token":"short-${PASSWORD}"}]` }, 'LEASE_OPS_API_TOKENS', [TOKEN, PASSWORD]],
    ['a Redis URL of the wrong scheme', { REDIS_URL: `http://user:${PASSWORD}@redis.internal:6379` }, 'REDIS_URL', [PASSWORD]],
    ['a Redis URL that does not parse', { REDIS_URL: `redis://:${PASSWORD}@redis.internal:port` }, 'REDIS_URL', [PASSWORD]],
  ])('%s', (_what, env, variable, secrets) => {
    const message = messageOf(env);
    expect(message).toContain(variable);
    for (const secret of secrets) expect(message).not.toContain(secret);
  });

  it('`lease-ops api` with a malformed token list exits 2 naming the variable, and prints no token', async () => {
    const run = promisify(execFile)(process.execPath, [BIN, 'api'], {
      env: { ...process.env, LEASE_OPS_API_TOKENS: `[{"token":"${TOKEN}","companyId":5}]`, REDIS_URL: `redis://:${PASSWORD}@127.0.0.1:6379` },
    });
    const failed = (await run.then(
      () => {
        throw new Error('it started');
      },
      (err: unknown) => err,
    )) as { code: number; stdout: string; stderr: string };
    expect(failed.code).toBe(2);
    expect(failed.stderr).toContain('LEASE_OPS_API_TOKENS');
    expect(`${failed.stdout}${failed.stderr}`).not.toContain(TOKEN);
    expect(`${failed.stdout}${failed.stderr}`).not.toContain(PASSWORD);
  });
});

describe('issue 12, scenario 7: `lease-ops start` shows a token and a Redis password from the environment masked', () => {
  it('the admin token and the password appear nowhere in its output', { timeout: 60_000 }, async () => {
    const prefix = `{lo-test-start-masked-${process.pid}}`;
    // No Redis answers there: start says so (masked) and runs a private one.
    const port = await freePort();
    const { stdout, stderr } = await promisify(execFile)(process.execPath, [BIN, 'start', '--once'], {
      env: { ...process.env, REDIS_URL: `redis://:${PASSWORD}@127.0.0.1:${port}`, LEASE_OPS_PREFIX: prefix, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_TOKENS: TOKEN },
      timeout: 60_000,
    });
    expect(stdout).toMatch(/lifecycle done/);
    expect(stdout).toContain(`no Redis answered at redis://:***@127.0.0.1:${port}`);
    expect(stdout).toContain(`Bearer ${TOKEN.slice(0, 4)}***`);
    expect(`${stdout}${stderr}`).not.toContain(TOKEN);
    expect(`${stdout}${stderr}`).not.toContain(PASSWORD);
  });
});

describe('issue 12, scenarios 8 and 10: the request log and the Authorization header', () => {
  it('a token in the query string is masked in the request log', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const { lines, log } = captureLog();
    const api = await startTestApi(bed, log);
    try {
      for (const query of [`access_token=${TOKEN}`, `api_key=${TOKEN}&waitMs=0`, `token=${encodeURIComponent(TOKEN)}`]) {
        await (await fetch(`${api.base}/v1/overview?${query}`)).arrayBuffer();
      }
    } finally {
      await api.close();
    }
    const requests = lines.filter((l) => l.includes('/v1/overview'));
    expect(requests.length).toBeGreaterThanOrEqual(3);
    expect(requests.some((l) => l.includes('access_token=***'))).toBe(true);
    expect(lines.filter((l) => l.includes(TOKEN))).toEqual([]);
  });

  it("an activity's token in a route's path is masked in the request log (helper-18: logged in full)", async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const { lines, log } = captureLog();
    const api = await startTestApi(bed, log);
    const activity = 'act_0123456789abcdef0123456789abcdef';
    try {
      await (await fetch(`${api.base}/v1/activities/${activity}/heartbeat`, { method: 'POST', headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' }, body: '{}' })).arrayBuffer();
      await (await fetch(`${api.base}/v1/activities/${activity}`, { method: 'DELETE', headers: { authorization: `Bearer ${TOKEN}` } })).arrayBuffer();
    } finally {
      await api.close();
    }
    expect(lines.filter((l) => l.includes('/v1/activities/***'))).toHaveLength(2);
    expect(lines.filter((l) => l.includes(activity))).toEqual([]);
  });

  it('a credential followed by anything else does not authenticate', async () => {
    const authority = new TokenAuthority([{ token: TOKEN }]);
    const basic = (text: string) => `Basic ${Buffer.from(text).toString('base64')}`;
    // Accepted as they should be...
    expect(authority.authenticate(`Bearer ${TOKEN}`)).not.toBeNull();
    expect(authority.authenticate(`bearer ${TOKEN}`)).not.toBeNull();
    expect(authority.authenticate(basic(`me:${TOKEN}`))).not.toBeNull();
    // ...and nothing with junk after it, or around it.
    for (const header of [
      `Bearer ${TOKEN} junk`,
      `Bearer ${TOKEN}\tjunk`,
      `Bearer  ${TOKEN}`,
      ` Bearer ${TOKEN}`,
      `Bearer ${TOKEN} `,
      `${basic(`me:${TOKEN}`)} junk`,
      `${basic(`me:${TOKEN}`)}!!!`,
      `Basic ${Buffer.from(`me:${TOKEN}`).toString('base64')}$$`,
      `Basic ${Buffer.from(`me:${TOKEN}`).toString('base64').replace(/=+$/, '')}====`,
      `Token ${TOKEN}`,
      TOKEN,
    ]) {
      expect({ header, principal: authority.authenticate(header) }).toEqual({ header, principal: null });
    }
  });

  it('over HTTP: 401 for a Bearer or Basic credential with junk after it', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const api = await startTestApi(bed);
    try {
      const status = async (authorization: string) => (await fetch(`${api.base}/v1/overview`, { headers: { authorization } })).status;
      expect(await status(`Bearer ${TOKEN}`)).toBe(200);
      expect(await status(`Bearer ${TOKEN} junk`)).toBe(401);
      expect(await status(`Basic ${Buffer.from(`me:${TOKEN}`).toString('base64')} junk`)).toBe(401);
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenario 9: errors callers read carry no infrastructure', () => {
  it('an operation that could not reach its provider fails with a code and a message without the address', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const { lines, log } = captureLog();
    const unreachable = createDaytonaProvider({ name: 'daytona', apiUrl: 'http://127.0.0.1:9', apiKey: 'k', timeoutMs: 500 });
    const worker = new LeaseWorker(bed.config, new ProviderRegistry([unreachable]), log);
    await worker.start();
    const api = await startTestApi(bed);
    try {
      const lease = { provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId: 'l' };
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease, params: { providerLeaseId: 'l' }, deadlineMs: 800 });
      expect((await bed.waitForAll([jobId])).get(jobId)).toBe('failed');
      const view = (await (await fetch(`${api.base}/v1/operations/${jobId}`, { headers: { authorization: `Bearer ${TOKEN}` } })).json()) as { error: { code: string; message: string } };
      expect(view.error.code).toBe('deadline_exceeded');
      expect(view.error.message).toMatch(/could not be reached \(ECONNREFUSED\)/);
      expect(view.error.message).not.toMatch(/127\.0\.0\.1|:9\b/);
    } finally {
      await api.close();
      await worker.close();
    }
    // The operators' logs keep the detail.
    expect(lines.some((l) => l.includes('127.0.0.1:9'))).toBe(true);
  });

  it('addresses, URLs and server paths in any message are replaced', () => {
    expect(withoutInfrastructure('connect ECONNREFUSED 10.0.3.7:6379')).toBe('connect ECONNREFUSED <address>');
    expect(withoutInfrastructure('request to http://daytona.internal:3000/api/sandbox failed')).toBe('request to <url> failed');
    expect(withoutInfrastructure('connect ECONNREFUSED [::1]:8080')).toBe('connect ECONNREFUSED <address>');
    expect(withoutInfrastructure('at /srv/lease-ops/dist/queues/worker.js:120:7')).toBe('at <path>');
    expect(withoutInfrastructure('state_change_in_progress: sandbox is stopping')).toBe('state_change_in_progress: sandbox is stopping');
  });
});

describe('issue 12, scenario 11: slow clients are bounded', () => {
  /** A raw connection to the API, and when the server closed it (ms after it opened). */
  const connect = (url: string) => {
    const { hostname, port } = new URL(url);
    const socket = createConnection({ host: hostname, port: Number(port) });
    const opened = Date.now();
    const closed = new Promise<{ afterMs: number; reply: string }>((resolve) => {
      let reply = '';
      socket.on('data', (chunk) => (reply += String(chunk)));
      socket.on('error', () => undefined);
      socket.on('close', () => resolve({ afterMs: Date.now() - opened, reply }));
    });
    return { socket, closed, ready: once(socket, 'connect') };
  };
  /** Writes a little every 200 ms until the server closes the connection. */
  const trickle = (socket: Socket, bit: string) => {
    const timer = setInterval(() => socket.writable && socket.write(bit), 200);
    socket.on('close', () => clearInterval(timer));
  };

  it('a trickled header is cut at the headers timeout, a trickled body at the request timeout (408)', { timeout: 30_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_HEADERS_TIMEOUT_MS: '1500', LEASE_OPS_API_REQUEST_TIMEOUT_MS: '2500' });
    const api = await startApiServer(bed.config, createLogger({ level: 'silent' }));
    try {
      const headers = connect(api.url);
      await headers.ready;
      headers.socket.write('GET /healthz HTTP/1.1\r\nHost: x\r\n');
      trickle(headers.socket, 'X-Slow: a\r\n');
      const body = connect(api.url);
      await body.ready;
      body.socket.write(`POST /v1/leases/simulated/co/env/l/operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{`);
      trickle(body.socket, ' ');
      const [h, b] = await Promise.all([headers.closed, body.closed]);
      expect(h.afterMs).toBeGreaterThanOrEqual(1_500);
      expect(h.afterMs).toBeLessThan(1_500 + 2_500);
      expect(b.afterMs).toBeGreaterThanOrEqual(2_500);
      expect(b.afterMs).toBeLessThan(2_500 + 2_500);
      expect(b.reply).toMatch(/^HTTP\/1\.1 408/);
      expect(await bed.ops.queue.count()).toBe(0);
    } finally {
      await api.close();
    }
  });

  it('an idle keep-alive connection is closed at the keep-alive timeout after its last reply', { timeout: 30_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_KEEPALIVE_TIMEOUT_MS: '1200' });
    const api = await startApiServer(bed.config, createLogger({ level: 'silent' }));
    try {
      const idle = connect(api.url);
      await idle.ready;
      let repliedAt = 0;
      idle.socket.on('data', () => (repliedAt = Date.now()));
      idle.socket.write('GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n');
      const { reply } = await idle.closed;
      const closedAt = Date.now();
      expect(reply).toMatch(/^HTTP\/1\.1 200/);
      expect(reply).toMatch(/keep-alive: timeout=1/i);
      // Node closes it at the timeout (checked on its own timer, so a little later at most).
      expect(closedAt - repliedAt).toBeGreaterThanOrEqual(1_100);
      expect(closedAt - repliedAt).toBeLessThan(1_200 + 2_000);
    } finally {
      await api.close();
    }
  });

  it('connections past LEASE_OPS_API_MAX_CONNECTIONS, all with a request in progress, are closed as they arrive, and the API answers again once some close', { timeout: 30_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_MAX_CONNECTIONS: '3' });
    const api = await startApiServer(bed.config, createLogger({ level: 'silent' }));
    try {
      const held = [connect(api.url), connect(api.url), connect(api.url)];
      await Promise.all(held.map((c) => c.ready));
      // Each with a request in progress (its body still to come): none is closed for another.
      // (Idle ones are: test/neighbours.test.ts.) The server's 100 Continue says it took the request.
      await Promise.all(
        held.map((c) => {
          const continued = once(c.socket, 'data');
          c.socket.write(`POST /v1/leases/recording/acme/env/l1/operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n{`);
          return continued;
        }),
      );
      const extra = connect(api.url);
      const refused = await extra.closed;
      expect(refused.reply).toBe('');
      for (const c of held) c.socket.destroy();
      await Promise.all(held.map((c) => c.closed));
      expect((await fetch(`${api.url}/healthz`)).status).toBe(200);
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenario 15: /metrics can be kept to whoever holds its token', () => {
  const METRICS_TOKEN = 'metrics_0123456789-secret';
  it('with LEASE_OPS_METRICS_TOKEN the API and a worker answer 401 without it and 200 with it; open without it (the default)', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const open = await startTestApi(bed);
    try {
      expect((await fetch(`${open.base}/metrics`)).status).toBe(200);
    } finally {
      await open.close();
    }
    const port = await freePort();
    const config = { ...bed.config, LEASE_OPS_METRICS_TOKEN: METRICS_TOKEN, LEASE_OPS_METRICS_PORT: port };
    const api = await startTestApi({ ...bed, config } as TestBed);
    const worker = new LeaseWorker(config, new ProviderRegistry([]), createLogger({ level: 'silent' }));
    const metricsServer = await serveWorkerMetrics(config, worker, createLogger({ level: 'silent' }));
    try {
      for (const url of [`${api.base}/metrics`, `http://127.0.0.1:${port}/metrics`]) {
        expect((await fetch(url)).status).toBe(401);
        expect((await fetch(url, { headers: { authorization: `Bearer ${TOKEN}` } })).status).toBe(401);
        expect((await fetch(url, { headers: { authorization: `Bearer ${METRICS_TOKEN} x` } })).status).toBe(401);
        const res = await fetch(url, { headers: { authorization: `Bearer ${METRICS_TOKEN}` } });
        expect(res.status).toBe(200);
        expect(await res.text()).toMatch(/^# HELP /m);
      }
    } finally {
      metricsServer?.close();
      await api.close();
      await worker.close();
    }
  });
});

describe('issue 12, scenario 13: a read-write board takes changes only from its own pages', () => {
  it('a cross-site form post (text/plain, form-encoded) is refused and adds no job; the board\'s own JSON request goes through', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_BOARD_READ_ONLY: 'false' });
    const api = await startTestApi(bed);
    const basic = `Basic ${Buffer.from(`me:${TOKEN}`).toString('base64')}`;
    const add = `${api.base}/board/api/queues/${encodeURIComponent(bed.config.LEASE_OPS_QUEUE)}/add`;
    const job = JSON.stringify({ name: 'stop', data: { injected: true } });
    try {
      // What a page on another site can make a browser send, credentials included.
      const crossSite: Record<string, string>[] = [
        { origin: 'https://evil.example', 'sec-fetch-site': 'cross-site', 'content-type': 'text/plain' },
        { origin: 'https://evil.example', 'content-type': 'application/x-www-form-urlencoded' },
        { 'sec-fetch-site': 'cross-site', 'content-type': 'multipart/form-data; boundary=x' },
        { origin: 'null', 'content-type': 'text/plain' },
        { 'content-type': 'text/plain' },
      ];
      for (const headers of crossSite) {
        const res = await fetch(add, { method: 'POST', headers: { authorization: basic, ...headers }, body: job });
        expect({ headers, status: res.status }).toEqual({ headers, status: expect.toSatisfy((s: number) => s === 403 || s === 415) });
      }
      expect(await bed.ops.queue.count()).toBe(0);
      // The board's own page: same origin, JSON.
      const own = await fetch(add, {
        method: 'POST',
        headers: { authorization: basic, origin: api.base, 'sec-fetch-site': 'same-origin', 'content-type': 'application/json' },
        body: JSON.stringify({ name: 'stop', data: {} }),
      });
      expect(own.status).not.toBe(403);
      expect(own.status).not.toBe(415);
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenario 12: a provider no worker serves is refused at enqueue', () => {
  it('422 unknown_provider naming the ones served, and nothing written; a served one is accepted', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    await bed.startWorker(createRecordingProvider({ name: 'recording' }).provider);
    const api = await startTestApi(bed);
    try {
      const post = (provider: string) =>
        fetch(`${api.base}/v1/leases/${provider}/co/env/l/operations`, {
          method: 'POST',
          headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
          body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'l' } }),
        });
      const refused = await post('daytonna');
      expect(refused.status).toBe(422);
      expect(await refused.json()).toEqual({ error: { code: 'unknown_provider', message: 'no worker serves provider "daytonna", and company co has no provider instance of that name for environment env (served: recording)' } });
      expect(await bed.ops.queue.count()).toBe(0);
      expect((await post('recording')).status).toBe(202);
      // A served provider's next enqueue does not read the announced ones again (nothing takes
      // a name out); a name that read lacks is read again: one announced since is accepted at once.
      const { sent, restore } = spyCommands(api.client.ops.connection);
      try {
        expect((await post('recording')).status).toBe(202);
        expect(sent.filter((name) => name === 'hkeys')).toEqual([]);
        await bed.ops.announceProviders([{ name: 'daytonna', capabilities: { stop: true, pause: false, forceStop: true } }]);
        expect((await post('daytonna')).status).toBe(202);
        expect(sent.filter((name) => name === 'hkeys')).toEqual(['hkeys']);
      } finally {
        restore();
      }
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenario 2 (issue 24: no false receipts): a foreign sandbox is refused, never stopped, and nothing of it is learnt', () => {
  it("company B naming company A's sandbox under its own lease gets lease_environment_mismatch for every operation, learns nothing more, and A's sandbox runs on", async () => {
    const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 5, start: 5, stop: 5, forceStop: 0, destroy: 5 } });
    const apiUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    try {
      await bed.startWorker(createDaytonaProvider({ apiUrl, apiKey: 'k', rateLimits: { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null } }));
      const a = await bed.ops.enqueue({ op: 'acquire', lease: { provider: 'daytona', companyId: 'acme', environmentId: 'prod', leaseId: 'a-lease' }, params: { runId: 'r' } });
      expect((await bed.waitForAll([a.jobId])).get(a.jobId)).toBe('completed');
      const sandbox = ((await bed.ops.queue.getJob(a.jobId))!.returnvalue as { providerLeaseId: string }).providerLeaseId;
      const asB = (leaseId: string) => ({ provider: 'daytona', companyId: 'globex', environmentId: 'prod', leaseId });
      const target = { providerLeaseId: sandbox };
      const foreign = await Promise.all([
        bed.ops.enqueue({ op: 'stop', lease: asB(sandbox), params: target }),
        bed.ops.enqueue({ op: 'force-stop', lease: asB(sandbox), params: target }),
        bed.ops.enqueue({ op: 'release', lease: asB(sandbox), params: { ...target, resourceDisposition: 'destroy' } }),
        bed.ops.enqueue({ op: 'destroy', lease: asB(sandbox), params: target }),
      ]);
      const missing = await bed.ops.enqueue({ op: 'stop', lease: asB('no-such-sandbox'), params: { providerLeaseId: 'no-such-sandbox' } });
      const ended = await bed.waitForAll([...foreign.map((f) => f.jobId), missing.jobId]);
      for (const f of foreign) {
        expect(ended.get(f.jobId)).toBe('failed');
        const job = (await bed.ops.queue.getJob(f.jobId))!;
        expect(job.failedReason).toMatch(/^lease_environment_mismatch: /);
        expect(job.failedReason).not.toMatch(/acme|started|running/);
      }
      // A sandbox that is not there is gone: that one's stop has its receipt.
      expect(ended.get(missing.jobId)).toBe('completed');
      const api = await startTestApi(bed);
      try {
        const seen = await api.client.getLease(asB(sandbox));
        // Nothing of it was recorded: no observation, no state, no owner.
        expect(seen.observed).toBeNull();
        expect(JSON.stringify(seen)).not.toMatch(/acme|started/);
      } finally {
        await api.close();
      }
      expect(fake.stateOf(sandbox)).toBe('started');
      expect(fake.calls.filter((c) => c.sandboxId === sandbox && c.method !== 'GET' && c.path !== '/sandbox')).toEqual([]);
    } finally {
      await fake.close();
    }
  });
});

describe('issue 12, scenario 4: no company hides another\'s attention items', () => {
  it("company A's 1,600 failed leases leave company B's 3 in B's view, and A's token sees only A's", { timeout: 60_000 }, async () => {
    const B_TOKEN = 'globex_0123456789-scoped';
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKEN }, { token: B_TOKEN, companyId: 'globex' }]) });
    await bed.startWorker(createRecordingProvider({ name: 'recording', behaviour: () => 'permanent' }).provider);
    const stop = (companyId: string, leaseId: string) =>
      bed!.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId, environmentId: 'prod', leaseId }, params: { providerLeaseId: leaseId } });
    // B's first, so A's 1,600 come after them in every index.
    const b = await Promise.all(['b1', 'b2', 'b3'].map((id) => stop('globex', id)));
    await bed.waitForAll(b.map((x) => x.jobId));
    const a: string[] = [];
    for (let i = 0; i < 1_600; i += 200) a.push(...(await Promise.all(Array.from({ length: 200 }, (_, j) => stop('acme', `a${i + j}`)))).map((x) => x.jobId));
    await bed.waitForAll(a, 50_000);
    const api = await startTestApi(bed);
    try {
      const attention = async (token: string) =>
        ((await (await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${token}` } })).json()) as { items: { lease: { companyId: string; leaseId: string } }[] }).items;
      const seenByB = await attention(B_TOKEN);
      expect(seenByB.map((item) => item.lease.leaseId).sort()).toEqual(['b1', 'b2', 'b3']);
      const seenByAdmin = await attention(TOKEN);
      expect(seenByAdmin).toHaveLength(200); // a page
      // Paged, an admin walks every item once; B's last page says there is no next.
      const page = async (token: string, query: string) =>
        (await (await fetch(`${api.base}/v1/attention?${query}`, { headers: { authorization: `Bearer ${token}` } })).json()) as {
          items: { laneId: string; lease: { leaseId: string } }[];
          next: number | null;
        };
      const walked: string[] = [];
      for (let offset: number | null = 0; offset !== null; ) {
        const { items, next }: Awaited<ReturnType<typeof page>> = await page(TOKEN, `offset=${offset}&limit=500`);
        walked.push(...items.map((item) => item.laneId));
        offset = next;
      }
      expect(walked).toHaveLength(1_603);
      expect(new Set(walked).size).toBe(1_603);
      expect((await page(B_TOKEN, 'limit=2')).next).toBe(2);
      expect(await page(B_TOKEN, 'offset=2&limit=2')).toMatchObject({ next: null, items: [{}] });
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenario 14 (part): the OpenAPI document and the query integers', () => {
  it('waitMs takes decimal digits only (0x10, 1e3 and an empty value are 400), and the document names its server and license', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const api = await startTestApi(bed);
    try {
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'co', environmentId: 'env', leaseId: 'q' }, params: { providerLeaseId: 'q' } });
      const read = (query: string) => fetch(`${api.base}/v1/operations/${jobId}?${query}`, { headers: { authorization: `Bearer ${TOKEN}` } }).then((r) => r.status);
      expect(await read('waitMs=0')).toBe(200);
      expect(await read('waitMs=10')).toBe(200);
      for (const bad of ['waitMs=0x10', 'waitMs=1e3', 'waitMs=', 'waitMs=-1', 'waitMs=1.5']) expect({ bad, status: await read(bad) }).toEqual({ bad, status: 400 });
      const document = (await (await fetch(`${api.base}/v1/openapi.json`)).json()) as { servers?: unknown[]; info: { license?: { name: string } } };
      expect(document.servers?.length).toBeGreaterThan(0);
      expect(document.info.license?.name).toBe('MIT');
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenario 1: idempotency keys belong to one company and environment, and to one request', () => {
  it("staging reusing prod's key gets its own operation; `acme:eu`+`k9` and `acme`+`eu:k9` do not meet; another request under a used key is 422", async () => {
    const PROD = 'acme_0123456789-prod-token';
    const STAGING = 'acme_0123456789-staging-token';
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([
        { token: TOKEN },
        { token: PROD, companyId: 'acme', environmentIds: ['prod'] },
        { token: STAGING, companyId: 'acme', environmentIds: ['staging'] },
      ]),
    });
    const api = await startTestApi(bed);
    try {
      const post = async (token: string, companyId: string, environmentId: string, leaseId: string, key: string, op = 'stop') => {
        const res = await fetch(`${api.base}/v1/leases/recording/${encodeURIComponent(companyId)}/${environmentId}/${leaseId}/operations`, {
          method: 'POST',
          headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json', 'idempotency-key': key },
          body: JSON.stringify({ op, params: { providerLeaseId: leaseId } }),
        });
        return { status: res.status, body: (await res.json()) as { jobId?: string; laneId?: string; deduplicated?: string; error?: { code: string } } };
      };
      const prod = await post(PROD, 'acme', 'prod', 'sb-1', 'k9');
      const staging = await post(STAGING, 'acme', 'staging', 'sb-1', 'k9');
      expect([prod.status, staging.status]).toEqual([202, 202]);
      expect(staging.body.deduplicated).toBeUndefined();
      expect(staging.body.jobId).not.toBe(prod.body.jobId);
      expect((await bed.ops.queue.getJob(staging.body.jobId!))!.data.lease.environmentId).toBe('staging');

      const colon = await post(TOKEN, 'acme:eu', 'prod', 'sb-2', 'k9');
      const other = await post(TOKEN, 'acme', 'prod', 'sb-2', 'eu:k9');
      expect([colon.status, other.status]).toEqual([202, 202]);
      expect(other.body.jobId).not.toBe(colon.body.jobId);

      // The same request again: the same job, and the lane id that job is in.
      const again = await post(PROD, 'acme', 'prod', 'sb-1', 'k9');
      expect(again).toMatchObject({ status: 202, body: { jobId: prod.body.jobId, laneId: prod.body.laneId, deduplicated: 'idempotency-key' } });
      // Another request (lease, operation) under the used key: refused, nothing queued.
      const before = await bed.ops.queue.count();
      expect(await post(PROD, 'acme', 'prod', 'sb-9', 'k9')).toMatchObject({ status: 422, body: { error: { code: 'idempotency_key_reused' } } });
      expect(await post(PROD, 'acme', 'prod', 'sb-1', 'k9', 'destroy')).toMatchObject({ status: 422, body: { error: { code: 'idempotency_key_reused' } } });
      expect(await bed.ops.queue.count()).toBe(before);
    } finally {
      await api.close();
    }
  });
});

describe('issue 12, scenarios 6 and 8, what the attack on the change found', () => {
  it('the request log masks credentials in every form a target carries them', () => {
    expect(redactQuery('/v1/x?bearer=abc&jwt=e.y.z&x=1')).toBe('/v1/x?bearer=***&jwt=***&x=1');
    expect(redactQuery('/v1/x?x=1;access_token=abc')).toBe('/v1/x?x=1;access_token=***');
    expect(redactQuery('/v1/x?access%5Ftoken=abc&waitMs=10')).toBe('/v1/x?access%5Ftoken=***&waitMs=10');
    expect(redactQuery(`http://u:${TOKEN}@host/v1/x?a=1`)).not.toContain(TOKEN);
    // Only the API's own parameters keep their values, and only short ones or numbers.
    const shown = new Set(['limit', 'waitMs']);
    expect(redactQuery(`/v1/x?${TOKEN}`, shown)).toBe('/v1/x?***');
    expect(redactQuery(`/v1/x?x&t%3D${TOKEN}`, shown)).toBe('/v1/x?***&***');
    expect(redactQuery(`/v1/x?limit=${TOKEN}&waitMs=30000&limit=5`, shown)).toBe('/v1/x?limit=***&waitMs=30000&limit=5');
    // The path's `;` parameters by the same rule (helper-40: a long one the API reads was kept).
    expect(redactQuery(`/v1/attention;limit=${TOKEN}`, shown)).toBe('/v1/attention;limit=***');
    expect(redactQuery('/v1/x;limit=5/y;other=1', shown)).toBe('/v1/x;limit=5/y;other=***');
  });

  it('a Redis URL naming no database number, and a token listed twice, are configuration errors that print no secret', () => {
    const error = (env: Record<string, string>) => {
      try {
        loadConfig(env);
        return '';
      } catch (e) {
        expect(e).toBeInstanceOf(ConfigError);
        return (e as Error).message;
      }
    };
    const db = error({ REDIS_URL: `redis://:${PASSWORD}@127.0.0.1:6390/abc` });
    expect(db).toMatch(/REDIS_URL=.*names a database from 0 to 15/);
    expect(db).not.toContain(PASSWORD);
    expect(error({ REDIS_URL: 'redis://127.0.0.1:6379/2' })).toBe('');
    const twice = error({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKEN }, { token: TOKEN, companyId: 'acme' }]) });
    expect(twice).toMatch(/LEASE_OPS_API_TOKENS.*entries 1 and 2 hold the same token/);
    expect(twice).not.toContain(TOKEN);
  });
});

describe('issue 12, what the second attack on the change found', () => {
  it('the request log masks a second `?`, `;` parameters in the path, pwd and code, and a protocol-relative target', () => {
    expect(redactQuery('/v1/x?waitMs=1?access_token=S1')).toBe('/v1/x?waitMs=1?access_token=***');
    expect(redactQuery('/v1/x;access_token=S2/y')).toBe('/v1/x;access_token=***/y');
    expect(redactQuery('/v1/x?pwd=S3&code=S4&waitMs=5')).toBe('/v1/x?pwd=***&code=***&waitMs=5');
    expect(redactQuery('//u:S5@host/v1/x')).toBe('//***@host/v1/x');
  });

  it('REDIS_URL with ?options or a database past 15 is a configuration error (ioredis read ?db=abc and crashed; /99999 went to db 0)', () => {
    for (const url of ['redis://127.0.0.1:6391/?db=abc', 'redis://127.0.0.1:6391?keyPrefix=zzz', 'redis://127.0.0.1:6391/99999']) {
      expect(() => loadConfig({ REDIS_URL: url }), url).toThrow(ConfigError);
    }
    expect(loadConfig({ REDIS_URL: 'redis://127.0.0.1:6391/15' }).REDIS_URL).toBe('redis://127.0.0.1:6391/15');
  });

  it('a POST with no body is 400 invalid_request, not 415', async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    const api = await startTestApi(bed);
    try {
      const res = await fetch(`${api.base}/v1/leases/recording/co/env/l/operations`, { method: 'POST', headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' } });
      expect(res.status).toBe(400);
      expect(((await res.json()) as { error: { code: string; message: string } }).error).toEqual({ code: 'invalid_request', message: 'the request has no body: send the operation as JSON' });
    } finally {
      await api.close();
    }
  });
});
