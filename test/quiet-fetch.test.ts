import { Job, Queue, Worker } from 'bullmq';
import { beforeAll, describe, expect, it } from 'vitest';
import { bullmqFetchingScripts, defineQuietFetch, quietScript } from '../src/queues/quiet-fetch.ts';
import { createRedis, type RedisClient } from '../src/queues/redis.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';
import { lease, REDIS_URL, scratchRedis, TestBed } from './helpers/env.ts';
import { RedisProcess } from './helpers/redis-process.ts';

// The quiet fetch (src/queues/quiet-fetch.ts): BullMQ's fetching scripts, with the marker they
// add after every fetch added only while jobs are left to fetch. Everything else they do is
// BullMQ's (pinned by bullmq-contract.test.ts, which shows the stock scripts always mark).
describe('the quiet fetch', () => {
  const { prefix, closers, redis: scratch } = scratchRedis('quiet-fetch');
  let redis: RedisClient;
  beforeAll(() => {
    redis = scratch();
  });

  /** A queue of its own and a manual worker whose connection runs the quiet fetch. */
  async function fresh(name: string) {
    const queue = new Queue(name, { connection: redis, prefix });
    const connection = createRedis(REDIS_URL);
    expect(defineQuietFetch(connection)).toBe(true);
    const worker = new Worker(name, null, { connection, prefix, autorun: false });
    closers.push(async () => {
      await worker.close();
      await queue.close();
      connection.disconnect();
    });
    await worker.waitUntilReady();
    const key = (suffix: string) => `${prefix}:${name}:${suffix}`;
    const marked = async () => (await redis.zscore(key('marker'), '0')) !== null;
    return { queue, worker, key, marked };
  }

  it('adds no marker when it takes the last waiting job, and one while others wait', async () => {
    const { queue, worker, key, marked } = await fresh('fetch');
    await queue.addBulk([1, 2].map((n) => ({ name: 'j', data: {}, opts: { jobId: `fetch-${n}` } })));
    await redis.del(key('marker'));
    expect((await worker.getNextJob('t1', { block: false }))?.id).toBe('fetch-1');
    expect(await marked()).toBe(true);
    await redis.del(key('marker'));
    expect((await worker.getNextJob('t2', { block: false }))?.id).toBe('fetch-2');
    expect(await marked()).toBe(false);
  });

  it('does the same when a completion fetches the next job, and still completes it as BullMQ does', async () => {
    const { queue, worker, key, marked } = await fresh('finish');
    await queue.addBulk([1, 2, 3].map((n) => ({ name: 'j', data: {}, opts: { jobId: `finish-${n}` } })));
    const first = (await worker.getNextJob('t1', { block: false }))!;
    await redis.del(key('marker'));
    const next = await first.moveToCompleted('done', 't1', true);
    expect(next?.[1]).toBe('finish-2');
    expect(await marked()).toBe(true);
    await redis.del(key('marker'));
    // Made on the worker, as BullMQ's own loop makes it, so its completion carries the lock settings.
    const second = (await Job.fromId(worker as unknown as Queue, 'finish-2'))!;
    const last = await second.moveToCompleted('done', 't1', true);
    expect(last?.[1]).toBe('finish-3');
    expect(await marked()).toBe(false);
    expect(await queue.getJobState('finish-1')).toBe('completed');
    expect((await queue.getJob('finish-1'))!.returnvalue).toBe('done');
    expect(await queue.getJobState('finish-3')).toBe('active');
  });

  it('marks while a prioritized job is left, and still promotes a due delayed job', async () => {
    const { queue, worker, key, marked } = await fresh('others');
    await queue.add('p', {}, { jobId: 'others-p1', priority: 1 });
    await queue.add('p', {}, { jobId: 'others-p2', priority: 2 });
    await redis.del(key('marker'));
    expect((await worker.getNextJob('t1', { block: false }))?.id).toBe('others-p1');
    expect(await marked()).toBe(true);
    await queue.add('d', {}, { jobId: 'others-d', delay: 1 });
    await new Promise((resolve) => setTimeout(resolve, 20));
    const taken = [(await worker.getNextJob('t2', { block: false }))?.id, (await worker.getNextJob('t3', { block: false }))?.id];
    expect(taken.sort()).toEqual(['others-d', 'others-p2']);
  });

  it('is refused (BullMQ runs its own scripts) when a script does not read as expected, or a fetch is already defined', async () => {
    for (const script of bullmqFetchingScripts()) {
      expect(quietScript({ ...script, content: script.content.replace('addBaseMarkerIfNeeded(markerKey, false)', 'addBaseMarkerIfNeeded(markerKey, true)') })).toBeNull();
      expect(quietScript({ ...script, content: `${script.content}\naddBaseMarkerIfNeeded(markerKey, false)` })).toBeNull();
      expect(quietScript(script)?.content).toContain('rcall("LLEN", KEYS[1]) > 0 or rcall("ZCARD", KEYS[3]) > 0');
    }
    const connection = createRedis(REDIS_URL);
    try {
      expect(defineQuietFetch(connection)).toBe(true);
      expect(defineQuietFetch(connection)).toBe(false);
    } finally {
      connection.disconnect();
    }
  });

  // Counted on a Redis of its own, so no other test's commands are in its statistics.
  it('runs a hot lane on two worker replicas without waking an idle fetch per operation', async () => {
    const server = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: server.url });
    try {
      const ops = 300;
      await bed.ops.queue.pause();
      const ids: string[] = [];
      for (let i = 0; i < ops; i++) ids.push((await bed.ops.enqueue({ op: 'acquire', lease: lease('hot'), params: { runId: `r${i}` } })).jobId);
      const { provider } = createRecordingProvider();
      await bed.startWorker(provider);
      await bed.startWorker(provider);
      await bed.redis.config('RESETSTAT');
      const ended = bed.waitForAll(ids, 60_000);
      await bed.ops.queue.resume();
      const states = await ended;
      expect([...states.values()].every((s) => s === 'completed')).toBe(true);
      const stats = await bed.redis.info('commandstats');
      const calls = (command: string) => Number(new RegExp(`^cmdstat_${command}:calls=(\\d+)`, 'm').exec(stats)?.[1] ?? 0);
      // Every fetch pops the wait list once (RPOPLPUSH), whether it finds a job or not. The
      // stock fetch, in this very test: 2.3 fetches and 1.0 wake-ups (BZPOPMIN) per operation.
      expect(calls('rpoplpush') / ops).toBeLessThan(1.5);
      expect(calls('bzpopmin') / ops).toBeLessThan(0.3);
    } finally {
      await bed.close();
      await server.stop();
    }
  });
});
