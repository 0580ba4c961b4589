// Helper-29's attack: a reply lost after Redis ran a script (the link cut as the reply came).
// ioredis sends unanswered commands again when it reconnects, so the script runs twice. Each
// case runs through a proxy that cuts the link when the script's reply comes.
import { createHash } from 'node:crypto';
import { afterEach, describe, expect, it } from 'vitest';
import type { LeaseIdentity } from '../../src/lease.ts';
import { redisRateLimiters } from '../../src/providers/pacing.ts';
import { LeaseHistory } from '../../src/queues/lease-history.ts';
import { LeaseRecords } from '../../src/queues/lease-records.ts';
import { loadLuaScript, luaCommand, registeredLuaScript } from '../../src/queues/lua-scripts.ts';
import { OperationsQueue } from '../../src/queues/operations-queue.ts';
import { OperatorActions } from '../../src/queues/operator-actions.ts';
import { createRedis } from '../../src/queues/redis.ts';
import { readUntil, scanKeys, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';
import { RedisProcess } from '../helpers/redis-process.ts';
import { TcpProxy } from '../helpers/tcp-proxy.ts';

const escape = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
/**
 * A script's call on the wire: ioredis sends its whole text (EVAL) on a connection's first
 * use and its sha (EVALSHA) after, so either, then `rest`.
 */
const scriptCall = (name: string, rest: string) =>
  new RegExp(`(?:${createHash('sha1').update(registeredLuaScript(name)).digest('hex')}|${escape(loadLuaScript(name).slice(0, 200))})[\\s\\S]*${rest}`);

const cleanups: (() => Promise<unknown> | void)[] = [];
afterEach(async () => {
  for (const clean of cleanups.splice(0).reverse()) await clean();
});

async function bedWith(overrides: Record<string, string> = {}): Promise<TestBed> {
  const bed = await TestBed.create(overrides);
  cleanups.push(() => bed.close());
  return bed;
}

/** A proxy in front of the bed's Redis, and a queue of operations through it. */
async function throughProxy(bed: TestBed): Promise<{ proxy: TcpProxy; ops: OperationsQueue }> {
  const proxy = await TcpProxy.start(Number(new URL(bed.config.REDIS_URL).port || 6379));
  cleanups.push(() => proxy.close());
  const ops = new OperationsQueue(createRedis(proxy.url), bed.config);
  cleanups.push(() => ops.close());
  return { proxy, ops };
}

const answerOf = <T>(promise: Promise<T>) => promise.then((value) => ({ value }), (err: Error) => ({ err: `${err.name}: ${err.message}` }));

describe('an operator action whose reply is lost answers as it did, and does what it says once', () => {
  it('cancel of a queued stop: answered cancelled, its history says so', async () => {
    const bed = await bedWith();
    const { proxy, ops } = await throughProxy(bed);
    const identity: LeaseIdentity = { provider: 'recording', companyId: 'cancel-queued', environmentId: 'env', leaseId: 'c1' };
    // No worker: the resume is handed off (waiting), the stop queued behind it.
    const head = await bed.ops.enqueue({ op: 'resume', lease: identity, params: { providerLeaseId: 'c1', leaseMetadata: {} } });
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity, params: { providerLeaseId: 'c1' }, deadlineMs: 600_000 });
    proxy.loseNextReplyTo(scriptCall('lane-drop', stop.jobId));
    const answer = await answerOf(new OperatorActions(ops).cancel(stop.jobId, 'op'));
    expect(proxy.lostReplies).toBe(1);
    expect(answer).toMatchObject({ value: { cancelled: true } });
    expect((await bed.ops.lanes.view(head.laneId)).jobs).toEqual([head.jobId]);
    await readUntil(async () => (await bed.ops.history.read(head.laneId)).some((e) => e.kind === 'cancelled' && e.jobId === stop.jobId), 5_000, 'the cancel on the timeline');
  });

  it("cancel of an acquire backing off: answered cancelled, and what it made is cleaned up", async () => {
    const bed = await bedWith({ LEASE_OPS_BACKOFF_BY_OP: JSON.stringify({ acquire: { baseMs: 4_000, capMs: 4_000 } }) });
    await bed.startWorker(createRecordingProvider({ behaviour: () => 'settling' }).provider);
    const { proxy, ops } = await throughProxy(bed);
    const identity: LeaseIdentity = { provider: 'recording', companyId: 'cancel-acquire', environmentId: 'env', leaseId: 'a1' };
    const acquire = await bed.ops.enqueue({ op: 'acquire', lease: identity, params: { runId: 'a1' } });
    await readUntil(async () => (await bed.redis.zscore(bed.ops.lanes.backingOffKey, acquire.jobId)) !== null && (await bed.ops.queue.getJobState(acquire.jobId)) === 'delayed', 10_000, 'the acquire backing off');
    proxy.loseNextReplyTo(scriptCall('lane-drop', acquire.jobId));
    const answer = await answerOf(new OperatorActions(ops).cancel(acquire.jobId, 'op'));
    expect(proxy.lostReplies).toBe(1);
    expect(answer).toMatchObject({ value: { cancelled: true } });
    await readUntil(async () => (await bed.ops.queue.getJobs(['wait', 'delayed', 'active', 'completed', 'failed'])).some((j) => j?.name === 'abandon-acquire'), 10_000, "the acquire's clean-up queued");
  });

  it('rerun of a failed operation: admitted once, nothing left counted on its way', async () => {
    const bed = await bedWith({ LEASE_OPS_MAX_QUEUED_PER_LEASE: '1' });
    let failFirst = true;
    await bed.startWorker(createRecordingProvider({ behaviour: () => (failFirst ? ((failFirst = false), 'permanent') : 'ok') }).provider);
    const companyId = 'rerun-lost';
    const identity: LeaseIdentity = { provider: 'recording', companyId, environmentId: 'env', leaseId: 'r1' };
    const op = await bed.ops.enqueue({ op: 'stop', lease: identity, params: { providerLeaseId: 'r1' } });
    expect((await bed.waitForAll([op.jobId], 10_000)).get(op.jobId)).toBe('failed');
    const { proxy, ops } = await throughProxy(bed);
    proxy.loseNextReplyTo(new RegExp(`:reruns:${companyId}`));
    const answer = await answerOf(new OperatorActions(ops).rerun(op.jobId, 'op'));
    expect(proxy.lostReplies).toBe(1);
    expect(answer).toHaveProperty('value');
    expect((await bed.waitForAll([op.jobId], 10_000)).get(op.jobId)).toBe('completed');
    expect(await bed.redis.zrange(bed.ops.lanes.rerunsKey(companyId), 0, -1)).toEqual([]);
  });

  it('pause and unpause: each answered changed, each on the timeline once', async () => {
    const bed = await bedWith();
    const { proxy, ops } = await throughProxy(bed);
    const actions = new OperatorActions(ops);
    const identity: LeaseIdentity = { provider: 'recording', companyId: 'pause-lost', environmentId: 'env', leaseId: 'p1' };
    proxy.loseNextReplyTo(/pause-lost\nenv\n/);
    const paused = await actions.pause(identity, 'op');
    expect(proxy.lostReplies).toBe(1);
    proxy.loseNextReplyTo(scriptCall('lane-unpause', paused.laneId));
    const unpaused = await actions.unpause(identity, 'op');
    expect(proxy.lostReplies).toBe(2);
    expect([paused.changed, unpaused.changed]).toEqual([true, true]);
    const kinds = await readUntil(async () => {
      const read = (await bed.ops.history.read(paused.laneId)).map((e) => e.kind);
      return read.length >= 2 && read;
    }, 5_000, 'both on the timeline');
    expect(kinds).toEqual(['paused', 'unpaused']);
  });
});

describe('a force-stop absorbing a queued stop, its reply lost, without an idempotency key', () => {
  it('one force-stop in the lane: the stop it absorbed', async () => {
    const bed = await bedWith();
    const { proxy, ops } = await throughProxy(bed);
    const identity: LeaseIdentity = { provider: 'recording', companyId: 'upgrade-lost', environmentId: 'env', leaseId: 'u1' };
    // No worker, the lane paused: the stop stays queued at its head, never started.
    await new OperatorActions(bed.ops).pause(identity, 'op');
    const stop = await bed.ops.enqueue({ op: 'stop', lease: identity, params: { providerLeaseId: 'u1' }, deadlineMs: 120_000 });
    proxy.loseNextReplyTo(scriptCall('lane-upgrade', 'stop:u1'));
    const force = await ops.enqueue({ op: 'force-stop', lease: identity, params: { providerLeaseId: 'u1' }, deadlineMs: 120_000 });
    expect(proxy.lostReplies).toBe(1);
    expect(force).toMatchObject({ jobId: stop.jobId, deduplicated: 'absorbed-stop' });
    expect((await bed.ops.lanes.view(stop.laneId)).jobs).toEqual([stop.jobId]);
  });
});

describe('small scripts whose reply is lost', () => {
  it('a history event is written once', async () => {
    const bed = await bedWith();
    const { proxy, ops } = await throughProxy(bed);
    proxy.loseNextReplyTo(/A-LOST-REPLY-EVENT/);
    new LeaseHistory(ops.connection, bed.config.LEASE_OPS_PREFIX).append('lane-h', { kind: 'paused', jobId: '', message: 'A-LOST-REPLY-EVENT' });
    await readUntil(async () => proxy.lostReplies === 1, 5_000, 'the reply lost');
    // Then one more event behind it on the same connection: once it is there, the first is too.
    await new LeaseHistory(ops.connection, bed.config.LEASE_OPS_PREFIX).append('lane-h', { kind: 'unpaused', jobId: '', message: 'after' });
    await readUntil(async () => (await bed.ops.history.read('lane-h')).some((e) => e.kind === 'unpaused'), 5_000, 'the second event');
    expect((await bed.ops.history.read('lane-h')).map((e) => e.kind)).toEqual(['paused', 'unpaused']);
  });

  it('a provider request takes one turn of its rate limit', async () => {
    const bed = await bedWith();
    const { proxy, ops } = await throughProxy(bed);
    const redisNow = async () => {
      const [seconds, micros] = await bed.redis.time();
      return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
    };
    const limiter = redisRateLimiters(ops.connection, bed.config.LEASE_OPS_PREFIX)('scope-lost', { b: { perMinute: 60, burst: 1 } } as never);
    const before = await redisNow();
    await limiter.take('b' as never); // the first turn: now
    proxy.loseNextReplyTo(/scope-lost:b/);
    await limiter.take('b' as never); // the second, a second later
    expect(proxy.lostReplies).toBe(1);
    // Two turns taken, so the next is two seconds after the first (three taken: three seconds).
    const [bucket] = await scanKeys(bed.redis, `${bed.config.LEASE_OPS_PREFIX}*scope-lost:b`);
    expect(Number(await bed.redis.hget(bucket!, 'tat')) - before).toBeLessThan(2_500);
  }, 15_000);

  it("a watchdog's claim taken answers taken", async () => {
    const bed = await bedWith();
    const { proxy, ops } = await throughProxy(bed);
    const records = new LeaseRecords(ops.connection, bed.config.LEASE_OPS_PREFIX);
    await bed.redis.hset(records.recordKey('lane-f'), 'since', '1000');
    proxy.loseNextReplyTo(/lane-f/);
    expect(await records.claimForceStop('lane-f', 1000, 1, null)).toBe(true);
    expect(proxy.lostReplies).toBe(1);
  });

  it('under maxmemory with noeviction, a call that writes nothing still answers (its answer is just not kept) (helper-30)', async () => {
    const server = await RedisProcess.start(['--maxmemory-policy', 'noeviction']);
    cleanups.push(() => server.stop());
    const redis = createRedis(server.url);
    cleanups.push(() => redis.disconnect());
    const prefix = '{answered-once-oom}';
    for (let i = 0; i < 20; i++) await redis.set(`${prefix}:fill:${i}`, 'x'.repeat(100_000));
    await redis.config('SET', 'maxmemory', '1mb');
    // Unpausing a lane that is not paused writes nothing.
    expect(await luaCommand(redis, 'lane-unpause', 2, prefix)(`${prefix}:paused`, `${prefix}:paused:company`, 'not-paused')).toBe(0);
  });
});

