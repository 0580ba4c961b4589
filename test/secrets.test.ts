import { Writable } from 'node:stream';
import { afterEach, describe, expect, it } from 'vitest';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { createLogger } from '../src/logger.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import { ProviderRegistry } from '../src/providers/registry.ts';
import { LeaseWorker } from '../src/queues/worker.ts';
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

describe('credentials', () => {
  it('never appear in logs, job data or Redis, also when the provider refuses them or is unreachable', async () => {
    bed = await TestBed.create();
    fake = new DaytonaFake({ apiKey: 'the-right-key' });
    const apiUrl = await fake.listen();
    const lines: string[] = [];
    const sink = new Writable({
      write(chunk, _enc, done) {
        lines.push(String(chunk));
        done();
      },
    });
    const log = createLogger({ level: 'debug', destination: sink });
    const refused = createDaytonaProvider({ name: 'refused', apiUrl, apiKey: SECRET });
    const unreachable = createDaytonaProvider({ name: 'unreachable', apiUrl: 'http://127.0.0.1:9', apiKey: SECRET, timeoutMs: 500 });
    const worker = new LeaseWorker(bed.config, new ProviderRegistry([refused, unreachable]), log);
    await worker.start();
    try {
      const lease = (provider: string) => ({ provider, companyId: 'co', environmentId: 'env', leaseId: 'l' });
      const a = await bed.ops.enqueue({ op: 'acquire', lease: lease('refused'), params: { runId: 'r' } });
      const b = await bed.ops.enqueue({ op: 'stop', lease: lease('unreachable'), params: { providerLeaseId: 'x' }, deadlineMs: 800 });
      const ended = await bed.waitForAll([a.jobId, b.jobId]);
      expect(ended.get(a.jobId)).toBe('failed');
      expect(ended.get(b.jobId)).toBe('failed');
      expect((await bed.ops.queue.getJob(a.jobId))?.failedReason).toMatch(/^unauthorized: /);
      expect((await bed.ops.queue.getJob(b.jobId))?.failedReason).toMatch(/^deadline_exceeded: last provider error: unreachable: ECONNREFUSED/);
    } finally {
      await worker.close();
    }
    // The failures were logged, with their errors...
    expect(lines.some((l) => l.includes('operation failed'))).toBe(true);
    // ...and the key is nowhere: not in the logs, not in any key or value under the prefix.
    expect(lines.filter((l) => l.includes(SECRET))).toEqual([]);
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
    expect(dump.length).toBeGreaterThan(0);
    expect(dump.filter((v) => v.includes(SECRET))).toEqual([]);
  });
});
