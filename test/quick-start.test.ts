import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { createRedis } from '../src/queues/redis.ts';
import { REDIS_URL, scanKeys } from './helpers/env.ts';

const ROOT = new URL('..', import.meta.url).pathname;

/** The commands in the README's first shell block, without their comments. */
function readmeCommands(): string[] {
  const readme = readFileSync(join(ROOT, 'README.md'), 'utf8');
  const block = /```sh\n([\s\S]*?)```/.exec(readme)?.[1] ?? '';
  return block
    .split('\n')
    .map((line) => line.replace(/\s+#.*$/, '').trim())
    .filter(Boolean);
}

/** A copy of the repository as a clean checkout would have it (tracked and new, not ignored, files). */
function copyOfRepo(): string {
  const dir = mkdtempSync(join(tmpdir(), 'lease-ops-quick-start-'));
  const files = execFileSync('git', ['ls-files', '--cached', '--others', '--exclude-standard', '-z'], { cwd: ROOT, encoding: 'utf8' })
    .split('\0')
    // A node_modules symlink is not ignored by `node_modules/` (a directory pattern): copied,
    // the copy's npm ci would empty the modules it points at.
    .filter((file) => file && file.split('/')[0] !== 'node_modules');
  for (const file of files) {
    mkdirSync(dirname(join(dir, file)), { recursive: true });
    try {
      cpSync(join(ROOT, file), join(dir, file));
    } catch (err) {
      // A tracked file deleted in the working tree is not part of the checkout being tested.
      if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
    }
  }
  return dir;
}

/** Resolves with the first match of `pattern` in the child's output so far or to come. */
function waitForOutput(child: ChildProcess, output: { text: string }, pattern: RegExp, timeoutMs: number): Promise<RegExpMatchArray> {
  return new Promise((resolve, reject) => {
    const check = () => {
      const m = pattern.exec(output.text);
      if (m) {
        cleanup();
        resolve(m);
      }
    };
    const onExit = (code: number | null) => {
      cleanup();
      reject(new Error(`exited (${code}) before printing ${pattern}:\n${output.text.slice(-3000)}`));
    };
    const timer = setTimeout(() => {
      cleanup();
      reject(new Error(`no ${pattern} within ${timeoutMs} ms:\n${output.text.slice(-3000)}`));
    }, timeoutMs);
    const cleanup = () => {
      clearTimeout(timer);
      child.stdout?.off('data', check);
      child.off('exit', onExit);
    };
    child.stdout?.on('data', check);
    child.on('exit', onExit);
    check();
  });
}

describe("the README's quick start, in a fresh copy of the repository", () => {
  const prefix = `{lo-test-qs-${randomBytes(3).toString('hex')}}`;
  let dir = '';
  let child: ChildProcess | null = null;

  afterAll(async () => {
    // Still running only if it neither exited nor was ended by a signal (bash, killed by the
    // test's SIGTERM, has no exit code: its group was gone and this kill failed, ESRCH, in a CI run).
    if (child?.pid && child.exitCode === null && child.signalCode === null) {
      try {
        process.kill(-child.pid, 'SIGKILL');
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'ESRCH') throw err;
      }
    }
    if (dir) rmSync(dir, { recursive: true, force: true });
    const redis = createRedis(REDIS_URL);
    for (const key of await scanKeys(redis, `${prefix}*`)) await redis.unlink(key);
    redis.disconnect();
  });

  it('gives two commands, the second being exactly what CI runs', () => {
    const commands = readmeCommands();
    expect(commands).toHaveLength(2);
    const ci = readFileSync(join(ROOT, '.ci/run'), 'utf8').trim().split('\n');
    expect(ci.at(-1)).toBe(commands[1]);
    const scripts = (JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8')) as { scripts: Record<string, string> }).scripts;
    expect(scripts[commands[1]!.replace(/^npm run /, '')]).toBeDefined();
  });

  it('sets up and runs the main job: the lifecycle plays, then the API, board and metrics answer', async () => {
    const [setUpAndRun] = readmeCommands();
    dir = copyOfRepo();
    const output = { text: '' };
    // Its own process group, so the test can stop npm and everything it started at once.
    child = spawn('bash', ['-c', setUpAndRun!], {
      cwd: dir,
      detached: true,
      env: { ...process.env, REDIS_URL, LEASE_OPS_PREFIX: prefix, LEASE_OPS_API_PORT: '0', npm_config_audit: 'false', npm_config_fund: 'false' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    child.stdout!.on('data', (chunk: Buffer) => (output.text += chunk.toString()));
    child.stderr!.on('data', (chunk: Buffer) => (output.text += chunk.toString()));

    const [, api] = await waitForOutput(child, output, /lease-ops: API (http:\/\/\S+)\/v1/, 240_000);
    const [, token] = await waitForOutput(child, output, /lease-ops: token (\S+)/, 10_000);
    await waitForOutput(child, output, /serving/, 60_000);
    for (const op of ['acquire', 'stop', 'resume', 'release']) expect(output.text).toMatch(new RegExp(`POST ${op}\\s+-> completed`));

    const auth = { authorization: `Bearer ${token}` };
    expect((await fetch(`${api}/healthz`)).status).toBe(200);
    const ready = await fetch(`${api}/readyz`);
    expect(ready.status).toBe(200);
    expect(((await ready.json()) as { workers: number }).workers).toBeGreaterThanOrEqual(1);

    const accepted = await fetch(`${api}/v1/leases/simulated/qs-co/qs-env/qs-lease/operations`, {
      method: 'POST',
      headers: { ...auth, 'content-type': 'application/json' },
      body: JSON.stringify({ op: 'acquire', params: { runId: 'quick-start' } }),
    });
    expect(accepted.status).toBe(202);
    const done = await fetch(`${api}${accepted.headers.get('location')}?waitMs=20000`, { headers: auth });
    expect(((await done.json()) as { state: string }).state).toBe('completed');

    // The README's HTTP example, as it reads: an acquire with a key and Prefer: wait=20 answers
    // 200 with the ended operation (the simulated cloud answers a create with "creating", and
    // its gateway pushes "started": one attempt that waited for it); the lease reads the same
    // by its acquire's id and its sandbox's.
    const lease = `${api}/v1/leases/simulated/acme/prod/run-42`;
    const waited = await fetch(`${lease}/operations`, {
      method: 'POST',
      headers: { ...auth, 'content-type': 'application/json', 'idempotency-key': 'acquire-run-42', prefer: 'wait=20' },
      body: JSON.stringify({ op: 'acquire', params: { runId: 'run-42' } }),
    });
    expect(waited.status).toBe(200);
    const acquired = (await waited.json()) as { op: string; state: string; attempts: number; result: { providerLeaseId: string } };
    expect(acquired).toMatchObject({ op: 'acquire', state: 'completed', attempts: 1 });
    const byRun = (await (await fetch(lease, { headers: auth })).json()) as { laneId: string; sandboxId: string };
    const bySandbox = (await (await fetch(`${api}/v1/leases/simulated/acme/prod/${acquired.result.providerLeaseId}`, { headers: auth })).json()) as { laneId: string };
    expect(byRun.laneId).toBe(bySandbox.laneId);
    expect(byRun.sandboxId).toBe(acquired.result.providerLeaseId);
    const story = (await (await fetch(`${lease}/timeline`, { headers: auth })).json()) as { events: { kind: string }[] };
    expect(story.events.map((e) => e.kind)).toEqual(expect.arrayContaining(['accepted', 'started', 'completed']));
    expect((await fetch(`${api}/v1/attention`, { headers: auth })).status).toBe(200);

    const metrics = await (await fetch(`${api}/metrics`)).text();
    expect(metrics).toMatch(/lease_ops_operations_total\{op="acquire",outcome="completed"\} [2-9]/);
    const board = await fetch(`${api}/board`, { headers: { authorization: `Basic ${Buffer.from(`me:${token}`).toString('base64')}` } });
    expect(board.status).toBe(200);
    expect(await board.text()).toContain('<div id="root">');
    // The front door: the printed pages answer, and / leads to them.
    const basic = { authorization: `Basic ${Buffer.from(`me:${token}`).toString('base64')}` };
    const [, attentionUrl] = /lease-ops: pages (\S+)/.exec(output.text)!;
    expect((await fetch(attentionUrl!, { headers: basic })).status).toBe(200);
    const [, timelineUrl] = /its timeline: (\S+)/.exec(output.text)!;
    const timeline = await fetch(timelineUrl!, { headers: basic });
    expect(timeline.status).toBe(200);
    expect(await timeline.text()).toContain('release');
    const root = await fetch(`${api}/`, { redirect: 'manual' });
    expect([root.status, root.headers.get('location')]).toEqual([302, '/ui/attention']);

    // Ctrl-C equivalent: everything stops gracefully.
    const exited = new Promise((resolve) => child!.on('exit', resolve));
    process.kill(-child.pid!, 'SIGTERM');
    await exited;
    expect(output.text).not.toMatch(/error while stopping/);
  }, 300_000);
});
