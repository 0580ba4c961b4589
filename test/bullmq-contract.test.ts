import { DelayedError, Job, Queue, QueueEvents, UnrecoverableError, Worker, type Processor, type WorkerOptions } from 'bullmq';
import { beforeAll, describe, expect, it } from 'vitest';
import { BULLMQ_TESTED_RANGE, checkBullmqVersion } from '../src/queues/bullmq-version.ts';
import { bullmqFetchingScripts, FETCHING_SCRIPTS, quietScript } from '../src/queues/quiet-fetch.ts';
import { openQueueEvents, WaitedQueue, waitForJobEnd } from '../src/queues/queue-events.ts';
import { createRedis, keepCopies, type RedisClient } from '../src/queues/redis.ts';
import { LOCK_RENEWAL_FAILED, REMOVED_END, SUPERSEDED_END } from '../src/queues/worker.ts';
import { WAIT_TIMED_OUT } from '../src/client.ts';
import { gate, readUntil, REDIS_URL, rejectionOf, scratchRedis, waitForJobs } from './helpers/env.ts';

// What lease-ops relies on inside BullMQ, pinned: the lane scripts write BullMQ's keys and
// fields (delayed set, wait list, marker, events, a job's delay and progress), and the worker
// reads its counters (attempts made and started, stalls). An upgrade that changes any of
// these fails here, by name, before it can quietly break a lane.
describe('BullMQ, as lease-ops relies on it', () => {
  const { prefix, closers, redis: scratch } = scratchRedis('bullmq-contract');
  let redis: RedisClient;
  beforeAll(() => {
    redis = scratch();
  });

  /** A queue of its own for one test, so no test's worker takes another's jobs. */
  async function fresh(name: string) {
    const queue = new Queue(name, { connection: redis, prefix });
    const eventsConnection = createRedis(REDIS_URL);
    const events = new QueueEvents(name, { connection: eventsConnection, prefix });
    await events.waitUntilReady();
    closers.push(() => queue.close(), async () => {
      await events.close();
      eventsConnection.disconnect();
    });
    const key = (suffix: string) => `${prefix}:${name}:${suffix}`;
    const startWorker = async (processor: Processor | null, opts: Partial<WorkerOptions> = {}) => {
      const connection = createRedis(REDIS_URL);
      const w = new Worker(name, processor, { connection, prefix, ...opts });
      closers.push(async () => {
        await w.close();
        connection.disconnect();
      });
      await w.waitUntilReady();
      return w;
    };
    return { queue, events, key, startWorker };
  }

  it("a job's completion and failure reach waitForJobEnd as its events name them (completed:<id>, failed:<id>), also for a job that ended before the wait began; and a wait whose client is gone ends at its signal with nothing unhandled and no timer left (helper-39)", async () => {
    const { queue, events, startWorker } = await fresh('job-end');
    const stop = new AbortController();
    await startWorker(async (job) => {
      if (job.data.fail) throw new Error('it failed');
      return { answer: job.data.n };
    });
    const done = await queue.add('j', { n: 1 }, { jobId: 'done-before' });
    await readUntil(async () => (await Job.fromId(queue, done.id!))?.finishedOn, 5_000, 'the job to end');
    expect(await waitForJobEnd(queue, done.id!, events, 5_000, stop.signal)).toEqual({ answer: 1 });
    const later = await queue.add('j', { n: 2 }, { jobId: 'done-later' });
    expect(await waitForJobEnd(queue, later.id!, events, 5_000, stop.signal)).toEqual({ answer: 2 });
    const failing = await queue.add('j', { fail: true }, { jobId: 'failing' });
    expect(((await rejectionOf(waitForJobEnd(queue, failing.id!, events, 5_000, stop.signal))) as Error).message).toBe('it failed');
    // The queue's own connection gone (as a client's at its close), no offline queue: its first
    // read fails, and the wait ends at its signal.
    const gone = createRedis(REDIS_URL, { enableOfflineQueue: false });
    const goneQueue = new Queue('job-end', { connection: gone, prefix });
    await goneQueue.waitUntilReady();
    gone.disconnect();
    const waiting = waitForJobEnd(goneQueue, 'never', events, 600_000, stop.signal);
    stop.abort();
    expect(((await rejectionOf(waiting)) as Error).message).toMatch(/closing/);
  });

  it('holds any number of waits at once on a WaitedQueue (probes, execs) without a MaxListenersExceededWarning on its closing signal, and ends them all at its close', async () => {
    const waited = new WaitedQueue(redis, { REDIS_URL, LEASE_OPS_PREFIX: prefix }, 'many-waits', 'lease-ops-test-waits');
    const warnings: Error[] = [];
    const onWarning = (w: Error) => warnings.push(w);
    process.on('warning', onWarning);
    try {
      const { events } = await waited.open();
      const waits = Array.from({ length: 25 }, (_, i) => rejectionOf(waited.waitFor(`never-${i}`, events, 600_000)));
      await new Promise((resolve) => setImmediate(resolve));
      await waited.close();
      const ends = (await Promise.all(waits)) as Error[];
      expect(ends.map((e) => e.message)).toEqual(Array.from({ length: 25 }, (_, i) => `the wait for job never-${i} ended: its queue is closing`));
      // Node emits the warning on the next tick after the eleventh listener.
      await new Promise((resolve) => setImmediate(resolve));
      expect(warnings.filter((w) => w.name === 'MaxListenersExceededWarning').map((w) => w.message)).toEqual([]);
    } finally {
      process.off('warning', onWarning);
    }
  });

  it("hands handleCompleted the job object its processor got, and fails the job (once, for good if unrecoverable) with what handleCompleted throws: how a refused completion of a cancelled acquire is ended (worker.ts)", async () => {
    const { queue } = await fresh('completion-step');
    const seen: { processed: Job[]; completed: Job[] } = { processed: [], completed: [] };
    class Stepped extends Worker {
      protected override async handleCompleted(_result: unknown, job: Job): Promise<Job> {
        seen.completed.push(job);
        throw new UnrecoverableError('refused at its completion');
      }
    }
    const connection = createRedis(REDIS_URL);
    const w = new Stepped('completion-step', async (job) => void seen.processed.push(job), { connection, prefix });
    const errors: Error[] = [];
    w.on('error', (err) => errors.push(err));
    closers.push(async () => {
      await w.close();
      connection.disconnect();
    });
    await queue.add('j', {}, { jobId: 'completion-step-1', attempts: 3 });
    await readUntil(async () => (await queue.getJobState('completion-step-1')) === 'failed', 5_000, 'the job to fail');
    const job = (await Job.fromId(queue, 'completion-step-1'))!;
    expect({ reason: job.failedReason, attemptsMade: job.attemptsMade }).toEqual({ reason: 'refused at its completion', attemptsMade: 1 });
    expect(seen.completed).toHaveLength(1);
    expect(seen.completed[0]).toBe(seen.processed[0]);
    // BullMQ also emits what handleCompleted threw as a worker error (worker.ts does not log it again).
    expect(errors.map((e) => e.message)).toEqual(['refused at its completion']);
  });

  it('is the version lease-ops was tested with (a startup check refuses others)', async () => {
    const { readFileSync } = await import('node:fs');
    const installed = (JSON.parse(readFileSync(new URL('../node_modules/bullmq/package.json', import.meta.url), 'utf8')) as { version: string }).version;
    expect(checkBullmqVersion(installed)).toBeNull();
    expect(checkBullmqVersion('6.8.0')).toMatch(new RegExp(`BullMQ 6\\.8\\.0 .*${BULLMQ_TESTED_RANGE.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}`));
    expect(checkBullmqVersion('5.9.9')).not.toBeNull();
  });

  it('keeps a delayed job in the delayed set, scored by due time x 4096 (+ a tie counter), with its delay in the hash', async () => {
    const { queue, key } = await fresh('delayed');
    const before = Date.now();
    const job = await queue.add('d', { a: 1 }, { jobId: 'delayed-1', delay: 60_000 });
    const score = Number(await redis.zscore(key('delayed'), job.id!));
    expect(Math.floor(score / 4096)).toBeGreaterThanOrEqual(before + 60_000);
    expect(Math.floor(score / 4096)).toBeLessThanOrEqual(Date.now() + 60_000);
    expect(await redis.hget(key(job.id!), 'delay')).toBe('60000');
    expect(await queue.getJobState(job.id!)).toBe('delayed');
  });

  it('adds nothing when a job id already exists: the first job stays as it was', async () => {
    const { queue } = await fresh('same-id');
    await queue.add('first', { n: 1 }, { jobId: 'same-id', delay: 60_000 });
    await queue.add('second', { n: 2 }, { jobId: 'same-id' });
    const job = await Job.fromId(queue, 'same-id');
    expect({ name: job!.name, data: job!.data, state: await queue.getJobState('same-id') }).toEqual({ name: 'first', data: { n: 1 }, state: 'delayed' });
  });

  it("fails a whole listing on one job whose data is not JSON (SyntaxError), and names the states as getRanges takes them with sanitizeJobTypes: the board's adapter reads job by job then", async () => {
    const { queue, key } = await fresh('unreadable');
    await queue.add('fine', { n: 1 }, { jobId: 'fine' });
    await redis.hset(key('broken'), { name: 'stop', data: '{not json', opts: '{}', timestamp: String(Date.now()) });
    await redis.lpush(key('wait'), 'broken');
    await expect(queue.getJobs(['waiting'])).rejects.toBeInstanceOf(SyntaxError);
    const sanitize = (queue as unknown as { sanitizeJobTypes(types: unknown): string[] }).sanitizeJobTypes;
    expect(typeof sanitize).toBe('function');
    const types = sanitize.call(queue, ['waiting']);
    expect(await queue.getRanges(types as never, 0, -1, false)).toEqual(['broken', 'fine']);
  });

  it('runs a delayed job at once when it is moved to the wait list as promote does it (wait, marker, event, delay 0)', async () => {
    const { queue, key, startWorker } = await fresh('hand-off');
    const ran = gate<string>();
    await startWorker(async (job) => ran.open(job.id!), { drainDelay: 5 });
    const job = await queue.add('p', {}, { jobId: 'hand-off-1', delay: 3_600_000 });
    // The steps of lease-ops' hand-off (src/queues/lua/includes/lane.lua, handOff), here by hand.
    await redis
      .multi()
      .zrem(key('delayed'), job.id!)
      .lpush(key('wait'), job.id!)
      .zadd(key('marker'), 0, '0')
      .xadd(key('events'), '*', 'event', 'waiting', 'jobId', job.id!, 'prev', 'delayed')
      .hset(key(job.id!), 'delay', 0, 'progress', '{"lane":"handed-off","fence":"7"}')
      .exec();
    const started = Date.now();
    expect(await ran.promise).toBe('hand-off-1');
    expect(Date.now() - started).toBeLessThan(2_000);
  });

  it('marks the queue after every fetch, even of the last waiting job (what the quiet fetch changes), in both fetching scripts alike', async () => {
    const { queue, key, startWorker } = await fresh('fetch-marker');
    const w = await startWorker(null, { autorun: false });
    await queue.add('only', {}, { jobId: 'fetch-marker-1' });
    await redis.del(key('marker'));
    const job = await w.getNextJob('token-1', { block: false });
    expect(job?.id).toBe('fetch-marker-1');
    expect(await redis.llen(key('wait'))).toBe(0);
    expect(await redis.zscore(key('marker'), '0')).toBe('0');
    // The texts the quiet fetch rewrites, each once in its script, and the keys it reads there.
    bullmqFetchingScripts().forEach((script, i) => {
      const quiet = quietScript(script, FETCHING_SCRIPTS[i]!.rewrites);
      expect(quiet, script.name).not.toBeNull();
      const [, wait, prioritized] = /rcall\("LLEN", KEYS\[(\d+)\]\) > 0 or rcall\("ZCARD", KEYS\[(\d+)\]\)/.exec(quiet!.content)!;
      expect(script.content, script.name).toContain(`KEYS[${wait}] wait key`);
      expect(script.content, script.name).toContain(`KEYS[${prioritized}] prioritized key`);
      for (const [, delayed] of quiet!.content.matchAll(/getNextDelayedTimestamp\(KEYS\[(\d+)\]\)/g)) expect(script.content, script.name).toContain(`KEYS[${delayed}] delayed key`);
    });
  });

  it('replies "no due time" to a fetch that took a job, and [] (read as a fetch that knows of no delayed job) to a retry step that took none', async () => {
    const { queue, startWorker } = await fresh('due-replies');
    const w = await startWorker(null, { autorun: false });
    await queue.add('later', {}, { jobId: 'due-replies-later', delay: 60_000 });
    await queue.add('retried', {}, { jobId: 'due-replies-1', attempts: 2, backoff: { type: 'fixed', delay: 30_000 } });
    const backend = (w as unknown as { backend: { moveToActive(token: string, name?: string): Promise<unknown[]> } }).backend;
    const fetched = await backend.moveToActive('token-1');
    expect([fetched[1], fetched[3]]).toEqual(['due-replies-1', 0]);
    const job = (await Job.fromId(w as unknown as Queue, 'due-replies-1'))!;
    // BullMQ's worker passes this reply's 3rd and 4th items to updateDelays, resetting its due time.
    expect(await job.moveToFailed(new Error('settling'), 'token-1', true)).toEqual([]);
  });

  it('does not mark a retry\'s due time when the retry\'s own step (moveToDelayed) fetched the next job (what the quiet fetch adds)', async () => {
    const { queue, key, startWorker } = await fresh('retry-marker');
    const w = await startWorker(null, { autorun: false });
    await queue.add('retried', {}, { jobId: 'retry-marker-1', attempts: 2, backoff: { type: 'fixed', delay: 60_000 } });
    await queue.add('next', {}, { jobId: 'retry-marker-2' });
    const job = (await w.getNextJob('token-1', { block: false }))!;
    await redis.del(key('marker'));
    const next = (await job.moveToFailed(new Error('settling'), 'token-1', true)) as unknown[];
    expect(next[1]).toBe('retry-marker-2');
    expect(await queue.getJobState('retry-marker-1')).toBe('delayed');
    expect(await redis.zscore(key('marker'), '1')).toBeNull();
  });

  it('promote itself writes what the hand-off writes, so the two stay the same', async () => {
    const { queue, key } = await fresh('promote');
    const job = await queue.add('q', {}, { jobId: 'promote-1', delay: 3_600_000 });
    await redis.del(key('marker'));
    const streamBefore = (await redis.xrevrange(key('events'), '+', '-', 'COUNT', 1))[0]?.[0] ?? '0';
    await job.promote();
    expect(await redis.zscore(key('delayed'), job.id!)).toBeNull();
    expect((await redis.lrange(key('wait'), 0, -1)).includes(job.id!) || (await queue.getJobState(job.id!)) !== 'delayed').toBe(true);
    expect(await redis.hget(key(job.id!), 'delay')).toBe('0');
    const after = await redis.xrange(key('events'), `(${streamBefore}`, '+');
    const waiting = after.map(([, f]) => f).find((f) => f.includes('promote-1') && f.includes('waiting'));
    expect(waiting).toEqual(['event', 'waiting', 'jobId', 'promote-1', 'prev', 'delayed']);
  });

  it('hands the processor its progress field parsed from JSON, and its lock token in <job>:lock', async () => {
    const { queue, key, startWorker } = await fresh('progress');
    const seen = gate<{ progress: unknown; lock: string | null; token: string | undefined; ats: number; atm: number }>();
    await queue.add('progress', {}, { jobId: 'progress-1', delay: 3_600_000 });
    await redis.hset(key('progress-1'), 'progress', '{"lane":"handed-off","fence":"42"}');
    await startWorker(async (job, token) => {
      if (job.id !== 'progress-1') return;
      seen.open({ progress: job.progress, lock: await redis.get(key('progress-1:lock')), token, ats: job.attemptsStarted, atm: job.attemptsMade });
    });
    await (await Job.fromId(queue, 'progress-1'))!.promote();
    const s = await seen.promise;
    expect(s.progress).toEqual({ lane: 'handed-off', fence: '42' });
    expect(s.lock).toBe(s.token);
    expect({ ats: s.ats, atm: s.atm }).toEqual({ ats: 1, atm: 0 });
  });

  it('counts attempts: a retry and the final end each add one to attemptsMade; retrying a finished job keeps it; finishedOn goes', async () => {
    const { queue, events, key, startWorker } = await fresh('counted');
    let runs = 0;
    const w = await startWorker(
      async (job) => {
        if (job.name !== 'counted') return;
        runs++;
        if (runs === 1) throw new Error('once more');
        return 'done';
      },
      { settings: { backoffStrategy: () => 10 } },
    );
    const job = await queue.add('counted', {}, { jobId: 'counted-1', attempts: 5, backoff: { type: 'custom' } });
    await waitForJobs(events, queue, [job.id!], 10_000);
    expect(await redis.hmget(key(job.id!), 'atm', 'ats')).toEqual(['2', '2']);
    expect(await redis.hexists(key(job.id!), 'finishedOn')).toBe(1);
    const done = (await Job.fromId(queue, job.id!))!;
    const ranAgain = new Promise<void>((resolve) => events.once('completed', () => resolve()));
    // Paused, so the retried job is read before it runs again (on a busy machine it ran first).
    await w.pause();
    await done.retry('completed');
    expect(await redis.hexists(key(job.id!), 'finishedOn')).toBe(0);
    w.resume();
    await ranAgain;
    expect(await redis.hget(key(job.id!), 'atm')).toBe('3');
  });

  it('keeps fields it does not know (lease-ops\' lo:*) through a job\'s whole life', async () => {
    const { queue, events, key, startWorker } = await fresh('keeps');
    await startWorker(async (job) => (job.name === 'keeps' ? 'ok' : undefined));
    const job = await queue.add('keeps', {}, { jobId: 'keeps-1', delay: 3_600_000 });
    await redis.hset(key(job.id!), 'lo:outcome', '{"status":"completed"}', 'lo:parked', '1');
    await job.promote();
    await waitForJobs(events, queue, [job.id!], 10_000);
    expect(await redis.hmget(key(job.id!), 'lo:outcome', 'lo:parked')).toEqual(['{"status":"completed"}', '1']);
  });

  it('stores every job with its name in its hash, from its add to its end (the lane scripts read a missing name as a removed job)', async () => {
    const { queue, events, key, startWorker } = await fresh('named');
    const seen: (string | null)[] = [];
    await startWorker(async (job) => {
      seen.push(await redis.hget(key(job.id!), 'name'));
      return 'ok';
    });
    const delayed = await queue.add('named', {}, { jobId: 'named-1', delay: 3_600_000 });
    expect(await redis.hget(key(delayed.id!), 'name')).toBe('named');
    const waiting = await queue.add('named', {}, { jobId: 'named-2' });
    await waitForJobs(events, queue, [waiting.id!], 10_000);
    expect(seen).toEqual(['named']);
    expect(await redis.hget(key(waiting.id!), 'name')).toBe('named');
    await delayed.remove();
    expect(await redis.hget(key(delayed.id!), 'name')).toBeNull();
  });

  it('leaves a job delayed (not failed) when its processor moved it there and threw DelayedError; fails an UnrecoverableError at once', async () => {
    const { queue, events, key, startWorker } = await fresh('park');
    await startWorker(async (job, token) => {
      if (job.name === 'park') {
        await job.moveToDelayed(Date.now() + 3_600_000, token);
        throw new DelayedError();
      }
      if (job.name === 'unrecoverable') throw new UnrecoverableError('no: for good');
    });
    const parked = await queue.add('park', {}, { jobId: 'park-1' });
    const unrecoverable = await queue.add('unrecoverable', {}, { jobId: 'unrec-1', attempts: 10 });
    await waitForJobs(events, queue, [unrecoverable.id!], 10_000);
    expect(await queue.getJobState(unrecoverable.id!)).toBe('failed');
    expect((await Job.fromId(queue, unrecoverable.id!))!.attemptsMade).toBe(1);
    const parkedAt = await new Promise<string>((resolve) => {
      const check = async () => {
        const state = await queue.getJobState(parked.id!);
        if (state === 'delayed') resolve(state);
        else setImmediate(() => void check());
      };
      void check();
    });
    expect(parkedAt).toBe('delayed');
    expect(Math.floor(Number(await redis.zscore(key('delayed'), parked.id!)) / 4096)).toBeGreaterThan(Date.now() + 3_500_000);
  });

  it('counts a stall in stc (job.stalledCounter) and, with the stall limit out of reach, never defers a failure', async () => {
    const { queue, key, startWorker } = await fresh('stall');
    // A job whose lock is gone is a stall: the stall check moves it back to wait and counts it.
    const job = await queue.add('stall', {}, { jobId: 'stall-1' });
    await redis.multi().lrem(key('wait'), 0, job.id!).lpush(key('active'), job.id!).sadd(key('stalled'), job.id!).exec();
    const ran = gate<{ stalled: number; deferred: string | null }>();
    await startWorker(
      async (j) => {
        if (j.id === 'stall-1') ran.open({ stalled: j.stalledCounter, deferred: await redis.hget(key(j.id), 'defa') });
      },
      { maxStalledCount: 1_000_000_000, stalledInterval: 200 },
    );
    expect(await ran.promise).toEqual({ stalled: 1, deferred: null });
  });

  it('says a lost lock twice: lockRenewalFailed with the job ids, then an error "could not renew lock for job <id>" (the worker logs the first and drops the second)', async () => {
    const { queue, key, startWorker } = await fresh('renewal');
    const running = gate();
    const release = gate();
    const w = await startWorker(
      async () => {
        running.open();
        await release.promise;
      },
      { lockDuration: 400 },
    );
    const said: string[] = [];
    w.on('lockRenewalFailed', (ids) => said.push(`lockRenewalFailed ${ids.join(',')}`));
    const errored = gate<string>();
    const ended = gate<string>();
    w.on('error', (err) => (LOCK_RENEWAL_FAILED.test(err.message) ? errored.open(err.message) : ended.open(err.message)));
    await queue.add('renewal', {}, { jobId: 'renewal-1' });
    await running.promise;
    // The lock taken away from under the worker (its outage outlasted it, say).
    await redis.del(key('renewal-1:lock'));
    expect(await errored.promise).toBe('could not renew lock for job renewal-1');
    expect(said).toEqual(['lockRenewalFailed renewal-1']);
    expect(LOCK_RENEWAL_FAILED.test('could not renew lock for job renewal-1')).toBe(true);
    // The attempt ends anyway: BullMQ refuses its completion, with the error lease-ops logs as a superseded end.
    release.open();
    const refused = await ended.promise;
    expect(refused).toMatch(/^Missing lock for job renewal-1\. moveToFinished/);
    expect(SUPERSEDED_END.test(refused)).toBe(true);
  });

  /** The error BullMQ answers an attempt's end with, after `meanwhile` changed its job while it ran. */
  async function endRefusedAfter(name: string, meanwhile: (jobKey: (suffix: string) => string, queue: Queue) => Promise<void>): Promise<string> {
    const { queue, key, startWorker } = await fresh(name);
    const running = gate();
    const release = gate();
    const w = await startWorker(async () => {
      running.open();
      await release.promise;
    });
    const ended = gate<string>();
    w.on('error', (err) => ended.open(err.message));
    await queue.add(name, {}, { jobId: `${name}-1` });
    await running.promise;
    await meanwhile((suffix) => key(`${name}-1${suffix}`), queue);
    release.open();
    return ended.promise;
  }

  it('refuses the end of an attempt whose lock another holds now (a successor took it over) with "Lock mismatch", which lease-ops logs as a superseded end too (helper-43)', async () => {
    const refused = await endRefusedAfter('mismatch', async (jobKey) => void (await redis.set(jobKey(':lock'), 'the-successors-token')));
    expect(refused).toMatch(/^Lock mismatch for job mismatch-1\. Cmd moveToFinished from active/);
    expect(SUPERSEDED_END.test(refused)).toBe(true);
  });

  it('refuses the end of an attempt whose job was removed meanwhile (its lock lapsed, then an operator removed it) with "Missing key", which lease-ops logs as a warning (helper-45)', async () => {
    const refused = await endRefusedAfter('removed', async (jobKey, queue) => {
      await redis.del(jobKey(':lock'));
      expect(await queue.remove('removed-1')).toBe(1);
    });
    expect(refused).toMatch(/^Missing key for job removed-1\. moveToFinished/);
    expect(REMOVED_END.test(refused)).toBe(true);
    expect(SUPERSEDED_END.test(refused)).toBe(false);
  });

  it('runs a Worker\'s fetches on copies it makes with duplicate() of the connection it is given, and closes them (what closeForGood reaches)', async () => {
    const name = 'copies';
    const given = createRedis(REDIS_URL);
    const copies: RedisClient[] = [];
    keepCopies(given, copies);
    const w = new Worker(name, async () => undefined, { connection: given, prefix, autorun: false });
    closers.push(() => given.disconnect());
    await w.waitUntilReady();
    void w.run();
    // The blocking fetch runs on a copy named <prefix>:<queue name in base64>.
    const copyName = `${prefix}:${Buffer.from(name).toString('base64')}`;
    await expect.poll(async () => ((await redis.call('CLIENT', 'LIST')) as string).includes(`name=${copyName} `)).toBe(true);
    expect(copies.length).toBeGreaterThanOrEqual(2);
    await w.close();
    expect(copies.slice(1).map((c) => c.status)).toEqual(copies.slice(1).map(() => 'end'));
  });

  it("says a wait for a job's end timed out in its error's message (what a wait woken by an end is told apart by: WAIT_TIMED_OUT)", async () => {
    const { queue, events } = await fresh('wait-timeout');
    const job = await queue.add('never-runs', {}, { jobId: 'never-runs' });
    const timedOut = await rejectionOf(job.waitUntilFinished(events, 20));
    expect(timedOut).toBeInstanceOf(Error);
    expect((timedOut as Error).message).toMatch(WAIT_TIMED_OUT);
  });

  it("ends a wait for a job's end when its queue emits 'closing' (what LeaseOpsClient.close wakes its waits by), and Queue.close alone emits none", async () => {
    const { queue, events } = await fresh('wait-closing');
    const job = await queue.add('never-runs', {}, { jobId: 'never-runs' });
    const closings: unknown[] = [];
    (queue as unknown as NodeJS.EventEmitter).on('closing', (why: unknown) => closings.push(why));
    const waiting = rejectionOf(job.waitUntilFinished(events, 60_000));
    // Its listener is on before the wait checks the job (an await in between).
    await readUntil(async () => queue.listenerCount('closing') > 1, 5_000, "the wait's listener");
    (queue as unknown as NodeJS.EventEmitter).emit('closing', 'the client closed');
    const ended = await waiting;
    expect(ended).toBeInstanceOf(Error);
    expect((ended as Error).message).toBe('the client closed');
    // BullMQ's own close says nothing to a wait: a listener of ours hears only our emit.
    await queue.close();
    expect(closings).toEqual(['the client closed']);
  });

  it("says a job's removal on its event stream by its name (removed:<id>), which ends lease-ops' waits on it (LeaseOpsClient.waitForEndOf)", async () => {
    const { queue } = await fresh('wait-removed');
    // The stream as lease-ops opens it, from its end as it is now: BullMQ's default ('$') reads
    // from where it ends when its first read starts, and lost the removal in a CI run.
    const { events, connection } = await openQueueEvents(REDIS_URL, 'wait-removed', prefix);
    closers.push(async () => {
      await events.close();
      connection.disconnect();
    });
    const job = await queue.add('never-runs', {}, { jobId: 'never-runs', delay: 60_000 });
    const removed = new Promise((resolve) => (events as unknown as NodeJS.EventEmitter).once('removed:never-runs', resolve));
    await job.remove();
    expect(await removed).toMatchObject({ jobId: 'never-runs' });
  });

  it('names the states lease-ops maps: delayed, waiting, active, completed, failed, unknown', async () => {
    const { queue } = await fresh('states');
    expect(await queue.getJobState('no-such-job')).toBe('unknown');
    await queue.add('d', {}, { jobId: 'd', delay: 60_000 });
    await queue.add('w', {}, { jobId: 'w' });
    expect([await queue.getJobState('d'), await queue.getJobState('w')]).toEqual(['delayed', 'waiting']);
  });

  it('QueueEvents reading from "$" misses an end written before its first read; opened from the stream\'s end as read before (openQueueEvents), it does not', async () => {
    const endOf = (jobId: string) => ['event', 'completed', 'jobId', jobId, 'returnvalue', '1'];
    const streamOf = (name: string) => `${prefix}:${name}:events`;

    // BullMQ's default: '$' means "the end when the first XREAD runs". An end written
    // before that read (here: before run() starts the loop) is never delivered.
    const name = 'events-bullmq-default';
    await redis.xadd(streamOf(name), '*', 'event', 'older', 'jobId', 'x');
    const connection = createRedis(REDIS_URL);
    const events = new QueueEvents(name, { connection, prefix, autorun: false });
    closers.push(async () => {
      await events.close();
      connection.disconnect();
    });
    const seen: string[] = [];
    events.on('completed', ({ jobId }) => void seen.push(jobId));
    await redis.xadd(streamOf(name), '*', ...endOf('early'));
    const running = events.run();
    running.catch(() => undefined);
    // Ends written after the loop started are delivered: write them until one is seen (the
    // first XREAD may not have run yet when the first is written).
    const delivered = new Promise<void>((resolve) => events.once('completed', () => resolve()));
    for (let i = 0; seen.length === 0; i++) {
      await redis.xadd(streamOf(name), '*', ...endOf(`late-${i}`));
      await Promise.race([delivered, new Promise((r) => setTimeout(r, 50))]);
    }
    expect(seen).not.toContain('early');
    expect(seen[0]).toMatch(/^late-/);

    // openQueueEvents fixes the start as read before it returns: an end written at any time
    // after that, before or after the first XREAD, is delivered, and nothing older is.
    await redis.xadd(streamOf('events-opened'), '*', ...endOf('before-open'));
    const opened = await openQueueEvents(REDIS_URL, 'events-opened', prefix);
    closers.push(async () => {
      await opened.events.close();
      opened.connection.disconnect();
    });
    const seenOpened: string[] = [];
    opened.events.on('completed', ({ jobId }) => void seenOpened.push(jobId));
    const late = new Promise<void>((resolve) => opened.events.on('completed', ({ jobId }) => jobId === 'late' && resolve()));
    await redis.xadd(streamOf('events-opened'), '*', ...endOf('early'));
    await redis.xadd(streamOf('events-opened'), '*', ...endOf('late'));
    await late;
    expect(seenOpened).toEqual(['early', 'late']);
  });
});
