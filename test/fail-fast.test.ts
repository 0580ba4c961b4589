// Issue 13, parts 3 and 5: with Redis unreachable, producers, the client, the CLI and the API
// fail fast and clearly, workers report it through pino at a bounded rate; the CLI's exit
// codes are distinct. On the code before, status and enqueue never exited, the client's
// enqueue neither resolved nor rejected, the API never listened, and a worker wrote 532 raw
// lines in 10 s.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { describe, expect, it } from 'vitest';
import { startApiServer, type ApiServer } from '../src/api/server.ts';
import { loadConfig } from '../src/config.ts';
import { LeaseOpsClient, RedisUnavailableError } from '../src/index.ts';
import { createLogger } from '../src/logger.ts';
import { freePort } from '../src/redis-server.ts';
import { BIN, cli } from './helpers/cli.ts';
import { cleanupFor, lease, TestBed } from './helpers/env.ts';
import { RedisProcess } from './helpers/redis-process.ts';

const TOKEN = 'fail-fast-token-0123456789';
const PASSWORD = 'fail-fast-pa55word';


const closed = async () => `redis://:${PASSWORD}@127.0.0.1:${await freePort()}`;

describe.concurrent('run at once', () => {
  describe('Redis unreachable', () => {
    it('the client rejects with RedisUnavailableError naming the masked URL and the timeout', { timeout: 15_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const url = await closed();
      // 1.5 s: under load (a run beside four busy loops on two cores), 400 ms passed before the
      // refused connect was seen, and the message rightly named no cause.
      const client = new LeaseOpsClient(loadConfig({ REDIS_URL: url, LEASE_OPS_REDIS_TIMEOUT_MS: '1500' }));
      cleanup.push(() => client.close());
      const error = await client.enqueue('stop', lease('x'), { providerLeaseId: 'x' }).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(RedisUnavailableError);
      const e = error as RedisUnavailableError;
      expect(e.code).toBe('redis_unavailable');
      expect(e.timeoutMs).toBe(1500);
      expect(e.message).toMatch(/^no Redis answered at redis:\/\/:\*\*\*@127\.0\.0\.1:\d+ within 1500 ms \(ECONNREFUSED\): start Redis there, or set REDIS_URL/);
      expect(e.message).not.toContain(PASSWORD);
      expect(await client.getLease(lease('x')).catch((err: unknown) => err)).toBeInstanceOf(RedisUnavailableError);
    });

    it('`status` and `enqueue` print one line naming the URL and exit 4', { timeout: 30_000 }, async () => {
      const env = { REDIS_URL: await closed(), LEASE_OPS_REDIS_TIMEOUT_MS: '400' };
      for (const args of [['status'], ['enqueue', 'stop', '--provider', 'p', '--company', 'c', '--environment', 'e', '--lease', 'l', '--params', '{"providerLeaseId":"l"}']]) {
        const r = await cli(args, env);
        expect({ args, code: r.code }).toEqual({ args, code: 4 });
        expect(r.stderr.trim().split('\n')).toHaveLength(1);
        expect(r.stderr).toMatch(/^lease-ops: no Redis answered at redis:\/\/:\*\*\*@127\.0\.0\.1:\d+ within 400 ms/);
        expect(r.stdout).toBe('');
      }
    });

    it('the API listens at once: /healthz 200, /readyz and /v1 503 until Redis answers, then 200', { timeout: 30_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const port = await freePort();
      const config = loadConfig({ REDIS_URL: `redis://127.0.0.1:${port}`, LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_PORT: '0', LEASE_OPS_LOG_LEVEL: 'silent' });
      const api: ApiServer = await startApiServer(config, createLogger({ level: 'silent' }));
      cleanup.push(() => api.close());
      const get = (path: string) => fetch(`${api.url}${path}`, { headers: { authorization: `Bearer ${TOKEN}` } });
      expect((await get('/healthz')).status).toBe(200);
      expect((await get('/readyz')).status).toBe(503);
      const down = await get('/v1/attention');
      expect(down.status).toBe(503);
      expect(down.headers.get('retry-after')).toBe('1');
      expect(((await down.json()) as { error: { code: string } }).error.code).toBe('redis_unavailable');
      // Redis comes up on that port: the API answers without a restart.
      const redis = await RedisProcess.start([], port);
      cleanup.push(() => redis.stop());
      await api.client.connected();
      expect((await get('/v1/attention')).status).toBe(200);
    });

    it('a worker reports it through pino, a line per 10 s at most, and nothing else', { timeout: 30_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const child = spawn(process.execPath, [BIN, 'worker'], { env: { ...process.env, REDIS_URL: await closed(), LEASE_OPS_LOG_LEVEL: 'info' }, stdio: ['ignore', 'pipe', 'pipe'] });
      cleanup.push(async () => {
        if (child.exitCode === null && child.signalCode === null) {
          child.kill('SIGKILL');
          await once(child, 'exit');
        }
      });
      const lines: string[] = [];
      for (const stream of [child.stdout, child.stderr]) createInterface({ input: stream }).on('line', (line) => lines.push(line));
      // The first report, then as long again as it took ioredis to give up a few times over.
      await new Promise<void>((resolve) => {
        const check = () => (lines.some((l) => l.includes('Redis does not answer')) ? resolve() : setTimeout(check, 50));
        check();
      });
      await new Promise((resolve) => setTimeout(resolve, 3_000));
      child.kill('SIGKILL');
      await once(child, 'exit');
      expect(lines.filter((l) => !l.startsWith('{'))).toEqual([]); // all pino
      const reports = lines.filter((l) => l.includes('Redis does not answer'));
      expect(reports).toHaveLength(1);
      expect(reports[0]).not.toContain(PASSWORD);
      expect(JSON.parse(reports[0]!)).toMatchObject({ level: 40, code: 'ECONNREFUSED' });
    });
  });

  describe('the CLI exit codes', () => {
    it('0 ok (and --version), 2 for a missing option, 3 when --wait ends before the operation; --json prints one document', { timeout: 30_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const bed = await TestBed.create();
      cleanup.push(() => bed.close());
      const env = { REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX };
      const version = await cli(['--version'], env);
      expect(version.code).toBe(0);
      expect(version.stdout.trim()).toMatch(/^\d+\.\d+\.\d+/);
      const missing = await cli(['enqueue', 'stop', '--provider', 'p', '--company', 'c', '--lease', 'l'], env);
      expect(missing.code).toBe(2);
      expect(missing.stderr).toMatch(/--environment/);
      const lease = ['--provider', 'recording', '--company', 'c', '--environment', 'e', '--lease', 'l', '--params', '{"providerLeaseId":"l"}'];
      const accepted = await cli(['enqueue', 'stop', ...lease, '--json'], env);
      expect(accepted.code).toBe(0);
      expect(JSON.parse(accepted.stdout)).toMatchObject({ jobId: expect.any(String), laneId: expect.any(String) });
      // No worker: the wait ends first.
      const waited = await cli(['enqueue', 'destroy', ...lease, '--json', '--wait', '200'], env);
      expect(waited.code).toBe(3);
      expect(JSON.parse(waited.stdout)).toMatchObject({ operation: { op: 'destroy', state: expect.stringMatching(/queued|ready/) } });
      expect(waited.stderr).toMatch(/is a worker running/);
    });
  });

  describe('what the attack on issue 13 found', () => {
    it('close() ends though Redis went away after a wait (the CLI hung for ever in --wait)', { timeout: 20_000 }, async () => {
      const redis = await RedisProcess.start();
      const client = new LeaseOpsClient(loadConfig({ REDIS_URL: redis.url, LEASE_OPS_REDIS_TIMEOUT_MS: '500' }));
      try {
        const { jobId } = await client.enqueue('stop', lease('w'), { providerLeaseId: 'w' });
        expect(await client.waitForResult(jobId, 200).catch((e: unknown) => (e as Error).name)).toBe('WaitTimeoutError');
        await redis.crash();
        expect(await client.getOperation(jobId).catch((e: unknown) => e)).toBeInstanceOf(RedisUnavailableError);
      } finally {
        await client.close();
        await redis.stop();
      }
    });

    it('a Redis that refuses the password is named as such; a bad --wait writes nothing; enqueue warns of a misspelt setting', { timeout: 30_000 }, async ({ onTestFinished }) => {
      const cleanup = cleanupFor(onTestFinished);
      const redis = await RedisProcess.start(['--requirepass', 'the-password']);
      cleanup.push(() => redis.stop());
      const refused = await cli(['status'], { REDIS_URL: `redis://:wrong@127.0.0.1:${redis.port}` });
      expect(refused.code).toBe(4);
      expect(refused.stderr).toMatch(/^lease-ops: the Redis at redis:\/\/:\*\*\*@127\.0\.0\.1:\d+ refuses the credentials in REDIS_URL/);
      const bed = await TestBed.create();
      cleanup.push(() => bed.close());
      const env = { REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_PREFX: 'typo' };
      const lease = ['--provider', 'recording', '--company', 'c', '--environment', 'e', '--lease', 'l', '--params', '{"providerLeaseId":"l"}'];
      const bad = await cli(['enqueue', 'stop', ...lease, '--wait', 'abc'], env);
      expect(bad.code).toBe(2);
      expect(await bed.ops.queue.count()).toBe(0);
      const ok = await cli(['enqueue', 'stop', ...lease], env);
      expect(ok.code).toBe(0);
      expect(ok.stderr).toMatch(/warning: LEASE_OPS_PREFX is not a lease-ops setting \(did you mean LEASE_OPS_PREFIX\?\)/);
    });
  });
});
