import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { afterAll, describe, expect, it } from 'vitest';
import { createLogger, logFormat, prettyStream } from '../src/logger.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { LeaseWorker } from '../src/queues/worker.ts';
import { createRedis } from '../src/queues/redis.ts';
import { BIN } from './helpers/cli.ts';
import { startTestApi } from './helpers/api-server.ts';
import { readUntil, REDIS_URL, scanKeys, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// Issue 26 item 6: a person at a terminal reads pretty lines, a collector reads JSON; the
// friendly lines of `npm start` are never interleaved with raw JSON on a terminal.

const ISO = /\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z/;
const ANSI = new RegExp(String.raw`\x1b\[[0-9;]*m`, 'g');

/** `lease-ops start --once` with a misspelt setting (so it logs a warning), its output as one text. */
function startOnce(prefix: string, viaTerminal: boolean): Promise<string> {
  const env = { ...process.env, REDIS_URL, LEASE_OPS_PREFIX: prefix, LEASE_OPS_API_PORT: '0', LEASE_OPS_LOG_LEVL: 'debug', LEASE_OPS_API_TOKENS: '' };
  delete (env as Record<string, string | undefined>).LEASE_OPS_LOG_FORMAT;
  const command = `${JSON.stringify(process.execPath)} ${JSON.stringify(BIN)} start --once`;
  // util-linux `script` runs it on a pseudo-terminal, as a person's shell would.
  const child = viaTerminal ? spawn('script', ['-qfec', command, '/dev/null'], { env, stdio: ['ignore', 'pipe', 'pipe'] }) : spawn(process.execPath, [BIN, 'start', '--once'], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let text = '';
  child.stdout.on('data', (chunk: Buffer) => (text += chunk.toString()));
  child.stderr.on('data', (chunk: Buffer) => (text += chunk.toString()));
  return new Promise((resolve, reject) => {
    child.on('error', reject);
    child.on('exit', (code) => (code === 0 ? resolve(text.replace(ANSI, '').replaceAll('\r', '')) : reject(new Error(`exited ${code}:\n${text}`))));
  });
}

describe('log lines', () => {
  const prefix = `{lo-test-log-${randomBytes(3).toString('hex')}}`;

  afterAll(async () => {
    const redis = createRedis(REDIS_URL);
    for (const key of await scanKeys(redis, `${prefix}*`)) await redis.unlink(key);
    redis.disconnect();
  });

  it('are pretty on a terminal and JSON otherwise, unless LEASE_OPS_LOG_FORMAT says which', () => {
    expect(logFormat('auto', { isTTY: true })).toBe('pretty');
    expect(logFormat('auto', { isTTY: false })).toBe('json');
    expect(logFormat('auto', {})).toBe('json');
    expect(logFormat('json', { isTTY: true })).toBe('json');
    expect(logFormat('pretty', { isTTY: false })).toBe('pretty');
  });

  it('read, pretty: ISO time, level, name, message and the bound fields; secrets still redacted; an error as its type and message', () => {
    const lines: string[] = [];
    const log = createLogger({ name: 'lease-ops-worker', destination: prettyStream({ write: (t: string) => lines.push(t) }) });
    log.child({ lease: 'acme/prod/sb-1', job: 'J1', op: 'stop', attempt: 2 }).warn({ apiKey: 'sk-secret-value', err: Object.assign(new Error('socket hang up'), { code: 'ECONNRESET' }) }, 'provider call failed');
    expect(lines).toHaveLength(1);
    const [line] = lines;
    expect(line).toMatch(new RegExp(`^${ISO.source} WARN  lease-ops-worker: provider call failed  `));
    expect(line).toContain('lease=acme/prod/sb-1 job=J1 op=stop attempt=2');
    expect(line).toContain('apiKey=[redacted]');
    expect(line).toContain('err="Error ECONNRESET: socket hang up"');
    expect(line).not.toContain('sk-secret-value');
    expect(line).not.toMatch(/\n./);
    // An error line carries its stack below it, indented.
    log.error({ err: new Error('it broke') }, 'worker error');
    expect(lines[1]).toMatch(/ ERROR lease-ops-worker: worker error {2}err="Error: it broke"\n {4}at /);
  });

  it.runIf(existsSync('/usr/bin/script'))("of `lease-ops start` on a terminal are pretty among its friendly lines, with no raw JSON", async () => {
    const text = await startOnce(prefix, true);
    expect(text).toMatch(/lease-ops: API http:\/\/\S+\/v1/);
    expect(text).toMatch(/POST release\s+-> completed/);
    expect(text).toMatch(new RegExp(`^${ISO.source} WARN  lease-ops: LEASE_OPS_LOG_LEVL is not a lease-ops setting`, 'm'));
    expect(text.split('\n').filter((line) => line.trimStart().startsWith('{'))).toEqual([]);
  }, 60_000);

  it('of `lease-ops start` into a pipe are JSON, one object a line', async () => {
    const text = await startOnce(prefix, false);
    const json = text.split('\n').filter((line) => line.startsWith('{'));
    const warning = json.map((line) => JSON.parse(line) as { level: number; msg: string }).find((r) => r.msg.startsWith('LEASE_OPS_LOG_LEVL is not a lease-ops setting'));
    expect(warning?.level).toBe(40);
    expect(text).not.toMatch(new RegExp(`^${ISO.source} WARN`, 'm'));
  }, 60_000);
});

describe('a maintenance job that lost its lock', () => {
  it('is one warning with no stack (its process stalled past the lock); any other maintenance error stays an error', async ({ onTestFinished }) => {
    const bed = await TestBed.create();
    onTestFinished(() => bed.close());
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ name: 'lease-ops-worker', level: 'info', destination: { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) } });
    const worker = new LeaseWorker(bed.config, new ProviderRegistry([createRecordingProvider().provider]), log);
    onTestFinished(() => worker.close());
    const maintenance = (worker as unknown as { maintenanceWorker: { emit(event: 'error', err: Error): boolean } }).maintenanceWorker;
    // BullMQ's own words for both (test/bullmq-contract.test.ts pins them).
    maintenance.emit('error', new Error('could not renew lock for job repeat:lane-sweep:1796550000000'));
    maintenance.emit('error', new Error('Missing lock for job repeat:lane-sweep:1796550000000. moveToFinished'));
    maintenance.emit('error', new Error('ERR something else went wrong'));
    expect(lines.map((l) => [l.level, l.msg, typeof l.err])).toEqual([
      [40, 'a maintenance job (a lane sweep or watchdog scan) lost its lock while this process stalled; its schedule goes on', 'undefined'],
      [40, 'a maintenance job (a lane sweep or watchdog scan) lost its lock while this process stalled; its schedule goes on', 'undefined'],
      [50, 'maintenance worker error', 'object'],
    ]);
  });
});

// The request log (src/api/request-log.ts): pino-http built a child logger for every request,
// logged or not; about 200 µs of a /healthz answer's 880 µs of API CPU on this machine.
describe('the request log', () => {
  const TOKEN = 'request-log-token-aaaaaaaa';
  /** A logger at `level` whose lines the test reads, and how many child loggers were made of it. */
  const counted = (level: string) => {
    const lines: Record<string, unknown>[] = [];
    const log = createLogger({ level, destination: { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) } });
    const made = { children: 0 };
    const child = log.child.bind(log);
    log.child = ((...args: Parameters<typeof child>) => (made.children++, child(...args))) as typeof log.child;
    return { lines, log, made };
  };

  it('writes one line per answered request, with its id, method, URL (query values masked), status, time and company; builds nothing for a request it does not log', async ({ onTestFinished }) => {
    const bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKEN, companyId: 'acme' }]) });
    onTestFinished(() => bed.close());
    const lease = '/v1/leases/recording/acme/prod/sb-log';
    const read = (base: string, query = '') => fetch(`${base}${lease}${query}`, { headers: { authorization: `Bearer ${TOKEN}` } }).then((res) => res.arrayBuffer().then(() => res.status));

    // At info: a line each, with pino-http's fields; probes none.
    const info = counted('info');
    const api = await startTestApi(bed, info.log);
    onTestFinished(() => api.close());
    const before = info.made.children;
    for (let i = 0; i < 20; i++) expect((await fetch(`${api.base}/healthz`)).status).toBe(200);
    expect(info.made.children - before).toBe(0);
    expect(await read(api.base, '?t=secret-in-query&waitMs=0')).toBe(200);
    expect(await read(api.base)).toBe(200);
    const requestLines = () => info.lines.filter((line) => line.msg === 'request completed');
    await readUntil(async () => requestLines().length === 2, 5_000, 'two request lines');
    const [first, second] = requestLines() as { req: { id: number; method: string; url: string }; res: { statusCode: number }; responseTime: number; companyId: string }[];
    expect(first).toMatchObject({ level: 30, companyId: 'acme', req: { method: 'GET', url: `${lease}?t=***&waitMs=0` }, res: { statusCode: 200 } });
    expect(first!.responseTime).toBeGreaterThanOrEqual(0);
    expect(second!.req.id).toBeGreaterThan(first!.req.id);
    expect(JSON.stringify(info.lines)).not.toContain('secret-in-query');
    expect(info.lines.filter((line) => String((line.req as { url?: string } | undefined)?.url).startsWith('/healthz'))).toEqual([]);

    // helper-40: a long value of a `;` path parameter the API reads, a second activity token in
    // a path, and a `#fragment` a raw client sent were logged whole.
    const secrets = ['path-param-secret-aaaaaaaaaa', 'second-activity-secret-aaaa', 'fragment-secret-aaaaaaaaaaa'];
    const targets = [`/v1/attention;limit=${secrets[0]}`, `/v1/x/activities/a/activities/${secrets[1]}`, `/v1/attention#${secrets[2]}`];
    for (const path of targets) {
      const status = await new Promise<number>((resolve, reject) => {
        const asked = httpRequest(`${api.base}/`, { path, headers: { authorization: `Bearer ${TOKEN}` } }, (res) => {
          res.resume();
          res.on('end', () => resolve(res.statusCode ?? 0));
        });
        asked.on('error', reject);
        asked.end();
      });
      expect(status).toBeGreaterThanOrEqual(200);
    }
    const odd = () => info.lines.map((line) => (line.req as { url?: string } | undefined)?.url ?? '').filter((url) => /;limit=|\/activities\/|#/.test(url));
    await readUntil(async () => odd().length === 3, 5_000, 'the three lines');
    expect(odd().sort()).toEqual(['/v1/attention#***', '/v1/attention;limit=***', '/v1/x/activities/***/activities/***']);
    for (const secret of secrets) expect(JSON.stringify(info.lines)).not.toContain(secret);

    // A long poll its caller leaves was not answered: "request aborted", as pino-http said (helper-40).
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: { provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId: 'sb-held' }, params: { providerLeaseId: 'sb-held' } });
    const left = new AbortController();
    const poll = fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`, { headers: { authorization: `Bearer ${TOKEN}` }, signal: left.signal }).catch(() => 'left');
    await readUntil(async () => /lease_ops_api_waits\{of="all"\} 1\b/.test(await (await fetch(`${api.base}/metrics`)).text()), 5_000, 'the long poll held');
    left.abort();
    expect(await poll).toBe('left');
    const aborted = await readUntil(async () => info.lines.find((line) => line.msg === 'request aborted'), 5_000, 'the aborted line');
    expect((aborted.req as { url: string }).url).toBe(`/v1/operations/${encodeURIComponent(jobId)}?waitMs=20000`);
    expect(info.lines.filter((line) => line.msg === 'request aborted')).toHaveLength(1);

    // At warn: reads are below the level, so no line and no logger is made for them.
    const warn = counted('warn');
    const quiet = await startTestApi(bed, warn.log);
    onTestFinished(() => quiet.close());
    const quietBefore = warn.made.children;
    for (let i = 0; i < 20; i++) expect(await read(quiet.base)).toBe(200);
    expect(warn.made.children - quietBefore).toBe(0);
    expect(warn.lines.filter((line) => line.req !== undefined)).toEqual([]);
    // A refusal below its budget's count still gets its line at warn: a 401.
    expect((await fetch(`${quiet.base}${lease}`, { headers: { authorization: 'Bearer nope-nope-nope-nope' } })).status).toBe(401);
    await readUntil(async () => warn.lines.some((line) => (line.res as { statusCode?: number } | undefined)?.statusCode === 401), 5_000, 'the 401 line');
    expect(warn.lines.find((line) => (line.res as { statusCode?: number } | undefined)?.statusCode === 401)).toMatchObject({ level: 40, msg: 'request completed', req: { method: 'GET', url: lease } });
  });
});
