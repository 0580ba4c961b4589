// Issue 13, part 4: nothing left behind, nothing silent. On the code before, `start` on a
// taken port crashed with a raw stack and left its private redis-server and temp directory;
// a second worker without LEASE_OPS_SIMULATED_URL silently ran a cloud of its own; a
// providers file was added on top of the default `simulated`; a misspelt variable was
// silently ignored; a Redis refusing the credentials was silently replaced by a private one.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, readdirSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';
import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { unknownSettings } from '../src/config.ts';
import { loadProviders } from '../src/providers/registry.ts';
import { freePort, redisAnswers } from '../src/redis-server.ts';
import { BIN, cli } from './helpers/cli.ts';
import { cleanupFor, TestBed, workerEnv } from './helpers/env.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { workerFor } from './helpers/worker-process.ts';

// The children's temporary directory is this file's own: other test files, run alongside,
// start private Redis servers too, and their directories are not these tests' to count.
const OWN_TMP = mkdtempSync(join(tmpdir(), 'nothing-silent-'));
const privateDirs = () => readdirSync(OWN_TMP).filter((name) => name.startsWith('lease-ops-redis-'));

describe('nothing left behind', () => {
  it('`start` on a taken port names the port and the variable, exits 2, and leaves no redis-server or directory behind', { timeout: 60_000 }, async ({ onTestFinished }) => {
    const cleanup = cleanupFor(onTestFinished);
    const taken = createServer();
    taken.listen(0, '127.0.0.1');
    await once(taken, 'listening');
    cleanup.push(async () => void taken.close());
    const port = (taken.address() as { port: number }).port;
    const dirsBefore = privateDirs();
    // No Redis at REDIS_URL: start runs a private one first, which must not outlive it.
    const r = await cli(['start', '--once'], { REDIS_URL: `redis://127.0.0.1:${await freePort()}`, LEASE_OPS_API_PORT: String(port), TMPDIR: OWN_TMP });
    expect(r.code).toBe(2);
    expect(r.stderr).toContain(`lease-ops: port ${port} on 127.0.0.1 is taken: set LEASE_OPS_API_PORT to a free port`);
    expect(r.stderr).not.toMatch(/\n\s+at /); // no stack
    const privateUrl = /started a private one at (redis:\/\/\S+)/.exec(r.stdout)?.[1];
    expect(privateUrl).toBeDefined();
    expect(await redisAnswers(privateUrl!, 500)).toBe(false);
    expect(privateDirs().filter((d) => !dirsBefore.includes(d))).toEqual([]);
  });

  it('`start` stopped by a signal right after it started its private Redis leaves neither the redis-server nor its directory', { timeout: 30_000 }, async () => {
    const dirsBefore = privateDirs();
    const child = spawn(process.execPath, [BIN, 'start'], { env: { ...process.env, REDIS_URL: `redis://127.0.0.1:${await freePort()}`, LEASE_OPS_API_PORT: '0', TMPDIR: OWN_TMP }, stdio: ['ignore', 'pipe', 'pipe'] });
    child.stderr.resume();
    const exited = once(child, 'exit');
    const privateUrl = await new Promise<string>((resolve) =>
      createInterface({ input: child.stdout }).on('line', (line) => {
        const m = /started a private one at (redis:\/\/\S+)/.exec(line);
        if (m) resolve(m[1]!);
      }),
    );
    child.kill('SIGTERM');
    const [code] = await exited;
    expect(code === 143 || code === 0).toBe(true);
    // (the kill is sent as the process exits; the port closes a moment later)
    let answers = true;
    for (let i = 0; i < 30 && answers; i++) answers = await redisAnswers(privateUrl, 100);
    expect(answers).toBe(false);
    expect(privateDirs().filter((d) => !dirsBefore.includes(d))).toEqual([]);
  });

  it('`start` with a Redis that refuses the credentials says so and exits 2 instead of running elsewhere', { timeout: 30_000 }, async ({ onTestFinished }) => {
    const cleanup = cleanupFor(onTestFinished);
    const redis = await RedisProcess.start(['--requirepass', 'the-password']);
    cleanup.push(() => redis.stop());
    const r = await cli(['start', '--once'], { REDIS_URL: `redis://:not-the-password@127.0.0.1:${redis.port}`, LEASE_OPS_API_PORT: '0' });
    expect(r.code).toBe(2);
    expect(r.stderr).toMatch(/refuses the credentials in REDIS_URL/);
    expect(r.stderr).not.toContain('not-the-password');
    expect(r.stdout).not.toMatch(/private one/);
  });
});

describe.concurrent('run at once', () => {
  describe('nothing silent', () => {
    it('a second worker that would run its own simulated cloud on the same queue is refused, and told how to share one', { timeout: 60_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const bed = await TestBed.create();
      cleanup.push(() => bed.close());
      const env = workerEnv(bed, { LEASE_OPS_PROVIDERS: 'simulated' });
      const first = workerFor(onTestFinished, env);
      await first.ready;
      const second = await cli(['worker'], env);
      expect(second.code).toBe(2);
      expect(second.stderr).toMatch(/runs the embedded simulated cloud of this queue/);
      expect(second.stderr).toMatch(/LEASE_OPS_SIMULATED_URL/);
      // Once the first stops, its claim goes with it: another may take its place.
      await first.terminate();
      const third = workerFor(onTestFinished, env);
      await third.ready;
      await third.terminate();
    });

    it('a misspelt LEASE_OPS_ variable gets a warning naming the closest setting', async ({ onTestFinished }) => {
      expect(unknownSettings({ LEASE_OPS_CONCURENCY: '5', LEASE_OPS_PREFIX: '{x}', REDIS_URL: 'redis://h' })).toEqual([{ name: 'LEASE_OPS_CONCURENCY', closest: 'LEASE_OPS_CONCURRENCY' }]);
      const child = spawn(process.execPath, [BIN, 'worker'], {
        env: { ...process.env, REDIS_URL: `redis://127.0.0.1:${await freePort()}`, LEASE_OPS_MAX_QUEUD: '10' },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      // Killed when the test ends, pass or fail (a line that never came left it running).
      onTestFinished(() => void child.kill('SIGKILL'));
      const line = await new Promise<string>((resolve) => createInterface({ input: child.stdout }).on('line', (l) => l.includes('LEASE_OPS_MAX_QUEUD') && resolve(l)));
      child.kill('SIGKILL');
      await once(child, 'exit');
      expect(JSON.parse(line)).toMatchObject({ level: 40, variable: 'LEASE_OPS_MAX_QUEUD', closest: 'LEASE_OPS_MAX_QUEUED' });
    });

    it('a providers file replaces the default list; LEASE_OPS_PROVIDERS set as well adds to it', async () => {
      const file = join(tmpdir(), `lease-ops-providers-${process.pid}.json`);
      writeFileSync(file, JSON.stringify([{ type: 'module', path: fileURLToPath(new URL('../examples/memory-provider.ts', import.meta.url)) }]));
      const alone = await loadProviders('simulated', { LEASE_OPS_PROVIDERS_FILE: file });
      expect(alone.names()).toEqual(['memory']);
      await alone.close();
      const both = await loadProviders('simulated', { LEASE_OPS_PROVIDERS_FILE: file, LEASE_OPS_PROVIDERS: 'simulated' });
      expect(both.names().sort()).toEqual(['memory', 'simulated']);
      await both.close();
    });
  });

  describe('a provider that cannot be loaded', () => {
    it('a missing module, a missing key or a bad providers file is one line naming it, exit 2, no stack', { timeout: 30_000 }, async () => {
      const redis = { REDIS_URL: `redis://127.0.0.1:${await freePort()}` };
      const file = join(tmpdir(), `lease-ops-providers-bad-${process.pid}.json`);
      writeFileSync(file, '[{"type":"daytona"}]');
      const cases: [Record<string, string>, RegExp][] = [
        [{ LEASE_OPS_PROVIDERS: './no-such-provider.js' }, /^lease-ops: cannot load provider module \.\/no-such-provider\.js: /],
        [{ LEASE_OPS_PROVIDERS: 'daytona', DAYTONA_API_KEY: '' }, /^lease-ops: .*needs DAYTONA_API_KEY \(or DAYTONA_API_KEY_FILE\) to be set/],
        [{ LEASE_OPS_PROVIDERS_FILE: file }, /^lease-ops: LEASE_OPS_PROVIDERS_FILE=.*: /],
      ];
      for (const [env, message] of cases) {
        const r = await cli(['worker'], { ...redis, ...env });
        expect({ env, code: r.code }).toEqual({ env, code: 2 });
        expect(r.stderr.trim().split('\n')).toHaveLength(1);
        expect(r.stderr).toMatch(message);
      }
    });
  });

  describe('an interrupted bench', () => {
    it('on SIGINT kills its workers, deletes every key it wrote and exits 130', { timeout: 120_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const redis = await RedisProcess.start();
      cleanup.push(() => redis.stop());
      // As `npm run bench` runs it, on a Redis of its own.
      const child = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(new URL('../src/cli.ts', import.meta.url)), 'bench', '--quick'], {
        env: { ...process.env, REDIS_URL: redis.url },
        stdio: ['ignore', 'pipe', 'pipe'],
        // Its own process group: a test that fails before its SIGINT kills the bench and its workers.
        detached: true,
      });
      onTestFinished(() => {
        try {
          process.kill(-child.pid!, 'SIGKILL');
        } catch {
          // Gone already.
        }
      });
      const exited = once(child, 'exit');
      child.stdout.resume();
      const errors: string[] = [];
      // Interrupted while the lanes run (the bench reports its progress on stderr): their workers and keys are live.
      await new Promise<void>((resolve) =>
        createInterface({ input: child.stderr }).on('line', (line) => {
          errors.push(line);
          if (line.startsWith('(a) lanes')) resolve();
        }),
      );
      const probe = new Redis(redis.url);
      cleanup.push(async () => void probe.disconnect());
      await new Promise<void>((resolve) => {
        const check = async () => ((await probe.dbsize()) > 0 ? resolve() : setTimeout(() => void check(), 20));
        void check();
      });
      child.kill('SIGINT');
      const [code, signal] = await exited;
      expect({ code, signal, errors: errors.slice(-3) }).toMatchObject({ code: 130, signal: null });
      expect(await probe.keys('*')).toEqual([]);
    });
  });
});
