import { Job, Queue, Worker } from 'bullmq';
import { beforeAll, describe, expect, it } from 'vitest';
import { bullmqFetchingScripts, defineQuietFetch, FETCHING_SCRIPTS, quietScript, UNRELEASED_ACQUIRE } from '../src/queues/quiet-fetch.ts';
import { BACKOFF_TYPE } from '../src/queues/operations-queue.ts';
import { createRedis, type RedisClient } from '../src/queues/redis.ts';
import { backoffStrategy, LaneJobsWorker } from '../src/queues/worker.ts';
import { createRecordingProvider, seededFraction } from './helpers/recording-provider.ts';
import { lease, readUntil, REDIS_URL, scratchRedis, TestBed } from './helpers/env.ts';
import { RedisProcess } from './helpers/redis-process.ts';

// The quiet fetch (src/queues/quiet-fetch.ts): BullMQ's fetching scripts, with the marker they
// add after every fetch added only while jobs are left to fetch, the next due time in every
// reply, and an acquire's completion refused until its release recorded its outcome. Everything else they do is
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

  it('marks a retry\'s due time when its backoff step fetched the next job, and marks no more than that', async () => {
    const { queue, worker, key, marked } = await fresh('retry');
    await queue.add('retried', {}, { jobId: 'retry-1', attempts: 2, backoff: { type: 'fixed', delay: 60_000 } });
    await queue.add('next', {}, { jobId: 'retry-2' });
    const job = (await worker.getNextJob('t1', { block: false }))!;
    await redis.del(key('marker'));
    const before = Date.now();
    const next = (await job.moveToFailed(new Error('settling'), 't1', true)) as unknown[];
    expect(next[1]).toBe('retry-2');
    // The marker's score is the next due time: the retry's, 60 s from now.
    const due = Number(await redis.zscore(key('marker'), '1'));
    expect(due).toBeGreaterThanOrEqual(before + 60_000);
    expect(due).toBeLessThanOrEqual(Date.now() + 60_000);
    expect(await marked()).toBe(false);
  });

  it('refuses to complete an acquire whose release has not recorded its outcome (UNRELEASED_ACQUIRE), leaving it active and locked; completes it once the outcome is there, and completes other jobs as BullMQ does', async () => {
    const { queue, worker, key } = await fresh('released');
    await queue.add('acquire', {}, { jobId: 'released-1' });
    await queue.add('stop', {}, { jobId: 'released-2' });
    const acquire = (await worker.getNextJob('t1', { block: false }))!;
    // Cancelled, or its release still to come: no outcome either way.
    await redis.hset(key('released-1'), 'lo:cancel', 'host');
    const refused = await acquire.moveToCompleted('done', 't1', false).then(() => null, (err: Error & { code?: number }) => err);
    expect(refused?.code).toBe(UNRELEASED_ACQUIRE);
    expect(await queue.getJobState('released-1')).toBe('active');
    expect(await redis.get(key('released-1:lock'))).toBe('t1');
    await redis.hdel(key('released-1'), 'lo:cancel');
    expect((await acquire.moveToCompleted('done', 't1', false).then(() => null, (err: Error & { code?: number }) => err))?.code).toBe(UNRELEASED_ACQUIRE);
    // Recorded by its release: completed, and the fetch that follows takes the next job.
    await redis.hset(key('released-1'), 'lo:outcome', '{"status":"completed"}');
    expect((await acquire.moveToCompleted('done', 't1', true))?.[1]).toBe('released-2');
    expect(await queue.getJobState('released-1')).toBe('completed');
    // Another operation completes whatever its hash holds, and failing is never refused.
    const stop = (await Job.fromId(worker as unknown as Queue, 'released-2'))!;
    await stop.moveToCompleted('done', 't1', false);
    expect(await queue.getJobState('released-2')).toBe('completed');
    const failing = await queue.add('acquire', {}, { jobId: 'released-3' });
    expect((await worker.getNextJob('t3', { block: false }))?.id).toBe(failing.id);
    await (await Job.fromId(worker as unknown as Queue, 'released-3'))!.moveToFailed(new Error('cancelled'), 't3', false);
    expect(await queue.getJobState('released-3')).toBe('failed');
  });

  it("a refused acquire's completion with nothing registered for it (LaneJobsWorker): a warning, no worker error, and the job runs again", async () => {
    const name = 'unregistered';
    const queue = new Queue(name, { connection: redis, prefix });
    const connection = createRedis(REDIS_URL);
    expect(defineQuietFetch(connection)).toBe(true);
    const warned: string[] = [];
    const ran = { count: 0 };
    const w = new LaneJobsWorker(name, async () => void ran.count++, { connection, prefix, settings: { backoffStrategy } }, 10, (jobId, message) => warned.push(`${jobId}: ${message}`), async () => false);
    const unsaid: Error[] = [];
    w.on('error', (err) => {
      if (!w.saidErrors.has(err)) unsaid.push(err);
    });
    closers.push(async () => {
      await w.close();
      await queue.close();
      connection.disconnect();
    });
    await queue.add('acquire', {}, { jobId: 'unregistered-1', attempts: 1_000, backoff: { type: BACKOFF_TYPE } });
    // Refused while it has no outcome (each run again 10 ms later), completed once it has one.
    await readUntil(async () => ran.count >= 2, 5_000, 'the job to run again');
    await redis.hset(`${prefix}:${name}:unregistered-1`, 'lo:outcome', '{"status":"completed"}');
    await readUntil(async () => (await queue.getJobState('unregistered-1')) === 'completed', 5_000, 'the job to complete');
    expect(warned[0]).toBe('unregistered-1: its completion was refused before its release had recorded it; it runs again');
    expect(unsaid).toEqual([]);
  });

  it('is refused (BullMQ runs its own scripts) when a script does not read as expected, or a fetch is already defined', async () => {
    bullmqFetchingScripts().forEach((script, i) => {
      const rewrites = FETCHING_SCRIPTS[i]!.rewrites;
      expect(quietScript({ ...script, content: script.content.replace('addBaseMarkerIfNeeded(markerKey, false)', 'addBaseMarkerIfNeeded(markerKey, true)') }, rewrites)).toBeNull();
      expect(quietScript({ ...script, content: `${script.content}\naddBaseMarkerIfNeeded(markerKey, false)` }, rewrites)).toBeNull();
      expect(quietScript(script, rewrites)?.content).toMatch(/rcall\("LLEN", KEYS\[\d+\]\) > 0 or rcall\("ZCARD", KEYS\[3\]\) > 0/);
    });
    const connection = createRedis(REDIS_URL);
    try {
      expect(defineQuietFetch(connection)).toBe(true);
      expect(defineQuietFetch(connection)).toBe(false);
    } finally {
      connection.disconnect();
    }
  });

  it('tells the worker the next due time in every reply: a fetch that took a job, and a retry step that took none', async () => {
    const { queue, worker, key } = await fresh('due');
    await queue.add('later', {}, { jobId: 'due-later', delay: 60_000 });
    await queue.addBulk([1, 2].map((n) => ({ name: 'j', data: {}, opts: { jobId: `due-${n}`, attempts: 2, backoff: { type: 'fixed', delay: 30_000 } } })));
    const laterDue = Math.floor(Number(await redis.zscore(key('delayed'), 'due-later')) / 0x1000);
    const backend = (worker as unknown as { backend: { moveToActive(token: string, name?: string): Promise<unknown[]> } }).backend;
    // BullMQ's stock fetch replies 0 here (pinned in bullmq-contract.test.ts).
    const fetched = await backend.moveToActive('t1');
    expect(fetched[1]).toBe('due-1');
    expect(fetched[3]).toBe(laterDue);
    const job = (await Job.fromId(worker as unknown as Queue, 'due-1'))!;
    const second = (await job.moveToFailed(new Error('settling'), 't1', true)) as unknown[];
    expect(second[1]).toBe('due-2');
    const retryDue = Math.floor(Number(await redis.zscore(key('delayed'), 'due-1')) / 0x1000);
    expect(second[3]).toBe(retryDue);
    // The last retry step with nothing left to fetch: the reply names the retry's due time.
    const last = (await Job.fromId(worker as unknown as Queue, 'due-2'))!;
    const none = (await last.moveToFailed(new Error('settling'), 't1', true)) as unknown[];
    expect(none).toEqual([null, 0, 0, retryDue]);
  });

  // Two worker replicas, two busy leases, many short backoffs: a retry whose due time every
  // worker had lost (or never heard) waits out an idle worker's blocking fetch (1 s) instead.
  // With BullMQ's stock replies, 4 runs of 4 here saw such a retry (1,005 to 1,049 ms).
  it('starts backoff retries at their due time on two replicas under load, not at an idle fetch\'s timeout', async () => {
    const bed = await TestBed.create({ LEASE_OPS_BACKOFF_BASE_MS: '20', LEASE_OPS_BACKOFF_CAP_MS: '200' });
    try {
      // Every third first attempt settles: 20 retries, however the job ids (random per run) fall.
      let firstAttempts = 0;
      const recording = createRecordingProvider({
        behaviour: async ({ ctx }) => {
          const key = `${ctx.jobId}:${ctx.attempt}`;
          await new Promise((resolve) => setTimeout(resolve, Math.floor(seededFraction('retries', `d:${key}`) * 30)));
          return ctx.attempt === 1 && firstAttempts++ % 3 === 0 ? 'settling' : 'ok';
        },
      });
      await bed.startWorker(recording.provider);
      await bed.startWorker(recording.provider);
      const ids: string[] = [];
      for (let k = 0; k < 30; k++) {
        for (let l = 0; l < 2; l++) ids.push((await bed.ops.enqueue({ op: 'acquire', lease: lease(`retries-${l}`), params: { runId: `r${k}` } })).jobId);
      }
      expect([...(await bed.waitForAll(ids, 30_000)).values()].every((s) => s === 'completed')).toBe(true);
      const calls = recording.calls.filter((c) => c.end).sort((a, b) => (BigInt(a.start) < BigInt(b.start) ? -1 : 1));
      const retryGaps: number[] = [];
      for (const c of calls) {
        if (c.outcome !== 'settling') continue;
        const next = calls.find((n) => n.jobId === c.jobId && n.attempt === c.attempt + 1)!;
        retryGaps.push(Number(BigInt(next.start) - BigInt(c.end!)) / 1e6);
      }
      expect(retryGaps).toHaveLength(20);
      // The longest backoff here is 250 ms (200 ms with jitter up to 1.25); a lost one, 1 s more.
      expect(Math.max(...retryGaps)).toBeLessThan(950);
    } finally {
      await bed.close();
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
      const ended = bed.waitForAll(ids, 30_000);
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
