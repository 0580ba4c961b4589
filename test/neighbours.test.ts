import { EventEmitter, once } from 'node:events';
import type { Server } from 'node:http';
import { connect, type Socket } from 'node:net';
import { gzipSync } from 'node:zlib';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { createLogger } from '../src/logger.ts';
import { loadConfig } from '../src/config.ts';
import { startApiServer } from '../src/api/server.ts';
import { RefusalLog } from '../src/api/refusal-log.ts';
import { CompanyRateLimiter, DEFAULT_COMPANY_RATES } from '../src/api/company-rates.ts';
import { WaitBudget } from '../src/api/wait-budget.ts';
import type { HttpError } from '../src/api/http-error.ts';
import { ConnectionPool } from '../src/api/connections.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { TestBed, gate, readUntil, spyCommands } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { RedisMonitor, type MonitoredCommand } from './helpers/monitor.ts';

// Issue 27: what one company can do to another through the API. Small budgets here, so the
// test reaches them quickly; the defaults are in docs/security.md.

const A = 'neighbour-a-token-0123456789';
const B = 'neighbour-b-token-0123456789';

/**
 * One request on a connection of its own, sent as written (a `#fragment` too, which fetch
 * drops), with `Connection: close`: its status, headers and body.
 */
async function rawRequest(base: string, token: string, requestLine: string): Promise<{ status: number; headers: Record<string, string>; body: string }> {
  const { port } = new URL(base);
  const socket = connect(Number(port), '127.0.0.1');
  await once(socket, 'connect');
  socket.write(`${requestLine}\r\nHost: x\r\nAuthorization: Bearer ${token}\r\nConnection: close\r\n\r\n`);
  let text = '';
  socket.on('data', (chunk: Buffer) => (text += chunk.toString()));
  await once(socket, 'close');
  const [head, body = ''] = text.split('\r\n\r\n');
  const [statusLine, ...lines] = head!.split('\r\n');
  const headers = Object.fromEntries(lines.map((line) => [line.slice(0, line.indexOf(':')).toLowerCase(), line.slice(line.indexOf(':') + 1).trim()]));
  return { status: Number(statusLine!.split(' ')[1]), headers, body };
}
/** A's token, B's, and a token of B's prod environment. */
const A_B_AND_B_PROD = JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: `${B}-prod`, companyId: 'b', environmentIds: ['prod'] }]);

describe('noisy neighbours: waiting requests (issue 27 item 2)', () => {
  let bed: TestBed;
  let api: TestApi;
  const bearer = (token: string) => ({ authorization: `Bearer ${token}` });
  const held: AbortController[] = [];

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }]),
      LEASE_OPS_API_MAX_WAITS_PER_COMPANY: '3',
      LEASE_OPS_API_MAX_WAITS: '5',
      LEASE_OPS_API_MAX_CONNECTIONS: '40',
    });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    for (const c of held) c.abort();
    await api?.close();
    await bed?.close();
  });

  /** An operation of `company` that waits in a paused lane (no worker runs here anyway): a long poll on it holds. */
  async function waitingOperation(token: string, company: string): Promise<string> {
    const lease = `/v1/leases/recording/${company}/env/held`;
    expect((await fetch(`${api.base}${lease}/pause`, { method: 'POST', headers: bearer(token) })).status).toBe(200);
    const res = await fetch(`${api.base}${lease}/operations`, { method: 'POST', headers: { ...bearer(token), 'content-type': 'application/json' }, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'held' } }) });
    return ((await res.json()) as { jobId: string }).jobId;
  }

  /** Starts a long poll that holds its connection; resolves once the API took it (its status would come only after 25 s). */
  function longPoll(token: string, jobId: string): { response: Promise<Response>; controller: AbortController } {
    const controller = new AbortController();
    held.push(controller);
    const response = fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=25000`, { headers: bearer(token), signal: controller.signal });
    response.catch(() => undefined);
    return { response, controller };
  }

  /** The waits the API holds now, from its /metrics. */
  async function waitsHeld(): Promise<{ all: number; refusedCompany: number; refusedServer: number }> {
    const text = await (await fetch(`${api.base}/metrics`)).text();
    const value = (pattern: RegExp) => Number(pattern.exec(text)?.[1] ?? NaN);
    return {
      all: value(/^lease_ops_api_waits\{of="all"\} (\d+)$/m),
      refusedCompany: value(/^lease_ops_api_waits_refused_total\{budget="company"\} (\d+)$/m),
      refusedServer: value(/^lease_ops_api_waits_refused_total\{budget="server"\} (\d+)$/m),
    };
  }

  async function until(check: () => Promise<boolean>, what: string): Promise<void> {
    const deadline = Date.now() + 10_000;
    while (!(await check())) {
      if (Date.now() > deadline) throw new Error(`never: ${what}`);
      await new Promise((r) => setImmediate(r));
    }
  }

  it("refuses a company's waits past its budget and the server's past its own, while probes and other requests answer at once", async () => {
    const aJob = await waitingOperation(A, 'a');
    const bJob = await waitingOperation(B, 'b');
    const aPolls = [longPoll(A, aJob), longPoll(A, aJob), longPoll(A, aJob)];
    await until(async () => (await waitsHeld()).all === 3, "A's three waits held");
    // A's fourth: refused with its code and a Retry-After, at once.
    const fourth = await fetch(`${api.base}/v1/operations/${encodeURIComponent(aJob)}?waitMs=25000`, { headers: bearer(A) });
    expect(fourth.status).toBe(429);
    // 1 s and up to 2 s more at random (A's refused polls do not come back together).
    expect(['1', '2', '3']).toContain(fourth.headers.get('retry-after'));
    expect(((await fourth.json()) as { error: { code: string } }).error.code).toBe('company_waits_full');
    // A's Prefer: wait is a preference: not applied, the operation accepted (202) at once.
    const preferred = await fetch(`${api.base}/v1/leases/recording/a/env/other/operations`, {
      method: 'POST',
      headers: { ...bearer(A), 'content-type': 'application/json', prefer: 'wait=20' },
      body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'other' } }),
    });
    expect(preferred.status).toBe(202);
    expect(preferred.headers.get('preference-applied')).toBeNull();
    // B is not A: its waits are taken, up to the server's budget (5 in all).
    longPoll(B, bJob);
    longPoll(B, bJob);
    await until(async () => (await waitsHeld()).all === 5, "B's two waits held");
    const sixth = await fetch(`${api.base}/v1/operations/${encodeURIComponent(bJob)}?waitMs=25000`, { headers: bearer(B) });
    expect(sixth.status).toBe(429);
    expect(((await sixth.json()) as { error: { code: string } }).error.code).toBe('server_waits_full');
    // With every wait held, the probes and B's reads that do not wait answer at once.
    expect((await fetch(`${api.base}/healthz`)).status).toBe(200);
    expect((await fetch(`${api.base}/readyz`)).status).toBe(200);
    expect((await fetch(`${api.base}/v1/operations/${encodeURIComponent(bJob)}`, { headers: bearer(B) })).status).toBe(200);
    expect((await fetch(`${api.base}/v1/attention`, { headers: bearer(B) })).status).toBe(200);
    expect(await waitsHeld()).toMatchObject({ all: 5, refusedCompany: 2, refusedServer: 1 });
    // A hangs up: its waits come back at once, not when they would have ended.
    for (const poll of aPolls) poll.controller.abort();
    await until(async () => (await waitsHeld()).all === 2, "A's waits given back");
    longPoll(A, aJob);
    await until(async () => (await waitsHeld()).all === 3, "A's new wait held");
  });

  it("refuses a wait past the budget after one read of its job, and still answers one whose operation ended", async () => {
    // The first test left A one wait and B two: A takes its other two.
    const aJob = await waitingOperation(A, 'a');
    longPoll(A, aJob);
    longPoll(A, aJob);
    await until(async () => (await waitsHeld()).all === 5, "A's three waits held");
    // What the API sends Redis for A's refused wait: one read (of the job's lease and end), not a view.
    const connection = api.client.ops.connection;
    const { sent, restore } = spyCommands(connection);
    try {
      const refused = await fetch(`${api.base}/v1/operations/${encodeURIComponent(aJob)}?waitMs=25000`, { headers: bearer(A) });
      expect(refused.status).toBe(429);
      expect(((await refused.json()) as { error: { code: string } }).error.code).toBe('company_waits_full');
      expect(sent).toEqual(['hmget']);
    } finally {
      restore();
    }
    // Another company's id is not found, as without a budget (the server's is full: B is refused waits too).
    const notB = await fetch(`${api.base}/v1/operations/${encodeURIComponent(aJob)}?waitMs=25000`, { headers: bearer(B) });
    expect(notB.status).toBe(404);
    // An id that names one of the queue's own keys is not found either (helper-23: 500, WRONGTYPE).
    for (const id of ['events', 'id', 'failed', 'stalled-check', 'meta']) {
      expect([id, (await fetch(`${api.base}/v1/operations/${id}?waitMs=1000`, { headers: bearer(A) })).status]).toEqual([id, 404]);
    }
    // A job whose data is not an operation's (not JSON, or JSON of another shape: something
    // else wrote it) is not found either, waited on or not: a 500 would say it exists.
    const queue = api.client.ops.queue;
    await connection.hset(queue.toKey('rawNotJsonLaneId000000.rawNotJson000000001'), { name: 'acquire', data: '{not json', timestamp: '1' });
    await connection.hset(queue.toKey('rawOtherShapeLane00000.rawOtherShape0000001'), { name: 'acquire', data: '{"lease":7}', timestamp: '1' });
    // A key of another type under a job-shaped id (a running job's `<id>:lock`, helper-57: 500
    // while that job ran, 404 once it ended), and A's own job whose options are not JSON.
    await connection.set(queue.toKey('rawNotJsonLaneId000000.rawNotJson000000001:lock'), 'a-token');
    const operation = { op: 'stop', params: { providerLeaseId: 'x' }, lease: { provider: 'recording', companyId: 'a', environmentId: 'env', leaseId: 'x' }, acceptedAt: 1, deadlineAt: Date.now() + 60_000 };
    await connection.hset(queue.toKey('rawOptionsLaneId000000.rawOptions00000001'), { name: 'stop', data: JSON.stringify(operation), opts: '{not json', timestamp: '1' });
    for (const id of ['rawNotJsonLaneId000000.rawNotJson000000001', 'rawOtherShapeLane00000.rawOtherShape0000001', 'rawNotJsonLaneId000000.rawNotJson000000001:lock', 'rawOptionsLaneId000000.rawOptions00000001']) {
      // A's own job of the four is A's to wait on, and A's waits are full here: the wait itself is tried below.
      for (const query of id.startsWith('rawOptions') ? [''] : ['', '?waitMs=1000']) {
        expect([id, query, (await fetch(`${api.base}/v1/operations/${id}${query}`, { headers: bearer(A) })).status]).toEqual([id, query, 404]);
      }
      for (const action of ['cancel', 'rerun']) {
        expect([id, action, (await fetch(`${api.base}/v1/operations/${id}/${action}`, { method: 'POST', headers: bearer(A) })).status]).toEqual([id, action, 404]);
      }
    }
    // Its wait finds no job in it either (helper-57: 500 where a plain read said 404).
    expect(await api.client.waitForEndOf('rawOptionsLaneId000000.rawOptions00000001', 100)).toBeNull();
    // An operation that ended needs no wait: answered, budget full or not.
    const worker = await bed.startWorker(createRecordingProvider().provider);
    try {
      const { jobId: ended } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'a', environmentId: 'env', leaseId: 'ends' }, params: { providerLeaseId: 'ends' } });
      await bed.waitForAll([ended], 30_000);
      const answered = await fetch(`${api.base}/v1/operations/${encodeURIComponent(ended)}?waitMs=25000`, { headers: bearer(A) });
      expect(answered.status).toBe(200);
      expect(((await answered.json()) as { state: string }).state).toBe('completed');
    } finally {
      await worker.close();
    }
  });
});

describe("noisy neighbours: a company's turns (LEASE_OPS_API_REQUESTS_PER_COMPANY)", () => {
  let bed: TestBed;
  let api: TestApi;
  const bearer = (token: string) => ({ authorization: `Bearer ${token}` });

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }]),
      LEASE_OPS_API_REQUESTS_PER_COMPANY: '1',
    });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
  });

  /** The API's requests with a turn and waiting for one, and its waits, from /metrics. */
  async function usage(): Promise<{ inProgress: number; waiting: number; waits: number }> {
    const text = await (await fetch(`${api.base}/metrics`)).text();
    const value = (pattern: RegExp) => Number(pattern.exec(text)?.[1] ?? NaN);
    return { inProgress: value(/^lease_ops_api_requests\{state="in_progress"\} (\d+)$/m), waiting: value(/^lease_ops_api_requests\{state="waiting"\} (\d+)$/m), waits: value(/^lease_ops_api_waits\{of="all"\} (\d+)$/m) };
  }

  async function until(check: () => Promise<boolean>, what: string): Promise<void> {
    const deadline = Date.now() + 10_000;
    while (!(await check())) {
      if (Date.now() > deadline) throw new Error(`never: ${what}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  }

  /**
   * A socket of A's with a long poll and, pipelined behind it, `behind`: by default a change
   * whose body never comes, which holds A's turn while it waits for its body.
   */
  async function pipelinedHolder(behind?: string, held = 1): Promise<Socket> {
    const lease = '/v1/leases/recording/a/env/held';
    expect((await fetch(`${api.base}${lease}/pause`, { method: 'POST', headers: bearer(A) })).status).toBe(200);
    const res = await fetch(`${api.base}${lease}/operations`, { method: 'POST', headers: { ...bearer(A), 'content-type': 'application/json' }, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'held' } }) });
    const { jobId } = (await res.json()) as { jobId: string };
    const { port } = new URL(api.base);
    const socket = connect(Number(port), '127.0.0.1');
    await once(socket, 'connect');
    const request = (path: string) => `GET ${path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\n\r\n`;
    const change = `POST /v1/leases/recording/a/env/l1/operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{`;
    socket.write(request(`/v1/operations/${encodeURIComponent(jobId)}?waitMs=25000`) + (behind ?? change));
    socket.on('error', () => undefined);
    await until(async () => {
      const u = await usage();
      return u.waits === 1 && u.inProgress === held;
    }, `the poll waits and ${held} request(s) behind it hold A's turn`);
    return socket;
  }

  it("gives a turn back when its request's answer is complete, though it waits behind a long poll's to be written", async () => {
    const reads = Array.from({ length: 3 }, () => `GET /v1/leases/recording/a/env/l1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\n\r\n`).join('');
    // Three cheap reads behind the poll: their answers are done at once, so no turn stays held.
    const socket = await pipelinedHolder(reads, 0);
    expect((await fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: bearer(A) })).status).toBe(200);
    socket.destroy();
  });

  it("gives a pipelined request's turn back when its caller hangs up, though its answer never left", async () => {
    const socket = await pipelinedHolder();
    socket.destroy();
    await until(async () => (await usage()).inProgress === 0, "A's turn given back");
    expect((await fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: bearer(A) })).status).toBe(200);
  });

  it("keeps a company's line of waiting requests to four times its turns (429 company_requests_full), and another company answering", async () => {
    const socket = await pipelinedHolder();
    const inLine = Array.from({ length: 4 }, () => fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: bearer(A) }));
    await until(async () => (await usage()).waiting === 4, "A's four in line");
    const refused = await fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: bearer(A) });
    expect(refused.status).toBe(429);
    expect(['1', '2', '3']).toContain(refused.headers.get('retry-after'));
    expect(((await refused.json()) as { error: { code: string } }).error.code).toBe('company_requests_full');
    expect((await fetch(`${api.base}/v1/leases/recording/b/env/l1`, { headers: bearer(B) })).status).toBe(200);
    socket.destroy();
    for (const res of await Promise.all(inLine)) expect(res.status).toBe(200);
  });
  it('refuses a full line with one answer whatever the form of the URL (rated and turned first, or by the /v1 router), its Retry-After spread over 1-3 s', async () => {
    const socket = await pipelinedHolder();
    const inLine = Array.from({ length: 4 }, () => fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: bearer(A) }));
    await until(async () => (await usage()).waiting === 4, "A's four in line");
    // Every form of the same path Express routes to /v1 (absolute form, a fragment, capitals): the same refusal.
    const forms = ['/v1/leases/recording/a/env/l1', 'http://x/v1/leases/recording/a/env/l1', '/v1/leases/recording/a/env/l1#x', '/V1/leases/recording/a/env/l1'];
    const answers = [];
    for (let i = 0; i < 8; i++) answers.push(await rawRequest(api.base, A, `GET ${forms[i % forms.length]} HTTP/1.1`));
    for (const answer of answers) {
      expect(answer.status).toBe(429);
      expect(JSON.parse(answer.body)).toEqual(JSON.parse(answers[0]!.body));
      expect(answer.headers['content-type']).toBe('application/json; charset=utf-8');
      expect(['1', '2', '3']).toContain(answer.headers['retry-after']);
    }
    expect((JSON.parse(answers[0]!.body) as { error: { code: string } }).error.code).toBe('company_requests_full');
    // Eight refused together do not all come back together (all alike: 3 in 3^8).
    expect(new Set(answers.map((a) => a.headers['retry-after'])).size).toBeGreaterThan(1);
    socket.destroy();
    for (const res of await Promise.all(inLine)) expect(res.status).toBe(200);
  });
});

describe("noisy neighbours: a request refused for a full line keeps its company's rate", () => {
  it('gives the rate its token back when company_requests_full refuses the request', async () => {
    const bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]),
      LEASE_OPS_API_REQUESTS_PER_COMPANY: '1',
      // Six reads and the bucket is empty for the rest of the test.
      LEASE_OPS_API_COMPANY_RATES: JSON.stringify({ read: { perSecond: 0.001, burst: 6 } }),
    });
    const api = await startTestApi(bed);
    const { port } = new URL(api.base);
    const socket = connect(Number(port), '127.0.0.1');
    socket.on('error', () => undefined);
    try {
      await once(socket, 'connect');
      // A change whose body never comes holds A's one turn (a write: no read token spent).
      socket.write(`POST /v1/leases/recording/a/env/l1/operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{`);
      const waiting = async () => Number(/^lease_ops_api_requests\{state="waiting"\} (\d+)$/m.exec(await (await fetch(`${api.base}/metrics`)).text())?.[1]);
      const inProgress = async () => Number(/^lease_ops_api_requests\{state="in_progress"\} (\d+)$/m.exec(await (await fetch(`${api.base}/metrics`)).text())?.[1]);
      while ((await inProgress()) !== 1) await new Promise((r) => setImmediate(r));
      // Four reads in line (four tokens), then three refused for the full line.
      const inLine = Array.from({ length: 4 }, () => fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: { authorization: `Bearer ${A}` } }));
      while ((await waiting()) !== 4) await new Promise((r) => setImmediate(r));
      const codes = [];
      for (let i = 0; i < 3; i++) codes.push(((await (await fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: { authorization: `Bearer ${A}` } })).json()) as { error: { code: string } }).error.code);
      expect(codes).toEqual(['company_requests_full', 'company_requests_full', 'company_requests_full']);
      socket.destroy();
      for (const res of await Promise.all(inLine)) expect(res.status).toBe(200);
      // The refused ones spent nothing: two tokens are left of six.
      const after = [];
      for (let i = 0; i < 3; i++) after.push((await fetch(`${api.base}/v1/leases/recording/a/env/l1`, { headers: { authorization: `Bearer ${A}` } })).status);
      expect(after).toEqual([200, 200, 429]);
      // The document is served before /v1's budgets: its rate spent, the company still reads it, in any form of its URL.
      expect((await fetch(`${api.base}/v1/openapi.json`, { headers: { authorization: `Bearer ${A}` } })).status).toBe(200);
      for (const form of ['/v1/openapi.json#x', '/V1/OPENAPI.JSON', '/v1/openapi.json/']) expect((await rawRequest(api.base, A, `GET ${form} HTTP/1.1`)).status).toBe(200);
    } finally {
      socket.destroy();
      await api.close();
      await bed.close();
    }
  });
});

describe('noisy neighbours: pauses (issue 27 item 7)', () => {
  let bed: TestBed;
  let api: TestApi;
  const ADMIN = 'neighbour-admin-token-0123456789';

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: ADMIN }]),
      LEASE_OPS_MAX_PAUSED_PER_COMPANY: '3',
    });
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
  });

  const pause = (token: string, company: string, leaseId: string, action = 'pause') =>
    fetch(`${api.base}/v1/leases/recording/${company}/env/${leaseId}/${action}`, { method: 'POST', headers: { authorization: `Bearer ${token}` } });

  it("holds a company to its paused lanes, counts them, frees the count on unpause, and lets an admin past it, saying so", async () => {
    for (const id of ['p1', 'p2', 'p3']) expect((await pause(A, 'a', id)).status).toBe(200);
    // Pausing one already paused is no new pause.
    expect(((await (await pause(A, 'a', 'p1')).json()) as { changed: boolean }).changed).toBe(false);
    const refused = await pause(A, 'a', 'p4');
    expect(refused.status).toBe(429);
    expect(((await refused.json()) as { error: { code: string } }).error.code).toBe('company_pauses_full');
    expect(await bed.ops.lanes.pausedByCompany('a')).toBe(3);
    // Another company is not held to A's count.
    expect((await pause(B, 'b', 'q1')).status).toBe(200);
    // An admin goes past it and is told.
    const admin = await pause(ADMIN, 'a', 'p5');
    expect(admin.status).toBe(200);
    expect(await admin.json()).toMatchObject({ paused: true, changed: true, overLimit: 'company_pauses_full' });
    expect(await bed.ops.lanes.pausedByCompany('a')).toBe(4);
    // Unpausing frees the count: A may pause again once under its limit.
    for (const id of ['p1', 'p5']) expect((await pause(A, 'a', id, 'unpause')).status).toBe(200);
    expect(await bed.ops.lanes.pausedByCompany('a')).toBe(2);
    expect((await pause(A, 'a', 'p4')).status).toBe(200);
    expect(await bed.ops.lanes.pausedByCompany('a')).toBe(3);
  });
});

describe('noisy neighbours: reruns (issue 27 item 5)', () => {
  let bed: TestBed;
  let api: TestApi;
  const ADMIN = 'neighbour-admin-token-0123456789';
  const failed: Record<string, string[]> = {};

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: ADMIN }]),
      LEASE_OPS_MAX_QUEUED_PER_LEASE: '2',
      LEASE_OPS_MAX_QUEUED_PER_COMPANY: '4',
      LEASE_OPS_KEEP_FAILED_S: '600',
    });
    // Operations that fail for good, then no worker: a rerun waits for one, counted.
    const { provider } = createRecordingProvider({ behaviour: () => 'permanent' });
    const worker = await bed.startWorker(provider);
    for (const [company, leaseId] of [['a', 'l1'], ['a', 'l1'], ['a', 'l1'], ['a', 'l2'], ['a', 'l3'], ['a', 'l3'], ['b', 'm1']] as const) {
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: company, environmentId: 'env', leaseId }, params: { providerLeaseId: leaseId } });
      expect((await bed.waitForAll([jobId], 10_000)).get(jobId)).toBe('failed');
      (failed[`${company}/${leaseId}`] ??= []).push(jobId);
    }
    await worker.close();
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
  });

  const rerun = (token: string, jobId: string) => fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}/rerun`, { method: 'POST', headers: { authorization: `Bearer ${token}` } });
  const codeOf = async (res: Response) => ((await res.json()) as { error?: { code: string } }).error?.code;

  it("counts reruns against the lease's and the company's queue limits, as enqueues are; an admin goes past, and is told", async () => {
    const [x1, x2, x3] = failed['a/l1']!;
    expect((await rerun(A, x1!)).status).toBe(202);
    expect((await rerun(A, x2!)).status).toBe(202);
    // The lease holds 2 on their way: a third is refused like a third enqueue would be.
    const third = await rerun(A, x3!);
    expect(third.status).toBe(429);
    expect(await codeOf(third)).toBe('lease_queue_full');
    // The company holds 4: two more on other leases fit, the fifth does not.
    expect((await rerun(A, failed['a/l2']![0]!)).status).toBe(202);
    expect((await rerun(A, failed['a/l3']![0]!)).status).toBe(202);
    const fifth = await rerun(A, failed['a/l3']![1]!);
    expect(fifth.status).toBe(429);
    expect(await codeOf(fifth)).toBe('company_queue_full');
    // Another company is not held to A's count.
    expect((await rerun(B, failed['b/m1']![0]!)).status).toBe(202);
    // An admin runs one again past the limit, and the answer says which.
    const admin = await rerun(ADMIN, x3!);
    expect(admin.status).toBe(202);
    expect(await admin.json()).toMatchObject({ overLimit: 'lease_queue_full' });
  });

  it("counts the company's reruns against an enqueue too: they joined their lanes when asked", async () => {
    // A's reruns (five, the admin's included) are in their lanes already, none left on its
    // way, and fill its company count of 4: an enqueue is refused.
    expect(await bed.redis.zcard(bed.ops.lanes.rerunsKey('a'))).toBe(0);
    expect(await bed.redis.hget(bed.ops.lanes.byCompanyKey, 'a')).toBe('5');
    const enqueue = () => bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'a', environmentId: 'env', leaseId: 'l9' }, params: { providerLeaseId: 'l9' } });
    await expect(enqueue()).rejects.toMatchObject({ code: 'company_queue_full' });
    // And where they joined: l1 holds three against its limit of 2.
    await expect(bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'a', environmentId: 'env', leaseId: 'l1' }, params: { providerLeaseId: 'l1' } })).rejects.toMatchObject({ code: 'lease_queue_full' });
    // A worker takes them: each fails again, for good, and its lane's count lets it go.
    const { provider } = createRecordingProvider({ behaviour: () => 'permanent' });
    const worker = await bed.startWorker(provider);
    try {
      const reran = [...failed['a/l1']!, ...failed['a/l2']!, failed['a/l3']![0]!];
      expect([...(await bed.waitForAll(reran, 10_000)).values()].every((s) => s === 'failed')).toBe(true);
      expect(await bed.redis.zcard(bed.ops.lanes.rerunsKey('a'))).toBe(0);
      const { jobId } = await enqueue();
      expect((await bed.waitForAll([jobId], 10_000)).get(jobId)).toBe('failed');
    } finally {
      await worker.close();
    }
  });
});

describe('noisy neighbours: attention (issue 27 item 3)', () => {
  let bed: TestBed;
  let api: TestApi;
  let worker: { close(): Promise<void> };
  // A Redis of its own: the commands it counts are this test's alone.
  let redis: RedisProcess;
  const failing = () => createRecordingProvider({ behaviour: ({ ctx }) => (ctx.lease.leaseId.startsWith('fail') ? 'permanent' : 'ok') }).provider;

  beforeAll(async () => {
    redis = await RedisProcess.start();
    bed = await TestBed.create({
      REDIS_URL: redis.url,
      LEASE_OPS_API_TOKENS: A_B_AND_B_PROD,
      LEASE_OPS_KEEP_FAILED_S: '600',
    });
    worker = await bed.startWorker(failing());
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
    await redis?.stop();
  });

  it("reads a company's attention from its own entries: A's thousands of failures cost B's list nothing", async () => {
    const fail = async (company: string, environmentId: string, leaseId: string) => {
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: company, environmentId, leaseId }, params: { providerLeaseId: leaseId } });
      return jobId;
    };
    const aJobs = await Promise.all(Array.from({ length: 300 }, (_, i) => fail('a', 'env', `fail-${i}`)));
    const bJobs = [await fail('b', 'prod', 'fail-b1'), await fail('b', 'dev', 'fail-b2'), await fail('b', '日本', 'fail-b3')];
    await bed.waitForAll([...aJobs, ...bJobs], 30_000);
    await bed.ops.lanes.pause(await bed.ops.laneOf({ provider: 'recording', companyId: 'b', environmentId: 'prod', leaseId: 'held' }), 'b', Date.now(), { provider: 'recording', companyId: 'b', environmentId: 'prod', leaseId: 'held' });

    // The worker's own loops (sweeps, scans, fetches) would count among the commands below: it goes first.
    await worker.close();
    const list = async (token: string) => ((await (await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${token}` } })).json()) as { items: { lease: { leaseId: string }; reasons: string[] }[] }).items;
    // B's list is B's, and B's read touches B's entries: count the commands Redis ran for it.
    const commands = async () => Number(/total_commands_processed:(\d+)/.exec(await bed.redis.info('stats'))?.[1]);
    await list(B);
    const before = await commands();
    const bItems = await list(B);
    const cost = (await commands()) - before;
    // An environment named in Japanese included (its UTF-8 bytes sort above the string "\xff").
    expect(bItems.map((i) => `${i.lease.leaseId} ${i.reasons.join(',')}`).sort()).toEqual(['fail-b1 operation_failed', 'fail-b2 operation_failed', 'fail-b3 operation_failed', 'held paused']);
    expect(cost).toBeLessThan(150);
    // An environment-scoped token reads its environment's only.
    expect((await list(`${B}-prod`)).map((i) => i.lease.leaseId).sort()).toEqual(['fail-b1', 'held']);
    // A sees its own, all of them (the first page: 200).
    expect((await list(A)).length).toBe(200);
    // An entry whose reason ended leaves the index on the next read: B acknowledges, its entry goes.
    await api.client.acknowledgeFailures({ provider: 'recording', companyId: 'b', environmentId: 'dev', leaseId: 'fail-b2' }, 'test');
    expect((await list(B)).map((i) => i.lease.leaseId).sort()).toEqual(['fail-b1', 'fail-b3', 'held']);
    expect((await bed.redis.zrangebylex(bed.ops.lanes.attentionScopeKey, '[b\n', '(b\n\xff')).filter((m) => m.startsWith('b\ndev\n'))).toEqual([]);
  });
  it("counts attention for /metrics without reading its items: A's hundreds of failures cost a scrape nothing", async () => {
    // The first test left A's 300 failures, B's three (one acknowledged) and its pause, its worker closed.
    // A scrape read the first 200 items of the attention list (each failure's operations,
    // its record) in the API's event loop to count them: a 157 ms stall every scrape at 600
    // of A's failures, felt by every company's requests.
    const commands = async () => Number(/total_commands_processed:(\d+)/.exec(await bed.redis.info('stats'))?.[1]);
    const scrape = async () => (await fetch(`${api.base}/metrics`)).text();
    await scrape();
    const before = await commands();
    const text = await scrape();
    const cost = (await commands()) - before;
    const gauge = (line: string) => Number(new RegExp(`^${line.replace(/[{}"]/g, (c) => `\\${c}`)} (\\S+)$`, 'm').exec(text)?.[1]);
    expect(gauge('lease_ops_leases_needing_attention{reason="operation_failed"}')).toBe(302);
    expect(gauge('lease_ops_leases_needing_attention{reason="paused"}')).toBe(1);
    expect(gauge('lease_ops_attention_leases')).toBe(303);
    expect(gauge('lease_ops_operations{state="failed"}')).toBe(303);
    // The same counts the overview gives.
    const overview = await api.client.overview();
    expect(overview.attentionLeases).toBe(303);
    expect(overview.counts.failed).toBe(303);
    expect(cost).toBeLessThan(80);
  });
  it("finds a company's items behind more than a page of index entries whose reasons ended (they leave the index as it is read)", async () => {
    // 700 entries of B's with no reason left, sorted before B's own (environment "aaa"): the
    // walk takes each page of them out as it goes, and read its next page from an offset that
    // no longer counted them, skipping a page of entries (helper-23's walk read 1,500 of 3,000).
    const key = bed.ops.lanes.attentionScopeKey;
    await bed.redis.zadd(key, ...Array.from({ length: 700 }, (_, i) => [0, `b\naaa\ngone-${String(i).padStart(4, '0')}`]).flat());
    const items = ((await (await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${B}` } })).json()) as { items: { lease: { leaseId: string } }[] }).items;
    expect(items.map((i) => i.lease.leaseId).sort()).toEqual(['fail-b1', 'fail-b3', 'held']);
    expect(await bed.redis.zrangebylex(key, '[b\naaa\n', '(b\naaa\n\xff')).toEqual([]);
  });
  it("finds every live item of a company when another of its walks takes entries out between two pages of this one (helper-24)", async () => {
    // 900 paused lanes of company c; after this walk read its first page, 100 of that page's
    // entries lose their reason and another walk (of another replica, say) takes them out.
    // Read from an offset, the second page then began 100 live entries too far.
    const key = bed.ops.lanes.attentionScopeKey;
    const lanes = Array.from({ length: 900 }, (_, i) => `live-${String(i).padStart(4, '0')}`);
    const leaseOf = (leaseId: string) => ({ provider: 'recording', companyId: 'c', environmentId: 'env', leaseId });
    await bed.redis.hset(bed.ops.lanes.pausedKey, Object.fromEntries(lanes.map((l, i) => [l, JSON.stringify({ by: 'test', since: 1_000 + i, lease: leaseOf(l) })])));
    await bed.redis.zadd(key, ...lanes.flatMap((l) => [0, `c\nenv\n${l}`]));
    const walker = api.client.partitions[0]!.walker as unknown as { ops: { connection: { zrangebylex: (...args: unknown[]) => Promise<string[]> } } };
    const connection = walker.ops.connection;
    const read = connection.zrangebylex.bind(connection);
    let pages = 0;
    connection.zrangebylex = async (...args: unknown[]) => {
      // Before the walk reads its second page of c's entries: its first page was read (and found live).
      if (/^[[(]c\n/.test(String(args[1])) && ++pages === 2) {
        const taken = lanes.slice(100, 200);
        await bed.redis.hdel(bed.ops.lanes.pausedKey, ...taken);
        await bed.redis.zrem(key, ...taken.map((l) => `c\nenv\n${l}`));
      }
      return read(...args);
    };
    try {
      const page = await api.client.attentionPage(0, 1_000, undefined, { companyId: 'c' });
      // The 100 taken out were live when this walk read them: listed; none of the rest missed.
      expect(pages).toBe(2);
      expect(page.items.map((i) => i.lease?.leaseId).sort()).toEqual(lanes);
    } finally {
      connection.zrangebylex = read;
      await bed.redis.hdel(bed.ops.lanes.pausedKey, ...lanes);
      await bed.redis.zrem(key, ...lanes.map((l) => `c\nenv\n${l}`));
    }
  });
  it("keeps a company's attention entries when Redis fails their reads: the walk fails (503), nothing is taken out", async () => {
    // helper-15: with Redis stalled mid-walk, every read of a page failed, each failure was read
    // as "no reason left", and the walk answered 200 while it took 500 entries out of the index.
    const lease = { provider: 'recording', companyId: 'b', environmentId: 'ops', leaseId: 'fail-kept' };
    // The first test closed its worker (it counts commands): one of this test's own.
    const ownWorker = await bed.startWorker(failing());
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease, params: { providerLeaseId: 'fail-kept' } });
    await bed.waitForAll([jobId], 30_000);
    await ownWorker.close();
    const entries = () => bed.redis.zrangebylex(bed.ops.lanes.attentionScopeKey, '[b\nops\n', '(b\nops\n\xff');
    expect(await entries()).toHaveLength(1);
    // Every read of the lane's three reasons answers an error (a hash where Redis expects a
    // sorted set, and strings where it expects hashes): as a stalled Redis' timeouts would.
    const keys = [bed.ops.lanes.failuresKey, bed.ops.lanes.pausedKey, `${bed.config.LEASE_OPS_PREFIX}:stopping`];
    for (const key of keys) await bed.redis.rename(key, `${key}:aside`).catch(() => undefined);
    for (const key of keys) await bed.redis.set(key, 'not what Redis expects here');
    try {
      const res = await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${B}` } });
      expect(res.status).toBeGreaterThanOrEqual(500);
      expect(await entries()).toHaveLength(1);
    } finally {
      for (const key of keys) {
        await bed.redis.del(key);
        await bed.redis.rename(`${key}:aside`, key).catch(() => undefined);
      }
    }
    const items = ((await (await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${B}` } })).json()) as { items: { lease: { leaseId: string } }[] }).items;
    expect(items.map((i) => i.lease.leaseId)).toContain('fail-kept');
  });
});

/**
 * What `read` sent to Redis from the API's own connections (its client names them
 * lease-ops-client and lease-ops-client-walks), as MONITOR saw it; a script's own calls name
 * no connection. Counting all commands would take in the worker's lock renewals, stall checks
 * and sweep, which read every company's jobs on their own timers (a CI run). Open the walks'
 * connection first (a read before).
 */
async function apiCommandsDuring<T>(bed: TestBed, redisUrl: string, read: () => Promise<T>): Promise<{ result: T; seen: MonitoredCommand[] }> {
  const url = new URL(redisUrl);
  const clients = ((await bed.redis.client('LIST')) as string).split('\n');
  const api = new Set(clients.filter((c) => /\bname=lease-ops-client(-walks)?\b/.test(c)).map((c) => /\baddr=(\S+)/.exec(c)![1]!));
  expect(api.size).toBeGreaterThanOrEqual(2);
  const seen: MonitoredCommand[] = [];
  const end = `end-of-read-${Math.random()}`;
  let ended!: () => void;
  const sawEnd = new Promise<void>((resolve) => (ended = resolve));
  const monitor = await RedisMonitor.start(url.hostname, Number(url.port), (command) => {
    if (command.args[1] === end) ended();
    else if (api.has(command.source)) seen.push(command);
  });
  try {
    const result = await read();
    await bed.redis.echo(end);
    await sawEnd;
    return { result, seen };
  } finally {
    monitor.close();
  }
}

describe("noisy neighbours: operations running past their deadline (issue 27 item 3)", () => {
  let bed: TestBed;
  let api: TestApi;
  let redis: RedisProcess;
  const held = gate();

  beforeAll(async () => {
    redis = await RedisProcess.start();
    bed = await TestBed.create({
      REDIS_URL: redis.url,
      LEASE_OPS_API_TOKENS: A_B_AND_B_PROD,
      LEASE_OPS_CONCURRENCY: '300',
      // 252 held attempts keep their locks on a loaded machine: a renewal of the tests' 2 s
      // lock that came late would stall one out of BullMQ's active list.
      LEASE_OPS_LOCK_MS: '30000',
      LEASE_OPS_STALLED_INTERVAL_MS: '15000',
    });
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ ctx }) => (ctx.lease.leaseId.startsWith('held') ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    held.open();
    await api?.close();
    await bed?.close();
    await redis?.stop();
  });

  it("finds a company's operations running past their deadline from its own index: A's 250 running operations cost B's list nothing", async () => {
    const stop = (company: string, environmentId: string, leaseId: string, deadlineMs?: number) =>
      bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: company, environmentId, leaseId }, params: { providerLeaseId: leaseId }, ...(deadlineMs ? { deadlineMs } : {}) }).then((r) => r.jobId);
    // A's burst: 250 operations running (A's first five past their deadline), B's two. Those
    // with a short deadline come once the rest run, with time to start: one that starts past
    // its deadline fails at once (a loaded machine took longer than 300 ms to start 252).
    const aRest = await Promise.all(Array.from({ length: 245 }, (_, i) => stop('a', 'env', `held-${i + 5}`)));
    await readUntil(async () => (await bed.ops.queue.getActiveCount()) === 245, 30_000, "A's operations running");
    const aJobs = [...(await Promise.all(Array.from({ length: 5 }, (_, i) => stop('a', 'env', `held-${i}`, 3_000)))), ...aRest];
    const bJobs = [await stop('b', 'prod', 'held-b1', 3_000), await stop('b', 'dev', 'held-b2', 3_000)];
    await readUntil(async () => (await bed.ops.queue.getActiveCount()) === 252, 30_000, 'every operation running');
    const deadlines = await Promise.all([...aJobs.slice(0, 5), ...bJobs].map(async (id) => (await bed.ops.queue.getJob(id))!.data.deadlineAt as number));
    // Waiting for a time, not an event: the deadlines to pass.
    await new Promise((r) => setTimeout(r, Math.max(...deadlines) - Date.now() + 20));

    const list = async (token: string) => ((await (await fetch(`${api.base}/v1/attention`, { headers: { authorization: `Bearer ${token}` } })).json()) as { items: { lease: { leaseId: string }; reasons: string[]; detail: string }[] }).items;
    await list(B); // the walks' connection open
    const { result: bItems, seen } = await apiCommandsDuring(bed, redis.url, () => list(B));
    expect(bItems.map((i) => `${i.lease.leaseId} ${i.reasons.join(',')}`).sort()).toEqual(['held-b1 blocked', 'held-b2 blocked']);
    expect(bItems.find((i) => i.lease.leaseId === 'held-b1')!.detail).toBe(`stop ${bJobs[0]} is still running past its deadline`);
    // B's walk read B's jobs and none of A's 250 (before, it read each job, and the running list).
    const touching = (ids: string[]) => {
      const keys = new Set(ids.flatMap((id) => [bed.ops.queue.toKey(id), `${bed.ops.queue.toKey(id)}:lock`]));
      return seen.filter((c) => c.args.slice(1).some((arg) => keys.has(arg))).map((c) => c.args.slice(0, 2).join(' '));
    };
    expect(touching(bJobs).length).toBeGreaterThan(0);
    expect(touching(aJobs)).toEqual([]);
    // A job holding its lock runs: no read of the running list, which holds A's 250 (helper-33).
    const activeKey = bed.ops.queue.toKey('active');
    expect(seen.filter((c) => ['lrange', 'lpos', 'llen'].includes(c.args[0]!.toLowerCase()) && c.args[1] === activeKey).map((c) => c.args.join(' '))).toEqual([]);
    expect((await list(`${B}-prod`)).map((i) => i.lease.leaseId)).toEqual(['held-b1']);
    expect((await list(A)).map((i) => i.lease.leaseId).sort()).toEqual(['held-0', 'held-1', 'held-2', 'held-3', 'held-4']);
    // The admin's view holds the same seven.
    expect((await api.client.leasesNeedingAttention(500)).filter((i) => i.reasons.includes('blocked')).map((i) => i.lease?.leaseId).sort()).toEqual(['held-0', 'held-1', 'held-2', 'held-3', 'held-4', 'held-b1', 'held-b2']);

    // An entry whose job is gone leaves the index as it is read.
    const key = bed.ops.lanes.deadlinesKey('b');
    await bed.redis.zadd(key, 0, 'gone-job');
    expect((await list(B)).length).toBe(2);
    expect(await bed.redis.zscore(key, 'gone-job')).toBeNull();

    // One queued behind B's running stop leaves the index when its deadline drops it from its
    // lane, one an operator cancels when the cancel drops it: neither ran.
    const key2 = bed.ops.lanes.deadlinesKey('b');
    const [expiring, cancelled] = [await stop('b', 'prod', 'held-b1', 300), await stop('b', 'prod', 'held-b1')];
    expect(await bed.redis.zscore(key2, cancelled)).not.toBeNull();
    await api.client.cancelOperation(cancelled, 'test');
    expect(await bed.redis.zscore(key2, cancelled)).toBeNull();
    await bed.waitForAll([expiring], 10_000);
    expect((await bed.ops.queue.getJob(expiring))!.failedReason).toMatch(/^deadline_exceeded/);
    expect(await bed.redis.zscore(key2, expiring)).toBeNull();

    // Each operation leaves the index as it ends.
    held.open();
    await bed.waitForAll([...aJobs, ...bJobs], 30_000);
    expect(await bed.redis.zcard(bed.ops.lanes.deadlinesKey('a'))).toBe(0);
    expect(await bed.redis.zcard(key)).toBe(0);
    expect(await list(B)).toEqual([]);
  });
});

describe('noisy neighbours: lanes blocked now, waiting for a worker (issue 27 item 3)', () => {
  let bed: TestBed;
  let api: TestApi;
  let redis: RedisProcess;

  beforeAll(async () => {
    redis = await RedisProcess.start();
    // No worker: every head waits for one, and its lane goes quiet after 2 x (100 + 100) ms.
    bed = await TestBed.create({
      REDIS_URL: redis.url,
      LEASE_OPS_API_TOKENS: A_B_AND_B_PROD,
      LEASE_OPS_SWEEP_STALE_MS: '100',
      LEASE_OPS_SWEEP_INTERVAL_MS: '100',
    });
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
    await redis?.stop();
  });

  it("reads a company's own quiet lanes for its list, not every company's: A's 300 lanes waiting for a worker cost B's list no read of them", async () => {
    const leaseOf = (company: string, environmentId: string, leaseId: string) => ({ provider: 'recording', companyId: company, environmentId, leaseId });
    const stop = (company: string, environmentId: string, leaseId: string) =>
      bed.ops.enqueue({ op: 'stop', lease: leaseOf(company, environmentId, leaseId), params: { providerLeaseId: leaseId } }).then((r) => r.jobId);
    const aJobs = await Promise.all(Array.from({ length: 300 }, (_, i) => stop('a', 'env', `quiet-${i}`)));
    const bJobs = [await stop('b', 'prod', 'quiet-b1'), await stop('b', 'dev', 'quiet-b2')];
    const list = async (token: string) => ((await (await fetch(`${api.base}/v1/attention?limit=500`, { headers: { authorization: `Bearer ${token}` } })).json()) as { items: { lease: { leaseId: string }; reasons: string[]; detail: string }[] }).items;
    await readUntil(async () => (await list(B)).length === 2, 10_000, "B's lanes quiet");

    const { result: bItems, seen } = await apiCommandsDuring(bed, redis.url, () => list(B));
    expect(bItems.map((i) => `${i.lease.leaseId} ${i.reasons.join(',')}`).sort()).toEqual(['quiet-b1 blocked', 'quiet-b2 blocked']);
    expect(bItems.find((i) => i.lease.leaseId === 'quiet-b1')!.detail).toBe(`stop ${bJobs[0]} is ready but no worker has picked it up`);
    // None of A's lanes or jobs read (before: each lane's list and holder, and its head job).
    const aLanes = await Promise.all(Array.from({ length: 300 }, (_, i) => bed.ops.laneOf(leaseOf('a', 'env', `quiet-${i}`))));
    const aKeys = new Set([...aJobs.map((id) => bed.ops.queue.toKey(id)), ...aLanes.flatMap((laneId) => [bed.ops.lanes.listKey(laneId), bed.ops.lanes.execKey(laneId)])]);
    expect(seen.filter((c) => c.args.slice(1).some((arg) => aKeys.has(arg))).map((c) => c.args.slice(0, 2).join(' '))).toEqual([]);
    expect(seen.length).toBeLessThan(60);

    // An environment's token sees its own; A and the admin see theirs, as before.
    expect((await list(`${B}-prod`)).map((i) => i.lease.leaseId)).toEqual(['quiet-b1']);
    const aItems = await list(A);
    expect(aItems).toHaveLength(300);
    expect(aItems.every((i) => i.reasons.join() === 'blocked' && i.lease.leaseId.startsWith('quiet-'))).toBe(true);
    expect((await api.client.leasesNeedingAttention(500)).filter((i) => i.reasons.includes('blocked'))).toHaveLength(302);
  });
});

describe('noisy neighbours: the index of operations by deadline, attacked (helper-33)', () => {
  let bed: TestBed;
  let redis: RedisProcess;
  const leaseOf = (leaseId: string, environmentId = 'prod') => ({ provider: 'recording', companyId: 'b', environmentId, leaseId });

  beforeAll(async () => {
    redis = await RedisProcess.start();
    bed = await TestBed.create({ REDIS_URL: redis.url, LEASE_OPS_SWEEP_INTERVAL_MS: '200' });
  });

  afterAll(async () => {
    await bed?.close();
    await redis?.stop();
  });

  it("scores a job that a retry with its idempotency key adopted by the deadline it was stored with, not the retry's", async () => {
    const client = new LeaseOpsClient(bed.config);
    try {
      const push = client.ops.lanes.push.bind(client.ops.lanes);
      client.ops.lanes.push = async () => {
        throw new Error('Connection is closed.'); // Redis went away between storing the job and the push
      };
      await client.enqueue('stop', leaseOf('adopted'), { providerLeaseId: 'adopted' }, { idempotencyKey: 'adopt-1', deadlineMs: 60_000 }).catch(() => undefined);
      client.ops.lanes.push = push;
      // The retry asks for ten minutes: its fingerprint leaves the deadline out.
      const retried = await client.enqueue('stop', leaseOf('adopted'), { providerLeaseId: 'adopted' }, { idempotencyKey: 'adopt-1', deadlineMs: 600_000 });
      expect(retried.deduplicated).toBe('idempotency-key');
      const stored = (await bed.ops.queue.getJob(retried.jobId))!.data.deadlineAt as number;
      expect(Number(await bed.redis.zscore(bed.ops.lanes.deadlinesKey('b'), retried.jobId))).toBe(stored);
    } finally {
      await client.close();
    }
  });

  it("finds a running operation past its deadline behind 600 entries of ended jobs while another walk takes them out between this one's reads", async () => {
    const key = bed.ops.lanes.deadlinesKey('c');
    // A job running past its deadline (no worker here: it is made to look running, its lock held), after them in the index.
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { ...leaseOf('overdue'), companyId: 'c' }, params: { providerLeaseId: 'overdue' }, deadlineMs: 300 });
    const deadline = Number(await bed.redis.zscore(key, jobId));
    await bed.redis.zadd(key, ...Array.from({ length: 600 }, (_, i) => [deadline - 10_000 + i, `gone-${String(i).padStart(3, '0')}`]).flat());
    // Waiting for a time, not an event: the deadline to pass.
    await new Promise((r) => setTimeout(r, deadline - Date.now() + 20));
    const active = `${bed.ops.queue.toKey('')}active`;
    await bed.redis.lpush(active, jobId);
    await bed.redis.set(bed.ops.lanes.lockKey(jobId), 'token', 'PX', 60_000);
    // Another walk's clean-up lands right after this walk's first read of the index.
    const zrangebyscore = Redis.prototype.zrangebyscore;
    let reads = 0;
    Redis.prototype.zrangebyscore = async function (this: Redis, ...args: Parameters<typeof zrangebyscore>) {
      const result = await (zrangebyscore as (...a: unknown[]) => Promise<string[]>).apply(this, args);
      if (String(args[0]) === key && reads++ === 0) await bed.redis.zrem(key, ...Array.from({ length: 500 }, (_, i) => `gone-${String(i).padStart(3, '0')}`));
      return result;
    } as typeof zrangebyscore;
    const client = new LeaseOpsClient(bed.config);
    try {
      const { items } = await client.attentionPage(0, 200, undefined, { companyId: 'c' });
      expect(items.map((i) => i.detail)).toEqual([`stop ${jobId} is still running past its deadline`]);
    } finally {
      Redis.prototype.zrangebyscore = zrangebyscore;
      await client.close();
      await bed.redis.lrem(active, 0, jobId);
    }
  });

  it("does not scan every company's running list for the company's own operations past their deadline that wait, queued or at their lane's head for a worker; and a lockless one in BullMQ's active list runs for neither list (helper-34, helper-35)", async () => {
    const queued = { ...leaseOf('queued'), companyId: 'd' };
    const laneId = await bed.ops.laneOf(queued);
    await bed.ops.lanes.pause(laneId, 'd', Date.now(), queued);
    // 30 behind one paused head, and 30 at the head of lanes of their own, handed off to a worker that never comes.
    const behind = await Promise.all(Array.from({ length: 30 }, () => bed.ops.enqueue({ op: 'resume', lease: queued, params: { providerLeaseId: 'queued', leaseMetadata: {} }, deadlineMs: 300 }).then((r) => r.jobId)));
    const heads = await Promise.all(Array.from({ length: 30 }, (_, i) => bed.ops.enqueue({ op: 'stop', lease: { ...queued, leaseId: `head-${i}` }, params: { providerLeaseId: `head-${i}` }, deadlineMs: 300 }).then((r) => r.jobId)));
    const key = bed.ops.lanes.deadlinesKey('d');
    const deadline = Math.max(...(await Promise.all([...behind, ...heads].map(async (id) => Number(await bed.redis.zscore(key, id))))));
    // One of the heads taken by a worker that died: in BullMQ's active list, its lock gone.
    const active = `${bed.ops.queue.toKey('')}active`;
    await bed.redis.lpush(active, heads[0]!);
    // Waiting for a time, not an event: the deadlines to pass (no worker drops them here).
    await new Promise((r) => setTimeout(r, deadline - Date.now() + 20));
    expect(await bed.redis.zcount(key, '-inf', Date.now())).toBe(60);
    const lpos = async () => Number(/cmdstat_lpos:calls=(\d+)/.exec(await bed.redis.info('commandstats'))?.[1] ?? 0);
    const client = new LeaseOpsClient(bed.config);
    try {
      const before = await lpos();
      const { items } = await client.attentionPage(0, 200, undefined, { companyId: 'd' });
      expect((await lpos()) - before).toBe(0);
      expect(items.filter((i) => i.reasons.includes('blocked'))).toEqual([]);
      // The admin's list judges running the same way: not that one either.
      const all = (await client.attentionPage(0, 500)).items;
      expect(all.filter((i) => i.lease?.companyId === 'd' && i.reasons.includes('blocked'))).toEqual([]);
    } finally {
      await bed.redis.lrem(active, 0, heads[0]!);
      await client.close();
    }
  });

  it("looks at a company that only holds bytes though more than 20 have work (helper-34: the 20 at work took every turn)", async () => {
    await Promise.all(Array.from({ length: 25 }, (_, i) => bed.ops.enqueue({ op: 'stop', lease: { ...leaseOf('busy'), companyId: `w${i}` }, params: { providerLeaseId: 'busy' }, deadlineMs: 600_000 })));
    await bed.redis.hset(bed.ops.bytes.heldKey, 'z', 1024);
    const key = bed.ops.lanes.deadlinesKey('z');
    await bed.redis.zadd(key, Date.now() + 60_000, 'removed-long-ago');
    // Companies are drawn at random: without a turn for those holding bytes, none in 50 rounds.
    for (let round = 0; round < 50 && (await bed.redis.zcard(key)) > 0; round++) await bed.ops.lanes.tidyDeadlines(bed.ops.bytes.heldKey);
    expect(await bed.redis.zcard(key)).toBe(0);
  });

  it('takes entries out whose jobs an operator removed in Bull Board, whether or not anyone reads the list: the sweep does', async () => {
    const laneId = await bed.ops.laneOf(leaseOf('removed'));
    await bed.ops.lanes.pause(laneId, 'b', Date.now(), leaseOf('removed'));
    const jobIds = await Promise.all(Array.from({ length: 44 }, () => bed.ops.enqueue({ op: 'resume', lease: leaseOf('removed'), params: { providerLeaseId: 'removed', leaseMetadata: {} } }).then((r) => r.jobId)));
    const key = bed.ops.lanes.deadlinesKey('b');
    expect(await bed.redis.zcard(key)).toBeGreaterThanOrEqual(44);
    for (const jobId of jobIds.slice(4)) await bed.ops.queue.remove(jobId);
    const worker = await bed.startWorker(createRecordingProvider({ behaviour: () => 'ok' }).provider);
    try {
      const left = await readUntil(async () => {
        const members = await bed.redis.zrange(key, 0, -1);
        return members.filter((m) => jobIds.includes(m)).length === 4 ? members : null;
      }, 15_000, "the removed jobs' entries to go");
      expect(left.filter((m) => jobIds.includes(m)).sort()).toEqual(jobIds.slice(0, 4).sort());
    } finally {
      await worker.close();
    }
  });
});

describe("noisy neighbours: a company's request rates", () => {
  let bed: TestBed;
  let api: TestApi;
  const ADMIN = 'neighbour-admin-token-0123456789';

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: ADMIN }]),
      LEASE_OPS_API_COMPANY_RATES: JSON.stringify({ walk: { perSecond: 1, burst: 3 }, read: { perSecond: 1, burst: 5 }, write: { perSecond: 1, burst: 2 } }),
    });
    api = await startTestApi(bed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
  });

  it('refuses a company past its rate for a class of request, before reading anything; another company, and an admin, are not held to it', async () => {
    const get = (token: string, path: string) => fetch(`${api.base}${path}`, { headers: { authorization: `Bearer ${token}` } });
    // Walks: a burst of 3, then refused with a Retry-After.
    const walks = [];
    for (let i = 0; i < 5; i++) walks.push(await get(A, '/v1/attention'));
    expect(walks.map((r) => r.status)).toEqual([200, 200, 200, 429, 429]);
    // The wait (1 s) and up to 2 s more at random: refused together, A's clients come back apart.
    expect(['1', '2', '3']).toContain(walks[3]!.headers.get('retry-after'));
    expect(((await walks[3]!.json()) as { error: { code: string } }).error.code).toBe('company_rate_limited');

    // Express matches a route whatever its case: so does the class (the attack on the change
    // walked at the read rate as /v1/ATTENTION, /ui/Attention and .../TIMELINE).
    for (const path of ['/v1/ATTENTION', '/v1/Attention/', '/ui/Attention', '/v1/leases/recording/a/env/l/TIMELINE', '/UI/leases/recording/a/env/l']) {
      expect([path, (await get(A, path)).status]).toEqual([path, 429]);
    }
    // A walk's class is read off the path Express routes on: a fragment (which fetch drops) or
    // an absolute-form target does not make a walk a read (helper-53: /v1/attention#x was one).
    for (const target of ['/v1/attention#x', '/v1/leases/recording/a/env/l/timeline#x', 'http://x/v1/attention']) {
      expect([target, (await rawRequest(api.base, A, `GET ${target} HTTP/1.1`)).status]).toEqual([target, 429]);
    }
    // Reads are a class of their own: A still reads its lease.
    expect((await get(A, '/v1/leases/recording/a/env/l')).status).toBe(200);
    // B is not A; an admin is not limited.
    expect((await get(B, '/v1/attention')).status).toBe(200);
    for (let i = 0; i < 6; i++) expect((await get(ADMIN, '/v1/attention')).status).toBe(200);
    // The refusals are counted on /metrics.
    expect(await (await fetch(`${api.base}/metrics`)).text()).toMatch(/^lease_ops_api_rate_limited_total 10$/m);
  });
});

describe("noisy neighbours: a refused company's clients come back apart", () => {
  it("tells each request refused for its rate its wait and 0-2 s more at random (one company's burst does not come back at once)", () => {
    // A fixed clock: every request below finds the bucket empty, with 1 s to wait for a token.
    let draw = 0;
    const draws = [0, 0.4, 0.7, 0.99, 0.34];
    const rates = new CompanyRateLimiter({ ...DEFAULT_COMPANY_RATES, walk: { perSecond: 1, burst: 1 } }, () => 0, () => draws[draw++ % draws.length]!);
    rates.take('a', 'walk');
    const waits = draws.map(() => {
      try {
        rates.take('a', 'walk');
        return null;
      } catch (err) {
        return (err as HttpError).opts.retryAfterS;
      }
    });
    expect(waits).toEqual([1, 2, 3, 3, 2]);
  });
  it('tells each wait refused for a full budget 1 s and 0-2 s more at random', () => {
    let draw = 0;
    const draws = [0, 0.5, 0.9];
    const budget = new WaitBudget({ perCompany: 0, total: 10 }, () => draws[draw++]!);
    const waits = draws.map(() => {
      try {
        budget.takeOrRefuse('a');
        return null;
      } catch (err) {
        return (err as HttpError).opts.retryAfterS;
      }
    });
    expect(waits).toEqual([1, 2, 3]);
  });
});

/** A's operation waiting in its paused lane (`held`), its lease's URL, and A's headers. */
async function heldOperation(api: TestApi): Promise<{ headers: Record<string, string>; lease: string; jobId: string }> {
  const headers = { authorization: `Bearer ${A}`, 'content-type': 'application/json' };
  const lease = `${api.base}/v1/leases/recording/a/env/held`;
  expect((await fetch(`${lease}/pause`, { method: 'POST', headers })).status).toBe(200);
  const { jobId } = (await (await fetch(`${lease}/operations`, { method: 'POST', headers, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'held' } }) })).json()) as { jobId: string };
  return { headers, lease, jobId };
}

describe('noisy neighbours: long polls begun together end apart', () => {
  it('holds a wait up to a tenth less than asked, at random', () => {
    const draws = [0, 0.5, 0.999];
    let draw = 0;
    const budget = new WaitBudget({ perCompany: 1, total: 1 }, () => draws[draw++]!);
    expect(draws.map(() => budget.spread(30_000))).toEqual([30_000, 28_500, 27_003]);
  });

  it("holds each of a company's long polls and Prefer: wait for its own spread time, not all for the same", async () => {
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]) });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    try {
      const { headers, lease, jobId } = await heldOperation(api);
      // What each wait is held for, answered at once (the waits' ends are not what is tested).
      const held: number[] = [];
      const client = api.client;
      const read = client.getOperation.bind(client);
      client.waitForEndOf = async (id, waitMs) => (held.push(waitMs), read(id));
      for (let i = 0; i < 6; i++) expect((await fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers })).status).toBe(200);
      for (let i = 0; i < 6; i++) {
        const res = await fetch(`${lease}/operations`, { method: 'POST', headers: { ...headers, prefer: 'wait=20' }, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'held' } }) });
        expect(res.status).toBe(202);
        // The preference is applied: a wait of up to 20 s, which ending early keeps.
        expect(res.headers.get('preference-applied')).toBe('wait=20');
      }
      expect(held).toHaveLength(12);
      for (const ms of held) expect(ms).toBeGreaterThanOrEqual(18_000), expect(ms).toBeLessThanOrEqual(20_000);
      // Twelve draws: the same time for all of them is a chance of 1 in 2,000^11.
      expect(new Set(held.slice(0, 6)).size).toBeGreaterThan(1);
      expect(new Set(held.slice(6)).size).toBeGreaterThan(1);
    } finally {
      await api.close();
      await bed.close();
    }
  });
});

describe('noisy neighbours: long polls on one operation that ends', () => {
  it('answers a wait on an operation removed meanwhile (an operator, in Bull Board) at once, not found, not when the wait runs out (helper-54)', async () => {
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]) });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    try {
      const { headers, jobId } = await heldOperation(api);
      const started = Date.now();
      const poll = fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers });
      const waits = async () => Number(/^lease_ops_api_waits\{of="all"\} (\d+)$/m.exec(await (await fetch(`${api.base}/metrics`)).text())?.[1] ?? NaN);
      while ((await waits()) !== 1) await new Promise((r) => setImmediate(r));
      // Listening for its end (its wait is counted before it listens).
      const queueEvents = await api.client.partitions[0]!.queueEvents();
      while (queueEvents.listenerCount(`failed:${jobId}`) < 1) await new Promise((r) => setImmediate(r));
      // The stream the client exports says what BullMQ said, and no more (helper-55: a removal was told as a failure).
      const told: string[] = [];
      for (const name of ['failed', 'removed']) (queueEvents as unknown as EventEmitter).on(`${name}:${jobId}`, () => told.push(name));
      await bed.ops.queue.remove(jobId);
      expect((await poll).status).toBe(404);
      expect(Date.now() - started).toBeLessThan(10_000);
      expect(await waits()).toBe(0);
      expect(told).toEqual(['removed']);
    } finally {
      await api.close();
      await bed.close();
    }
  });

  it("answers a wait on an operation a bulk clean removed (Bull Board's clean: one event that names no job) at once, not found", async () => {
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]) });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    try {
      const { headers, jobId } = await heldOperation(api);
      const state = await (await bed.ops.queue.getJob(jobId))!.getState();
      const started = Date.now();
      const poll = fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers });
      const queueEvents = await api.client.partitions[0]!.queueEvents();
      while (queueEvents.listenerCount(`failed:${jobId}`) < 1) await new Promise((r) => setImmediate(r));
      expect(await bed.ops.queue.clean(0, 1_000, state as 'delayed')).toContain(jobId);
      expect((await poll).status).toBe(404);
      expect(Date.now() - started).toBeLessThan(10_000);
      expect(queueEvents.listenerCount('cleaned')).toBe(0);
    } finally {
      await api.close();
      await bed.close();
    }
  });

  it('decides a wait by what the view reads of its job (helper-54): data that is no operation is not found for its company, and an admin waits on it', async () => {
    const ADMIN = 'neighbour-admin-token-0123456789';
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: ADMIN }]) });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    try {
      const { headers, jobId } = await heldOperation(api);
      const reads: string[] = [];
      for (const partition of api.client.partitions) {
        const read = partition.inspector.operation.bind(partition.inspector);
        partition.inspector.operation = async (id) => (reads.push(id), read(id));
      }
      const poll = (token: string, id = jobId, waitMs = 300) => fetch(`${api.base}/v1/operations/${encodeURIComponent(id)}${waitMs ? `?waitMs=${waitMs}` : ''}`, { headers: { ...headers, authorization: `Bearer ${token}` } });
      // No such job: not found after the one read another company's job takes, no view read.
      expect((await poll(B, `${jobId.split('.')[0]}.nosuchjob`)).status).toBe(404);
      expect((await poll(B)).status).toBe(404);
      expect(reads).toEqual([]);
      // Its data with a field no operation has (a newer version's, say): the view reads no lease in it.
      const key = bed.ops.queue.toKey(jobId);
      const data = JSON.parse((await bed.redis.hget(key, 'data'))!) as Record<string, unknown>;
      await bed.redis.hset(key, 'data', JSON.stringify({ ...data, unknownField: 1 }));
      expect((await poll(A, jobId, 0)).status).toBe(404);
      expect((await poll(A)).status).toBe(404);
      // The admin sees it, and waits on it as on any unfinished operation.
      const started = Date.now();
      const admin = await poll(ADMIN);
      expect(admin.status).toBe(200);
      expect(((await admin.json()) as { state: string; lease: unknown }).lease).toBeNull();
      expect(Date.now() - started).toBeGreaterThanOrEqual(250);
    } finally {
      await api.close();
      await bed.close();
    }
  });

  it("reads a waiting operation's view once, when its wait ends, not before it too (a long poll, Prefer: wait)", async () => {
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }]) });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    try {
      const { headers, lease, jobId } = await heldOperation(api);
      const reads: string[] = [];
      for (const partition of api.client.partitions) {
        const read = partition.inspector.operation.bind(partition.inspector);
        partition.inspector.operation = async (id) => (reads.push(id), read(id));
      }
      const poll = await fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=300`, { headers });
      expect(poll.status).toBe(200);
      expect(((await poll.json()) as { state: string }).state).toBe('paused');
      expect(reads).toEqual([jobId]);
      const preferred = await fetch(`${lease}/operations`, { method: 'POST', headers: { ...headers, prefer: 'wait=1' }, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'held' } }) });
      expect(preferred.status).toBe(202);
      const second = ((await preferred.json()) as { jobId: string }).jobId;
      expect(reads).toEqual([jobId, second]);
      // Its scope is still checked before it waits: B's poll of A's operation is not found at once.
      const started = Date.now();
      expect((await fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers: { authorization: `Bearer ${B}` } })).status).toBe(404);
      expect(Date.now() - started).toBeLessThan(10_000);
      expect(reads).toEqual([jobId, second]);
    } finally {
      await api.close();
      await bed.close();
    }
  });

  it('answers every wait on an operation from one read of it after its end (helper-31: one read each, at once)', async () => {
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]), LEASE_OPS_API_MAX_WAITS_PER_COMPANY: '50', LEASE_OPS_API_MAX_WAITS: '50' });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    const worker = await bed.startWorker(createRecordingProvider().provider);
    try {
      const headers = { authorization: `Bearer ${A}`, 'content-type': 'application/json' };
      const lease = `${api.base}/v1/leases/recording/a/env/herd`;
      expect((await fetch(`${lease}/pause`, { method: 'POST', headers })).status).toBe(200);
      const { jobId } = (await (await fetch(`${lease}/operations`, { method: 'POST', headers, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'herd' } }) })).json()) as { jobId: string };
      const polls = Array.from({ length: 20 }, () => fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers }));
      const waits = async () => Number(/^lease_ops_api_waits\{of="all"\} (\d+)$/m.exec(await (await fetch(`${api.base}/metrics`)).text())?.[1] ?? NaN);
      for (const deadline = Date.now() + 10_000; (await waits()) !== 20; ) {
        if (Date.now() > deadline) throw new Error('never: 20 waits held');
        await new Promise((r) => setImmediate(r));
      }
      // Two waits through the library too: each gets a view of its own (helper-32: one object, shared).
      const inProcess = [api.client.getOperation(jobId, { waitMs: 20_000 }), api.client.getOperation(jobId, { waitMs: 20_000 })];
      const queueEvents = await api.client.partitions[0]!.queueEvents();
      for (const deadline = Date.now() + 10_000; queueEvents.listenerCount(`completed:${jobId}`) < 22; ) {
        if (Date.now() > deadline) throw new Error('never: the 22 waits listening');
        await new Promise((r) => setImmediate(r));
      }
      // Reads of the operation's view from here on.
      let reads = 0;
      for (const partition of api.client.partitions) {
        const read = partition.inspector.operation.bind(partition.inspector);
        partition.inspector.operation = async (id) => (id === jobId && reads++, read(id));
      }
      expect((await fetch(`${lease}/unpause`, { method: 'POST', headers })).status).toBe(200);
      const answers = await Promise.all(polls.map(async (poll) => ((await (await poll).json()) as { state: string }).state));
      expect(answers).toEqual(Array.from({ length: 20 }, () => 'completed'));
      const [first, second] = await Promise.all(inProcess);
      expect(first).toEqual(second);
      expect(first).not.toBe(second);
      expect(reads).toBe(1);
    } finally {
      await worker.close();
      await api.close();
      await bed.close();
    }
  });
});

describe("noisy neighbours: a change's body counts against its company's rate", () => {
  it('costs a change one token more for each 4 KiB of its body: 16 KiB of metadata is 5 small enqueues', async () => {
    const bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]),
      LEASE_OPS_API_COMPANY_RATES: JSON.stringify({ write: { perSecond: 0.001, burst: 10 } }),
    });
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const api = await startTestApi(bed);
    try {
      const enqueue = async (leaseId: string, metadataBytes: number) => {
        const params = { providerLeaseId: leaseId, ...(metadataBytes ? { leaseMetadata: { blob: 'x'.repeat(metadataBytes) } } : {}) };
        const res = await fetch(`${api.base}/v1/leases/recording/a/env/${leaseId}/operations`, {
          method: 'POST',
          headers: { authorization: `Bearer ${A}`, 'content-type': 'application/json' },
          body: JSON.stringify({ op: 'resume', params }),
        });
        return res.status === 429 ? (((await res.json()) as { error: { code: string } }).error.code) : res.status;
      };
      // 10 tokens: 1 for a small one, 5 for 16 KiB, then 16 KiB is refused (4 left), a small one is not.
      expect([await enqueue('l1', 0), await enqueue('l2', 16_340), await enqueue('l3', 16_340), await enqueue('l4', 0)]).toEqual([202, 202, 'company_rate_limited', 202]);
      // A gzipped body counts as the most it may inflate to (64 KiB: 17 tokens, capped at the
      // burst of 10), not its few compressed bytes: refused with 3 tokens left.
      const gzipped = await fetch(`${api.base}/v1/leases/recording/a/env/l5/operations`, {
        method: 'POST',
        headers: { authorization: `Bearer ${A}`, 'content-type': 'application/json', 'content-encoding': 'gzip' },
        body: gzipSync(JSON.stringify({ op: 'resume', params: { providerLeaseId: 'l5', leaseMetadata: { blob: 'x'.repeat(16_340) } } })),
      });
      expect(gzipped.status).toBe(429);
    } finally {
      await api.close();
      await bed.close();
    }
  });
});

describe("noisy neighbours: a company's refusals in the log", () => {
  it('logs a company refused at its budget once, then a count per interval, not a line a request; other 4xx stay one line each', async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'info', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]),
      LEASE_OPS_API_COMPANY_RATES: JSON.stringify({ read: { perSecond: 1, burst: 1 } }),
    });
    const api = await startTestApi(bed, log);
    try {
      const statuses = [];
      for (let i = 0; i < 20; i++) statuses.push((await fetch(`${api.base}/v1/leases/recording/a/env/l`, { headers: { authorization: `Bearer ${A}` } })).status);
      expect(statuses.filter((s) => s === 429)).toHaveLength(19);
      // A request's line names its company.
      expect(lines.filter((l) => (l.res as { statusCode?: number } | undefined)?.statusCode === 200)).toEqual([expect.objectContaining({ companyId: 'a' })]);
      const refusedLines = lines.filter((l) => (l.res as { statusCode?: number } | undefined)?.statusCode === 429 || l.code === 'company_rate_limited');
      expect(refusedLines).toEqual([expect.objectContaining({ level: 40, companyId: 'a', code: 'company_rate_limited' })]);
      // Another 4xx is still a line of its own.
      await fetch(`${api.base}/v1/leases/recording/a/env/l`, { headers: { authorization: 'Bearer not-a-token-0123456789' } });
      expect(lines.filter((l) => (l.res as { statusCode?: number } | undefined)?.statusCode === 401)).toHaveLength(1);
    } finally {
      await api.close();
      await bed.close();
    }
  });

  it("logs a request that waited in its company's line with the time it waited, and one whose caller hung up there as aborted (helper-53)", async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'info', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]), LEASE_OPS_API_REQUESTS_PER_COMPANY: '1' });
    const api = await startTestApi(bed, log);
    const { port } = new URL(api.base);
    const sockets: Socket[] = [];
    const open = async (text: string) => {
      const socket = connect(Number(port), '127.0.0.1');
      socket.on('error', () => undefined);
      sockets.push(socket);
      await once(socket, 'connect');
      socket.write(text);
      return socket;
    };
    const waiting = async () => Number(/^lease_ops_api_requests\{state="waiting"\} (\d+)$/m.exec(await (await fetch(`${api.base}/metrics`)).text())?.[1]);
    const lineFor = async (url: string) => {
      for (const deadline = Date.now() + 10_000; Date.now() < deadline; await new Promise((r) => setTimeout(r, 20))) {
        const line = lines.find((l) => (l.req as { url?: string } | undefined)?.url === url);
        if (line) return line;
      }
      throw new Error(`no line for ${url}`);
    };
    try {
      // A change whose body never comes holds A's one turn.
      const holder = await open(`POST /v1/leases/recording/a/env/l1/operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{`);
      const leaving = await open(`GET /v1/leases/recording/a/env/leaving HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\n\r\n`);
      await open(`GET /v1/leases/recording/a/env/staying HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${A}\r\n\r\n`);
      while ((await waiting()) !== 2) await new Promise((r) => setImmediate(r));
      leaving.destroy();
      expect(await lineFor('/v1/leases/recording/a/env/leaving')).toMatchObject({ msg: 'request aborted' });
      await new Promise((r) => setTimeout(r, 300));
      holder.destroy();
      const stayed = await lineFor('/v1/leases/recording/a/env/staying');
      expect(stayed).toMatchObject({ msg: 'request completed' });
      // Its time counts from its arrival, its 300 ms and more in line included.
      expect(stayed.responseTime as number).toBeGreaterThanOrEqual(300);
    } finally {
      for (const socket of sockets) socket.destroy();
      await api.close();
      await bed.close();
    }
  });

  it('tells the count since the last line when the API closes (helper-16: lost at SIGTERM)', async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'warn', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const bed = await TestBed.create({});
    const config = loadConfig({ REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]), LEASE_OPS_API_COMPANY_RATES: JSON.stringify({ read: { perSecond: 1, burst: 1 } }) });
    const server = await startApiServer(config, log);
    try {
      for (let i = 0; i < 6; i++) await (await fetch(`${server.url}/v1/leases/recording/a/env/l`, { headers: { authorization: `Bearer ${A}` } })).arrayBuffer();
    } finally {
      await server.close();
      await bed.close();
    }
    expect(lines.filter((l) => l.code === 'company_rate_limited').map((l) => l.refused)).toEqual([undefined, 4]);
  });

  it("logs a request that Redis did not answer in time (503 redis_unavailable) as one warning with its code, not two errors with stacks (helper-38)", { timeout: 20_000 }, async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'info', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const redis = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: redis.url, LEASE_OPS_REDIS_TIMEOUT_MS: '300', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]) });
    const api = await startTestApi(bed, log);
    const pauser = new Redis(redis.url);
    try {
      const read = () => fetch(`${api.base}/v1/leases/recording/a/env/slow`, { headers: { authorization: `Bearer ${A}` } });
      expect((await read()).status).toBe(200);
      await pauser.client('PAUSE', 1_500, 'ALL');
      const res = await read();
      expect(res.status).toBe(503);
      expect(((await res.json()) as { error: { code: string } }).error.code).toBe('redis_unavailable');
      const told = lines.filter((l) => (l.res as { statusCode?: number } | undefined)?.statusCode === 503 || l.msg === 'request failed');
      expect(told.map((l) => ({ level: l.level, code: l.code, companyId: l.companyId, stack: JSON.stringify(l).includes('stack') }))).toEqual([{ level: 40, code: 'redis_unavailable', companyId: 'a', stack: false }]);
    } finally {
      pauser.disconnect();
      await api.close();
      await bed.close();
      await redis.stop();
    }
  });

  it("answers a request still in progress at the close's 2 s cut 503 client_closed, with Retry-After and Connection: close, logged as one warning, where its socket was cut unanswered (helper-37)", { timeout: 20_000 }, async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'info', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const redis = await RedisProcess.start();
    const config = loadConfig({ REDIS_URL: redis.url, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]), LEASE_OPS_REDIS_TIMEOUT_MS: '10000' });
    const server = await startApiServer(config, log);
    const pauser = new Redis(redis.url);
    try {
      const read = () => fetch(`${server.url}/v1/leases/recording/a/env/held-up`, { headers: { authorization: `Bearer ${A}` } });
      expect((await read()).status).toBe(200);
      // An enqueue accepted and waiting (no worker here), with no idempotency key.
      const preferred = fetch(`${server.url}/v1/leases/recording/a/env/waited/operations`, {
        method: 'POST',
        headers: { authorization: `Bearer ${A}`, 'content-type': 'application/json', prefer: 'wait=20' },
        body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'waited' } }),
      });
      await readUntil(async () => /^lease_ops_api_waits\{of="all"\} 1$/m.test(await (await fetch(`${server.url}/metrics`)).text()), 10_000, 'the enqueue to wait');
      // Redis holds every command for 8 s: the next read is in progress when the API closes,
      // and so is the read that answers the enqueue's wait.
      await pauser.client('PAUSE', 8_000, 'ALL');
      const inProgress = read();
      // The API has taken it once it answered a request sent after it (its health, no Redis).
      expect((await fetch(`${server.url}/healthz`)).status).toBe(200);
      const t0 = Date.now();
      const closing = server.close();
      const res = await inProgress;
      expect(Date.now() - t0).toBeLessThan(4_000);
      expect(res.status).toBe(503);
      expect(res.headers.get('retry-after')).toBe('1');
      expect(res.headers.get('connection')).toBe('close');
      expect(((await res.json()) as { error: { code: string } }).error.code).toBe('client_closed');
      // Accepted, so told so: a 503 would have this caller enqueue it again (helper-38).
      const accepted = await preferred;
      expect(accepted.status).toBe(202);
      expect(((await accepted.json()) as { jobId?: string }).jobId).toEqual(expect.any(String));
      await closing;
      const told = lines.filter((l) => l.code === 'client_closed' || (l.res as { statusCode?: number } | undefined)?.statusCode === 503);
      expect(lines.filter((l) => Number(l.level) >= 50)).toEqual([]);
      expect(told.map((l) => ({ level: l.level, code: l.code, companyId: l.companyId, stack: JSON.stringify(l).includes('stack') }))).toEqual([{ level: 40, code: 'client_closed', companyId: 'a', stack: false }]);
    } finally {
      pauser.disconnect();
      await redis.stop();
    }
  });

  it("answers the waits pending when the API closes at once, as waits whose time ran out: a long poll with the operation, Prefer: wait with its 202 receipt (helper-34: cut after 2 s, unanswered)", async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'warn', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const bed = await TestBed.create({});
    const config = loadConfig({ REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_QUEUE: bed.config.LEASE_OPS_QUEUE, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]) });
    const server = await startApiServer(config, log);
    let closing: Promise<void> | undefined;
    try {
      // No worker: the operations stay queued, and their waits wait.
      const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'a', environmentId: 'env', leaseId: 'polled' }, params: { providerLeaseId: 'polled' } });
      const poll = fetch(`${server.url}/v1/operations/${jobId}?waitMs=20000`, { headers: { authorization: `Bearer ${A}` } });
      const preferred = fetch(`${server.url}/v1/leases/recording/a/env/preferred/operations`, {
        method: 'POST',
        headers: { authorization: `Bearer ${A}`, 'content-type': 'application/json', prefer: 'wait=20' },
        body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'preferred' } }),
      });
      await readUntil(async () => /^lease_ops_api_waits\{of="all"\} 2$/m.test(await (await fetch(`${server.url}/metrics`)).text()), 10_000, 'both to wait');
      closing = server.close();
      const [polled, accepted] = await Promise.all([poll, preferred]);
      expect(polled.status).toBe(200);
      expect(((await polled.json()) as { jobId: string; state: string })).toMatchObject({ jobId, state: 'ready' });
      // Accepted, and told so: a 503 here would have a caller without an idempotency key enqueue it again.
      expect(accepted.status).toBe(202);
      const receipt = (await accepted.json()) as { jobId: string };
      expect((await bed.ops.queue.getJob(receipt.jobId))?.data.op).toBe('stop');
      await closing;
    } finally {
      await (closing ?? server.close());
      await bed.close();
    }
    expect(lines.filter((l) => Number(l.level) >= 50)).toEqual([]);
  });

  it("logs a request its API's closing cut short (503 client_closed, an answer it chose) as a warning, not an error (it was an error line per request)", async () => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level: 'info', destination: { write: (t: string) => void lines.push(JSON.parse(t) as Record<string, unknown>) } });
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }]) });
    const api = await startTestApi(bed, log);
    try {
      await api.client.close(); // as the API's close does, before its server stops
      const cut = await fetch(`${api.base}/v1/leases/recording/a/env/l`, { headers: { authorization: `Bearer ${A}` } });
      expect(cut.status).toBe(503);
      expect(((await cut.json()) as { error: { code: string } }).error.code).toBe('client_closed');
      const access = lines.filter((l) => (l.res as { statusCode?: number } | undefined)?.statusCode === 503);
      expect(access.map((l) => l.level)).toEqual([40]);
      expect(lines.filter((l) => Number(l.level) >= 50)).toEqual([]);
    } finally {
      await api.close();
      await bed.close();
    }
  });

  it('tells the count of a company and code at the end of each interval', async () => {
    const lines: Record<string, unknown>[] = [];
    let told: () => void = () => undefined;
    const counted = new Promise<void>((resolve) => (told = resolve));
    const log = createLogger({
      level: 'warn',
      destination: {
        write: (t: string) => {
          const line = JSON.parse(t) as Record<string, unknown>;
          lines.push(line);
          if (line.refused !== undefined) told();
        },
      },
    });
    const refusals = new RefusalLog(log, 50);
    for (let i = 0; i < 5; i++) refusals.note('a', 'company_rate_limited');
    refusals.note('b', 'company_waits_full');
    await counted;
    expect(lines.map((l) => [l.companyId, l.code, l.refused])).toEqual([
      ['a', 'company_rate_limited', undefined],
      ['b', 'company_waits_full', undefined],
      ['a', 'company_rate_limited', 4],
    ]);
  });
});

describe('noisy neighbours: idle connections (LEASE_OPS_API_MAX_CONNECTIONS)', () => {
  /** Opens a TCP connection to `url` that sends nothing (or only part of a request's headers). */
  async function silentSocket(url: string, partial?: string): Promise<Socket> {
    const { hostname, port } = new URL(url);
    const socket = connect(Number(port), hostname);
    socket.on('error', () => undefined);
    await once(socket, 'connect');
    if (partial) socket.write(partial);
    return socket;
  }

  it('lets a new connection in when every connection is taken by idle ones: the longest idle goes, one with a request in progress stays', async () => {
    const bed = await TestBed.create({});
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    const config = loadConfig({
      REDIS_URL: bed.config.REDIS_URL,
      LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX,
      LEASE_OPS_API_PORT: '0',
      LEASE_OPS_API_HOST: '127.0.0.1',
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }]),
      LEASE_OPS_API_MAX_CONNECTIONS: '20',
      LEASE_OPS_API_MAX_WAITS: '5',
    });
    const server = await startApiServer(config, createLogger({ level: 'silent' }));
    const sockets: Socket[] = [];
    try {
      // B holds a long poll on its paused lane: a connection with a request in progress.
      const lease = `${server.url}/v1/leases/recording/b/env/held`;
      expect((await fetch(`${lease}/pause`, { method: 'POST', headers: { authorization: `Bearer ${B}` } })).status).toBe(200);
      const enqueued = await fetch(`${lease}/operations`, { method: 'POST', headers: { authorization: `Bearer ${B}`, 'content-type': 'application/json' }, body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'held' } }) });
      const { jobId } = (await enqueued.json()) as { jobId: string };
      const poll = new AbortController();
      const polled = fetch(`${server.url}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers: { authorization: `Bearer ${B}` }, signal: poll.signal }).then(
        (res) => res.status,
        (err: Error) => err.name,
      );
      // A takes every other connection with sockets that say nothing, or half a request.
      for (let i = 0; i < 25; i++) sockets.push(await silentSocket(server.url, i % 2 ? 'GET /v1/attention HTTP/1.1\r\nHost: x\r\n' : undefined));
      const closed = sockets.map((s) => new Promise<boolean>((resolve) => (s.destroyed ? resolve(true) : s.once('close', () => resolve(true)))));
      // Probes and B's requests get in, each time: one of A's idle sockets goes for each.
      for (let i = 0; i < 10; i++) {
        expect((await fetch(`${server.url}/healthz`)).status).toBe(200);
        expect((await fetch(`${lease}`, { headers: { authorization: `Bearer ${B}` } })).status).toBe(200);
      }
      // The oldest of A's went first, and B's long poll is still held.
      await closed[0];
      expect(sockets[0]!.destroyed).toBe(true);
      expect(sockets.at(-1)!.destroyed).toBe(false);
      const metrics = await (await fetch(`${server.url}/metrics`)).text();
      expect(Number(/^lease_ops_api_connections_closed_total\{reason="evicted"\} (\d+)$/m.exec(metrics)?.[1])).toBeGreaterThanOrEqual(6);
      expect(Number(/^lease_ops_api_connections (\d+)$/m.exec(metrics)?.[1])).toBeLessThanOrEqual(20);
      poll.abort();
      expect(await polled).toBe('AbortError');
    } finally {
      for (const s of sockets) s.destroy();
      await server.close();
      await bed.close();
    }
  });
  it("counts a request whose answer is complete as done though its client reads nothing: its connection gives way to a newcomer", () => {
    // The pool's own bookkeeping, driven as Node's server drives it: an answer a client never
    // reads is complete (ended) but never written (its response never closes).
    class FakeSocket extends EventEmitter {
      destroyed = false;
      destroy() {
        this.destroyed = true;
        this.emit('close');
      }
    }
    class FakeResponse extends EventEmitter {
      end() {
        return this;
      }
    }
    const server = new EventEmitter() as unknown as Server;
    new ConnectionPool(2).attach(server);
    const [unread, working, newcomer, last] = [new FakeSocket(), new FakeSocket(), new FakeSocket(), new FakeSocket()];
    server.emit('connection', unread);
    server.emit('connection', working);
    const answered = new FakeResponse();
    server.emit('request', { socket: unread }, answered);
    answered.end();
    server.emit('request', { socket: working }, new FakeResponse());
    server.emit('connection', newcomer);
    expect([unread.destroyed, working.destroyed, newcomer.destroyed]).toEqual([true, false, false]);
    // Every other connection with a request being worked on: the newcomer is the one closed.
    server.emit('request', { socket: newcomer }, new FakeResponse());
    server.emit('connection', last);
    expect([working.destroyed, newcomer.destroyed, last.destroyed]).toEqual([false, false, true]);
  });

  it('closes a connection with more than 16 pipelined requests unanswered, and says so in /metrics', async () => {
    const bed = await TestBed.create({});
    const config = loadConfig({ REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_API_PORT: '0', LEASE_OPS_API_HOST: '127.0.0.1' });
    const server = await startApiServer(config, createLogger({ level: 'silent' }));
    try {
      // Sixteen in one write are answered; seventeen close the connection (Node parses the
      // requests of one write all at once, before their answers can be written).
      const probe = 'GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n';
      const answers = async (n: number) => {
        const socket = await silentSocket(server.url);
        let text = '';
        socket.on('data', (d) => (text += String(d)));
        socket.write(probe.repeat(n) + (n <= 16 ? 'GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n' : ''));
        await once(socket, 'close');
        return text.split('HTTP/1.1 200').length - 1;
      };
      expect(await answers(15)).toBe(16);
      expect(await answers(17)).toBeLessThan(17);
      const metrics = await (await fetch(`${server.url}/metrics`)).text();
      expect(Number(/^lease_ops_api_connections_closed_total\{reason="over_pipelined"\} (\d+)$/m.exec(metrics)?.[1])).toBe(1);
    } finally {
      await server.close();
      await bed.close();
    }
  });
});
