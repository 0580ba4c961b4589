import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { readdirSync, readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { describe, expect, it } from 'vitest';
import { BACKGROUND_WALK_NICE, HEAVY_WALK_COMMANDS } from '../src/api/walks.ts';
import { BIN } from './helpers/cli.ts';
import { bedFor, type Finished, TestBed } from './helpers/env.ts';
import { serverFor } from './helpers/redis-process.ts';

// Issue 27 item 3: one company's attention walks held every other company's requests behind
// them (B's enqueue p99 7-23x with A walking 600 failed leases). `lease-ops api` runs walks in
// worker threads, a company's one at a time. A walk here, its items read, stalls its thread's
// event loop for 3 s before it answers (fault point `walk`), once per thread, so what goes on
// meanwhile is observable without timing anything.

const A = 'walks-a-token-0123456789';
const B = 'walks-b-token-0123456789';
const ADMIN = 'walks-admin-token-0123456789';
const bearer = (token: string) => ({ authorization: `Bearer ${token}` });

interface Api {
  bed: TestBed;
  base: string;
  process: ChildProcess;
  /** The stderr lines saying a walk stalled, so far. */
  stalls: number;
  /** The stderr lines saying a walk thread stalled with a Redis command sent, so far. */
  commandStalls: number;
  stalled: () => Promise<void>;
  /** Resolves at the first JSON log line on stdout that `match` accepts. */
  logged: (match: (line: Record<string, unknown>) => boolean) => Promise<void>;
}

// Each test has its own bed and API process, and they run at once: each mostly waits on a
// stall of 3 s.
describe.concurrent('walks run beside the API, not in it (issue 27)', () => {
  /** An API process of the test's own, on a bed of its own, both stopped when the test ends. */
  async function startApi(finished: Finished, walkThreads: string, env: Record<string, string> = {}, bedSettings?: Record<string, string>): Promise<Api> {
    const bed = await bedFor(finished, bedSettings);
    const child = spawn(process.execPath, [BIN, 'api'], {
      env: {
        ...process.env,
        REDIS_URL: bed.config.REDIS_URL,
        LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX,
        LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: ADMIN }]),
        LEASE_OPS_API_PORT: '0',
        LEASE_OPS_LOG_LEVEL: 'warn',
        LEASE_OPS_LOG_FORMAT: 'json',
        LEASE_OPS_API_WALK_THREADS: walkThreads,
        LEASE_OPS_FAULT_POINTS: 'walk=stall*1',
        ...env,
      },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const waiters: (() => void)[] = [];
    const logWaiters: { match: (line: Record<string, unknown>) => boolean; resolve: () => void }[] = [];
    finished(async () => {
      if (child.exitCode !== null || child.signalCode !== null) return;
      child.kill('SIGTERM');
      await once(child, 'exit');
    });
    const api: Api = {
      bed,
      base: '',
      process: child,
      stalls: 0,
      commandStalls: 0,
      stalled: () => new Promise<void>((resolve) => waiters.push(resolve)),
      logged: (match) => new Promise<void>((resolve) => logWaiters.push({ match, resolve })),
    };
    createInterface({ input: child.stderr! }).on('line', (line) => {
      if (line.includes('lease-ops fault point walk-command-sent: stall')) api.commandStalls++;
      if (!line.includes('lease-ops fault point walk: stall')) return;
      api.stalls++;
      waiters.shift()?.();
    });
    api.base = await new Promise<string>((resolve, reject) => {
      createInterface({ input: child.stdout! }).on('line', (line) => {
        const m = /lease-ops API on (http:\/\/\S+)\/v1/.exec(line);
        if (m) resolve(m[1]!);
        if (!line.startsWith('{')) return;
        const parsed = JSON.parse(line) as Record<string, unknown>;
        for (const w of logWaiters.filter((x) => x.match(parsed))) {
          logWaiters.splice(logWaiters.indexOf(w), 1);
          w.resolve();
        }
      });
      child.once('exit', (code) => reject(new Error(`the API exited (${code})`)));
    });
    return api;
  }

  /** Which of two requests answered first. */
  async function first(x: Promise<Response>, y: Promise<Response>): Promise<'x' | 'y'> {
    return Promise.race([x.then(() => 'x' as const), y.then(() => 'y' as const)]);
  }

  /** 3,000 entries of A's attention index, none with a reason: A's walk reads them all (some 9,000 commands) and takes them out. */
  async function heavyAttentionOfA({ bed }: Api, name: string): Promise<void> {
    const key = `${bed.config.LEASE_OPS_PREFIX}:attention:scope`;
    for (let i = 0; i < 3_000; i += 500) await bed.redis.zadd(key, ...Array.from({ length: 500 }, (_, k) => [0, `a\nenv\n${name}-${i + k}`]).flat());
  }

  /** The API's walks so far, by kind of thread (/metrics). */
  async function walksByThread(api: Api): Promise<{ foreground: number; background: number }> {
    const text = await (await fetch(`${api.base}/metrics`)).text();
    const of = (thread: string) => Number(new RegExp(`^lease_ops_api_walks_total\\{thread="${thread}"\\} (\\S+)$`, 'm').exec(text)?.[1]);
    return { foreground: of('foreground'), background: of('background') };
  }

  /** Raised so that a heavy walk of A's is not refused A's next (9,000 commands are 18 tokens). */
  const RATES = JSON.stringify({ walk: { perSecond: 1_000, burst: 1_000 } });

  it("sends A's first attention walk over thousands of entries to the background thread (weighed before it runs): B's read and B's walk answer while it holds that thread, and A's next waits its turn", async ({ onTestFinished }) => {
    const api = await startApi(onTestFinished, '2', { LEASE_OPS_API_COMPANY_RATES: RATES });
    const attention = (token: string) => fetch(`${api.base}/v1/attention`, { headers: bearer(token) });
    // B's first walk takes the foreground thread's one stall.
    const fgStalled = api.stalled();
    const bFirst = attention(B);
    await fgStalled;
    expect((await bFirst).status).toBe(200);
    // A's first walk: A's 3,000 entries weigh it heavy before it runs, so the background thread
    // takes it and stalls there (in the foreground thread, stalled already, it would answer at once).
    await heavyAttentionOfA(api, 'holds');
    const bgStalled = api.stalled();
    const aFirst = attention(A);
    expect(await Promise.race([bgStalled.then(() => 'stalled'), aFirst.then(() => 'answered')])).toBe('stalled');
    const aSecond = attention(A);
    // Meanwhile B's read and B's walk (in the foreground thread) answer first.
    const bRead = fetch(`${api.base}/v1/leases/noop/b/env/l1`, { headers: bearer(B) });
    expect(await first(aFirst, bRead)).toBe('y');
    expect((await bRead).status).toBe(200);
    const bWalk = attention(B);
    expect(await first(aFirst, bWalk)).toBe('y');
    expect((await bWalk).status).toBe(200);
    expect((await aFirst).status).toBe(200);
    expect((await aSecond).status).toBe(200);
    expect(api.stalls).toBe(2);
    expect(await walksByThread(api)).toEqual({ foreground: 2, background: 2 });
  });

  it("runs the admin's overview (every company's first attention items) in a thread too: B's read answers while it stalls", async ({ onTestFinished }) => {
    const api = await startApi(onTestFinished, '1');
    const stalled = api.stalled();
    const overview = fetch(`${api.base}/v1/overview`, { headers: bearer(ADMIN) });
    await stalled;
    const bRead = fetch(`${api.base}/v1/leases/noop/b/env/l1`, { headers: bearer(B) });
    expect(await first(overview, bRead)).toBe('y');
    expect((await bRead).status).toBe(200);
    const body = (await (await overview).json()) as { counts: Record<string, number>; attention: unknown[] };
    expect(Object.keys(body.counts).sort()).toEqual(['backing-off', 'completed', 'failed', 'paused', 'queued', 'ready', 'running']);
    expect(Array.isArray(body.attention)).toBe(true);
  });

  it("lets a background walk's Redis reply wait unread past the API's Redis timeout (a starved thread at nice 10 answered 503 with Redis up)", async ({ onTestFinished }) => {
    // The walk's first command sent, its thread sleeps 3 s: Redis has answered, and the reply
    // waits unread past the API's 2 s, as it does for a thread at nice 10 on a busy machine.
    const api = await startApi(onTestFinished, '2', { LEASE_OPS_FAULT_POINTS: 'walk-command-sent=stall*1', LEASE_OPS_REDIS_TIMEOUT_MS: '2000', LEASE_OPS_API_COMPANY_RATES: RATES });
    await heavyAttentionOfA(api, 'starved');
    const res = await fetch(`${api.base}/v1/attention`, { headers: bearer(A) });
    expect(res.status, await res.text()).toBe(200);
    expect(api.commandStalls).toBe(1);
    expect(await walksByThread(api)).toEqual({ foreground: 0, background: 1 });
  });

  it("fails a heavy company's walks in line at once after one that a hung Redis did not answer: its line is held one background timeout, not one a walk (helper-59)", async ({ onTestFinished }) => {
    const server = await serverFor(onTestFinished);
    const api = await startApi(onTestFinished, '2', { LEASE_OPS_FAULT_POINTS: '', LEASE_OPS_API_COMPANY_RATES: RATES }, { REDIS_URL: server.url });
    const attention = async (token: string) => (await fetch(`${api.base}/v1/attention`, { headers: bearer(token) })).status;
    // A's walks are heavy (weighed so while Redis answers): they go to the background thread.
    await heavyAttentionOfA(api, 'hung');
    expect(await attention(A)).toBe(200);
    server.pause();
    onTestFinished(() => server.resume());
    const started = performance.now();
    const walks = await Promise.all([0, 1, 2].map(async () => ({ status: await attention(A), at: performance.now() - started })));
    server.resume();
    // Another company's walk asks Redis itself, within the second after A's failure (helper-60: failed with A's).
    expect(await attention(B)).toBe(200);
    expect(walks.map((w) => w.status)).toEqual([503, 503, 503]);
    const times = walks.map((w) => w.at).sort((x, y) => x - y);
    // The first waits out the background thread's Redis timeout (5 s); the two behind it do not wait theirs.
    expect(times[2]! - times[0]!, JSON.stringify(times)).toBeLessThan(2_000);
    expect(await walksByThread(api)).toEqual({ foreground: 1, background: 2 });
  });

  it("counts a walk's Redis commands against its company's walk rate, each walk its own: A's long walk holds A's next, B's short one beside it is charged only its own", async ({ onTestFinished }) => {
    // No stalls here: A's walk costs what it reads, 3,000 entries of A's attention index
    // (three reads each; none has a reason any more, so this walk also takes them out).
    const api = await startApi(onTestFinished, '1', { LEASE_OPS_FAULT_POINTS: '' });
    await heavyAttentionOfA(api, 'lane');
    const attention = (token: string) => fetch(`${api.base}/v1/attention`, { headers: bearer(token) });
    const commands = async () => {
      const text = await (await fetch(`${api.base}/metrics`)).text();
      const of = (company: string) => Number(new RegExp(`^lease_ops_api_walk_commands_total\\{company="${company}"\\} (\\S+)$`, 'm').exec(text)?.[1] ?? 0);
      return { a: of('a'), b: of('b') };
    };
    // The thread's first walk also sets its connection up: B's second is what a walk of B costs.
    expect((await attention(B)).status).toBe(200);
    const bBefore = (await commands()).b;
    expect((await attention(B)).status).toBe(200);
    const bAlone = (await commands()).b - bBefore;
    expect(bAlone).toBeGreaterThan(0);
    // A's long walk and B's short one, in the one thread at once (helper-23: sharing the
    // thread's busy time out charged B's 5 ms walk 51-91 ms of A's, and got B refused).
    const [aWalk, bWalk] = await Promise.all([attention(A), attention(B)]);
    expect([aWalk.status, bWalk.status]).toEqual([200, 200]);
    const charged = await commands();
    expect(charged.b - bBefore).toBe(2 * bAlone);
    expect(charged.a).toBeGreaterThan(9_000);
    // A: 9,000 commands are 18 tokens more, past its burst of 10: refused for a while.
    const aNext = await attention(A);
    expect(aNext.status).toBe(429);
    expect(((await aNext.json()) as { error: { code: string } }).error.code).toBe('company_rate_limited');
    expect(Number(aNext.headers.get('retry-after'))).toBeGreaterThanOrEqual(2);
    // B keeps its rate: four more in a row (its burst is 10).
    for (let i = 0; i < 4; i++) expect((await attention(B)).status).toBe(200);
  });

  it(`sends the walks of a company whose walk sent more than ${HEAVY_WALK_COMMANDS.toLocaleString('en-US')} Redis commands to the background thread, at nice ${BACKGROUND_WALK_NICE}, and another company's to the foreground one`, async ({ onTestFinished }) => {
    const api = await startApi(onTestFinished, '2', { LEASE_OPS_FAULT_POINTS: '', LEASE_OPS_API_COMPANY_RATES: RATES });
    const attention = async (token: string) => expect((await fetch(`${api.base}/v1/attention`, { headers: bearer(token) })).status).toBe(200);
    expect(await (await fetch(`${api.base}/metrics`)).text()).toContain(`over ${HEAVY_WALK_COMMANDS.toLocaleString('en-US')} Redis commands`);
    await attention(B);
    expect(await walksByThread(api)).toEqual({ foreground: 1, background: 0 });
    // A's first walk: no entries of A's scope index weigh it heavy, so the foreground thread
    // takes it; but it reads 1,500 of A's operations past their deadline (two reads each, and
    // none is there any more: it takes them out), and is learnt heavy when it ends.
    const deadlines = `${api.bed.config.LEASE_OPS_PREFIX}:deadlines:a`;
    await api.bed.redis.zadd(deadlines, ...Array.from({ length: 1_500 }, (_, i) => [1, `AAAAAAAAAAAAAAAAAAAAAA.gone${i}`]).flat());
    await attention(A);
    expect(await walksByThread(api)).toEqual({ foreground: 2, background: 0 });
    expect(await api.bed.redis.zcard(deadlines)).toBe(0);
    // The API's threads by nice value, with the CPU time each has spent (clock ticks).
    const threads = () =>
      readdirSync(`/proc/${api.process.pid}/task`).map((task) => {
        const fields = readFileSync(`/proc/${api.process.pid}/task/${task}/stat`, 'utf8').split(') ')[1]!.split(' ');
        return { task, nice: Number(fields[16]), cpu: Number(fields[11]) + Number(fields[12]) };
      });
    const before = threads();
    // It sent some 3,000 commands: A's next walk (over 3,000 entries now), as heavy, goes to the background thread and
    // spends its CPU there, in the one thread of the API at nice 10 (Linux sets it per thread).
    await heavyAttentionOfA(api, 'second');
    await attention(A);
    expect(await walksByThread(api)).toEqual({ foreground: 2, background: 1 });
    const after = threads();
    const niced = after.filter((t) => t.nice === BACKGROUND_WALK_NICE);
    expect(niced).toHaveLength(1);
    expect(after.filter((t) => t.nice !== 0 && t.nice !== BACKGROUND_WALK_NICE)).toEqual([]);
    const spent = (task: string) => after.find((t) => t.task === task)!.cpu - (before.find((t) => t.task === task)?.cpu ?? 0);
    const busiest = after.reduce((most, t) => (spent(t.task) > spent(most.task) ? t : most));
    expect(busiest.task).toBe(niced[0]!.task);
    await attention(B);
    expect(await walksByThread(api)).toEqual({ foreground: 3, background: 1 });
  });

  it("without walk threads (LEASE_OPS_API_WALK_THREADS=0), A's walk holds B's read behind it", async ({ onTestFinished }) => {
    const api = await startApi(onTestFinished, '0');
    const stalled = api.stalled();
    const aWalk = fetch(`${api.base}/v1/attention`, { headers: bearer(A) });
    await stalled;
    const bRead = fetch(`${api.base}/v1/leases/noop/b/env/l1`, { headers: bearer(B) });
    expect(await first(aWalk, bRead)).toBe('x');
    expect((await bRead).status).toBe(200);
  });

  it("holds a company's requests past its turns (LEASE_OPS_API_REQUESTS_PER_COMPANY) in line, not another company's", async ({ onTestFinished }) => {
    const api = await startApi(onTestFinished, '2', { LEASE_OPS_API_REQUESTS_PER_COMPANY: '1' });
    const stalled = api.stalled();
    // A's walk holds A's one turn while its thread stalls.
    const aWalk = fetch(`${api.base}/v1/attention`, { headers: bearer(A) });
    await stalled;
    const aRead = fetch(`${api.base}/v1/leases/noop/a/env/l1`, { headers: bearer(A) });
    const bRead = fetch(`${api.base}/v1/leases/noop/b/env/l1`, { headers: bearer(B) });
    expect(await first(aRead, bRead)).toBe('y');
    expect(await first(aWalk, bRead)).toBe('y');
    // A's read had to wait for A's walk to end.
    expect(await first(aWalk, aRead)).toBe('x');
    expect((await aRead).status).toBe(200);
    expect((await bRead).status).toBe(200);
  });

  it("keeps a company's walks waiting for their turn to 4 (429 company_walks_full past them), and drops one whose caller hung up", async ({ onTestFinished }) => {
    // No turns of requests here: they alone would keep A's walks in line to 3.
    // A stall of 10 s: the five requests below reach the line within it on a loaded machine too
    // (a CI run sent them past the end of a 3 s one: the fifth found room).
    const api = await startApi(onTestFinished, '2', { LEASE_OPS_API_REQUESTS_PER_COMPANY: '0', LEASE_OPS_FAULT_POINTS: 'walk=stall@10000*1' });
    const attention = (signal?: AbortSignal) => fetch(`${api.base}/v1/attention`, { headers: bearer(A), ...(signal ? { signal } : {}) });
    const stalled = api.stalled();
    const running = attention();
    await stalled;
    const leaving = new AbortController();
    const first = attention(leaving.signal);
    first.catch(() => undefined);
    const waiting = [attention(), attention(), attention()];
    // A fifth in line is refused at once, while A's first walk still stalls its thread.
    const refused = await attention();
    expect(refused.status).toBe(429);
    expect(refused.headers.get('retry-after')).toBe('1');
    expect(((await refused.json()) as { error: { code: string } }).error.code).toBe('company_walks_full');
    // One in line hangs up: it leaves the line (the API says so), and makes room for another.
    const dropped = api.logged((line) => line.code === 'walk_unavailable');
    leaving.abort();
    await dropped;
    const another = attention();
    for (const res of [await running, ...(await Promise.all(waiting)), await another]) expect(res.status).toBe(200);
  });
});
