import { afterEach, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { LeaseWorker } from '../src/queues/worker.ts';
import { startTestApi } from './helpers/api-server.ts';
import { captureLog } from './helpers/log-capture.ts';
import { scanKeys, TestBed } from './helpers/env.ts';

const SECRET = 'dtn_super-secret-key-0123456789';

let bed: TestBed | undefined;
let fake: DaytonaFake | undefined;
afterEach(async () => {
  await bed?.close();
  await fake?.close();
  bed = undefined;
  fake = undefined;
});

describe('credentials and tokens', () => {
  it('never appear in logs, job data or Redis, also when the provider refuses them or is unreachable', async () => {
    bed = await TestBed.create();
    fake = new DaytonaFake({ apiKey: 'the-right-key' });
    const apiUrl = await fake.listen();
    const { lines, log } = captureLog();
    const refused = createDaytonaProvider({ name: 'refused', apiUrl, apiKey: SECRET });
    const unreachable = createDaytonaProvider({ name: 'unreachable', apiUrl: 'http://127.0.0.1:9', apiKey: SECRET, timeoutMs: 500 });
    const worker = new LeaseWorker(bed.config, new ProviderRegistry([refused, unreachable]), log);
    await worker.start();
    try {
      const lease = (provider: string) => ({ provider, companyId: 'co', environmentId: 'env', leaseId: 'l' });
      const a = await bed.ops.enqueue({ op: 'acquire', lease: lease('refused'), params: { runId: 'r' } });
      const b = await bed.ops.enqueue({ op: 'stop', lease: lease('unreachable'), params: { providerLeaseId: 'l' }, deadlineMs: 3_000 });
      const ended = await bed.waitForAll([a.jobId, b.jobId]);
      expect(ended.get(a.jobId)).toBe('failed');
      expect(ended.get(b.jobId)).toBe('failed');
      expect((await bed.ops.queue.getJob(a.jobId))?.failedReason).toMatch(/^unauthorized: /);
      // Its deadline passes after a refused connection, or while a retry's request waits its turn
      // to be sent (a busy machine: CI at 2026-12-07): either way unreachable, at its deadline.
      expect((await bed.ops.queue.getJob(b.jobId))?.failedReason).toMatch(/^deadline_exceeded: (last provider error: unreachable: the provider could not be reached \(ECONNREFUSED\)|the deadline passed while a request waited to be sent \(unreachable: .*\))$/);
    } finally {
      await worker.close();
    }
    // The failures were logged, with their errors...
    expect(lines.some((l) => l.includes('operation failed'))).toBe(true);
    // ...and the key is nowhere: not in the logs, not in any key or value under the prefix.
    expect(lines.filter((l) => l.includes(SECRET))).toEqual([]);
    const dump = await dumpPrefix(bed);
    expect(dump.length).toBeGreaterThan(0);
    expect(dump.filter((v) => v.includes(SECRET))).toEqual([]);
  });

  it('API tokens never appear in the request log or in Redis, whether right, wrong, Bearer or Basic', async () => {
    const ADMIN = 'adm_secret-token-0123456789';
    const SCOPED = 'co_secret-token-0123456789';
    const WRONG = 'wrong_secret-token-0123456789';
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: JSON.stringify([{ token: ADMIN }, { token: SCOPED, companyId: 'co' }]) });
    const { lines, log } = captureLog();
    const api = await startTestApi(bed, log);
    // As a worker serving it would (none runs here: the operations only need accepting).
    await bed.ops.announceProviders([{ name: 'recording', capabilities: { stop: true, pause: false, forceStop: true } }]);
    try {
      const basic = (t: string) => `Basic ${Buffer.from(`me:${t}`).toString('base64')}`;
      const headers = [`Bearer ${ADMIN}`, `Bearer ${SCOPED}`, `Bearer ${WRONG}`, basic(ADMIN), basic(WRONG), ADMIN];
      for (const authorization of headers) {
        for (const [method, path, body] of [
          ['POST', '/v1/leases/recording/co/env/l/operations', { op: 'stop', params: { providerLeaseId: 'l' }, idempotencyKey: 'k' }],
          ['POST', '/v1/leases/recording/co/env/l/operations', { op: 'stop', params: { providerLeaseId: 42 } }],
          ['GET', '/v1/leases/recording/co/env/l', undefined],
          ['GET', '/v1/overview', undefined],
          ['GET', '/board', undefined],
        ] as const) {
          const res = await fetch(`${api.base}${path}`, {
            method,
            headers: { authorization, 'content-type': 'application/json', cookie: `session=${ADMIN}` },
            ...(body ? { body: JSON.stringify(body) } : {}),
          });
          await res.arrayBuffer();
        }
      }
    } finally {
      await api.close();
    }
    // Requests were logged (with their outcome)...
    expect(lines.filter((l) => l.includes('"statusCode":401')).length).toBeGreaterThan(0);
    expect(lines.filter((l) => l.includes('"statusCode":202')).length).toBeGreaterThan(0);
    // ...but no token, no Basic credential and no cookie made it into a line or into Redis.
    const secrets = [ADMIN, SCOPED, WRONG, Buffer.from(`me:${ADMIN}`).toString('base64'), Buffer.from(`me:${WRONG}`).toString('base64')];
    expect(lines.filter((l) => secrets.some((s) => l.includes(s)))).toEqual([]);
    const dump = await dumpPrefix(bed);
    expect(dump.filter((v) => secrets.some((s) => v.includes(s)))).toEqual([]);
  });
});


/** Every key under the test's prefix and every value in it, as text. */
async function dumpPrefix(bed: TestBed): Promise<string[]> {
  const dump: string[] = [];
  for (const key of await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}*`)) {
    const type = await bed.redis.type(key);
    if (type === 'hash') dump.push(JSON.stringify(await bed.redis.hgetall(key)));
    else if (type === 'string') dump.push((await bed.redis.get(key)) ?? '');
    else if (type === 'list') dump.push(JSON.stringify(await bed.redis.lrange(key, 0, -1)));
    else if (type === 'zset') dump.push(JSON.stringify(await bed.redis.zrange(key, 0, -1)));
    else if (type === 'stream') dump.push(JSON.stringify(await bed.redis.xrange(key, '-', '+')));
    dump.push(key);
  }
  return dump;
}
