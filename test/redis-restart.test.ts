import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { startApiServer, type ApiServer } from '../src/api/server.ts';
import { createLogger } from '../src/logger.ts';
import { createRedis } from '../src/queues/redis.ts';
import { QUICK_RECOVERY, testConfig } from './helpers/env.ts';
import { findOverlaps, readCallFile } from './helpers/invariants.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));
const TOKEN = 'restart-token-0123456789';
const LEASES = 20;

describe('Redis restarts and outages (a redis-server of its own, AOF appendfsync always)', () => {
  let redis: RedisProcess | null = null;
  let api: ApiServer | null = null;
  const workers: WorkerProcess[] = [];
  const dir = mkdtempSync(join(tmpdir(), 'lease-ops-restart-'));

  afterAll(async () => {
    redis?.resume();
    await api?.close().catch(() => undefined);
    await Promise.all(workers.map((w) => w.terminate()));
    await redis?.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  it('workers and the API reconnect by themselves, the API answers 503 while Redis is away, and no accepted operation is lost', { timeout: 180_000 }, async () => {
    redis = await RedisProcess.start(['--appendonly', 'yes', '--appendfsync', 'always']);
    const config = testConfig({ REDIS_URL: redis.url, LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_PORT: '0', LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    const callFile = join(dir, 'calls.jsonl');
    const env = {
      REDIS_URL: redis.url,
      LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX,
      LEASE_OPS_PROVIDERS: PROVIDER,
      ...QUICK_RECOVERY,
      LEASE_OPS_LOCK_MS: '3000',
      RECORDING_FILE: callFile,
      RECORDING_SEED: '7',
      RECORDING_MAX_MS: '30',
    };
    workers.push(new WorkerProcess(env), new WorkerProcess(env));
    await Promise.all(workers.map((w) => w.ready));
    api = await startApiServer(config, createLogger({ level: 'silent' }));
    const url = api.url;
    const headers = { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' };

    const accepted: string[] = [];
    let n = 0;
    // A keyed request is the same request each time it is sent (a retry), so it names one lease.
    const post = async (key?: string) => {
      const i = key ? 0 : n++;
      const res = await fetch(`${url}/v1/leases/recording/co/env/lease-${i % LEASES}/operations`, {
        method: 'POST',
        headers: { ...headers, ...(key ? { 'idempotency-key': key } : {}) },
        body: JSON.stringify({ op: 'destroy', params: { providerLeaseId: `lease-${i % LEASES}` } }),
      });
      const body = (await res.json()) as { jobId?: string; error?: { code: string } };
      if (res.status === 202) accepted.push(body.jobId!);
      return { status: res.status, body, retryAfter: res.headers.get('retry-after') };
    };
    // All at once, so that many are queued and executing when Redis goes away.
    const batch = async (count: number) => {
      const statuses = await Promise.all(Array.from({ length: count }, () => post().then((r) => r.status)));
      expect(statuses.filter((s) => s !== 202)).toEqual([]);
    };
    /** Until the API says ready again: Redis answers and workers are back on the queue. */
    const readyAgain = async () => {
      for (let i = 0; i < 300; i++) {
        if ((await fetch(`${url}/readyz`)).status === 200) return;
        await new Promise((r) => setTimeout(r, 100));
      }
      throw new Error('the API did not get ready again within 30 s');
    };

    await batch(100);

    // A crash: operations are in flight, some executing.
    await redis.crash();
    const t0 = Date.now();
    const down = await post();
    expect(Date.now() - t0).toBeLessThan(5_000);
    expect([down.status, down.body.error?.code, down.retryAfter]).toEqual([503, 'redis_unavailable', '1']);
    expect((await fetch(`${url}/readyz`)).status).toBe(503);
    expect((await fetch(`${url}/healthz`)).status).toBe(200);
    const read = await fetch(`${url}/v1/operations/${accepted[0]}`, { headers });
    expect(read.status).toBe(503);

    await redis.restart();
    await readyAgain();
    await batch(100);

    // Unreachable for a while: the process is stopped, connections stay open, nothing answers.
    redis.pause();
    const t1 = Date.now();
    const paused = await post('during-pause');
    expect(Date.now() - t1).toBeLessThan(5_000);
    expect([paused.status, paused.body.error?.code]).toEqual([503, 'redis_unavailable']);
    redis.resume();
    await readyAgain();
    // The caller retries with its idempotency key: one operation, whatever the 503 left.
    const retried = await post('during-pause');
    expect(retried.status).toBe(202);
    await batch(50);

    // Every accepted operation completes: nothing was lost across the crash and the pause.
    for (const jobId of accepted) {
      const res = await fetch(`${url}/v1/operations/${jobId}?waitMs=30000`, { headers });
      const view = (await res.json()) as { state: string };
      expect({ jobId, state: view.state }).toEqual({ jobId, state: 'completed' });
    }
    const calls = readCallFile(callFile);
    const called = new Set(calls.filter((c) => c.outcome === 'ok').map((c) => c.jobId));
    expect(accepted.filter((id) => !called.has(id))).toEqual([]);
    const killedAt = new Map<number, bigint>();
    expect(findOverlaps(calls, killedAt)).toEqual([]);

    // And the lanes drained: no lane keys are left.
    const check = createRedis(redis.url);
    const laneKeys = await check.keys(`${config.LEASE_OPS_PREFIX}:lane:*`);
    check.disconnect();
    expect(laneKeys).toEqual([]);
  });
});
