// An attack on liveness (every accepted operation ends, no lane stays blocked past the sweep's
// bound once the workers are healthy), from a helper that read the code, not these tests.
// Each case failed on the code it attacked.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Worker } from 'bullmq';
import { afterEach, describe, expect, it } from 'vitest';
import { laneIdOf } from '../../src/lease.ts';
import { parkDelay } from '../../src/queues/operations-queue.ts';
import { createRedis } from '../../src/queues/redis.ts';
import { RetryLaterError } from '../../src/queues/retry-policy.ts';
import { createLogger } from '../../src/logger.ts';
import { ProviderRegistry } from '../../src/providers/registry.ts';
import { backoffStrategy, LeaseWorker } from '../../src/queues/worker.ts';
import { lease, QUICK_RECOVERY, readUntil, TestBed, workerEnv } from '../helpers/env.ts';
import { readCallFile } from '../helpers/invariants.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';
import { WorkerProcess } from '../helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('../helpers/recording-provider.ts', import.meta.url));

let bed: TestBed | undefined;
const closers: (() => Promise<unknown>)[] = [];
afterEach(async () => {
  for (const close of closers.splice(0).reverse()) await close().catch(() => undefined);
  await bed?.close();
  bed = undefined;
});

/** A replica driven by hand, step by step, as a LeaseWorker's BullMQ worker would be (same lock, same backoff). */
function handDrivenReplica(b: TestBed): { fetch(token: string): ReturnType<Worker['getNextJob']>; die(): void } {
  const connection = createRedis(b.config.REDIS_URL);
  const worker = new Worker(b.config.LEASE_OPS_QUEUE, null, {
    connection,
    prefix: b.config.LEASE_OPS_PREFIX,
    lockDuration: b.config.LEASE_OPS_LOCK_MS,
    autorun: false,
    settings: { backoffStrategy },
  });
  closers.push(() => worker.close(true));
  return {
    fetch: (token) => worker.getNextJob(token, { block: false }),
    die: () => connection.disconnect(),
  };
}

describe('a retry that parks behind a force-stop and dies before its repair', () => {
  it('is handed off by the sweep: its lane does not wait for its deadline (it waited until then, up to 24 h)', { timeout: 30_000 }, async () => {
    bed = await TestBed.create();
    const L = lease('park-crash');
    const laneId = laneIdOf(L);
    const deadlineMs = 600_000;
    const replica = handDrivenReplica(bed);
    // J runs and meets a settling sandbox: it yields the lane and BullMQ schedules its retry.
    const J = (await bed.ops.enqueue({ op: 'resume', lease: L, params: { providerLeaseId: 'park-crash', leaseMetadata: {} }, deadlineMs })).jobId;
    const j1 = (await replica.fetch('R:1'))!;
    expect(j1.id).toBe(J);
    const first = (await bed.ops.lanes.view(laneId)).holder!.token;
    expect(await bed.ops.lanes.yield(laneId, J, first, Date.now() + 100)).toBe(true);
    await j1.moveToFailed(new RetryLaterError(100, new Error('settling')), 'R:1');
    // A force-stop F goes ahead of the backing-off J and is handed off.
    const F = (await bed.ops.enqueue({ op: 'force-stop', lease: L, params: { providerLeaseId: 'park-crash' }, deadlineMs })).jobId;
    expect((await bed.ops.lanes.view(laneId)).jobs).toEqual([F, J]);
    const f = (await replica.fetch('R:2'))!;
    expect(f.id).toBe(F);
    const fence = (await bed.ops.lanes.view(laneId)).holder!.token;
    // J's retry comes due and starts: not its turn, it must park.
    const j2 = await readUntil(async () => (await replica.fetch('R:3')) ?? null, 5_000, "J's retry coming due");
    expect(j2.id).toBe(J);
    expect(await bed.ops.lanes.acquire(laneId, J, 'R:3')).toEqual({ kind: 'park' });
    // Its retry started: from here it is parked, not backing off (what the sweep reads).
    expect(await bed.redis.hget(bed.ops.queue.toKey(J), 'lo:parked')).toBe('1');
    expect(await bed.redis.zscore(bed.ops.lanes.backingOffKey, J)).toBeNull();
    // F ends meanwhile: its hand-off finds J active in R's hands.
    expect(await bed.ops.lanes.release(laneId, F, fence, { status: 'completed', result: null })).toEqual({ kind: 'next', handOff: { jobId: J, result: 'elsewhere' } });
    await f.moveToCompleted(null, 'R:2', false);
    // J's park moves it to BullMQ's delayed set until its deadline (attempt-life's park()) ...
    const now = Date.now();
    await j2.moveToDelayed(now + parkDelay(j2.data as { deadlineAt: number }, now), 'R:3');
    // ... and its replica dies before the lane repair that follows.
    replica.die();
    const K = (await bed.ops.enqueue({ op: 'stop', lease: L, params: { providerLeaseId: 'park-crash' }, deadlineMs })).jobId;

    // The sweep's repair step is what a healthy deployment has left: it hands J off.
    expect(await bed.ops.lanes.repair(laneId)).toEqual({ kind: 'handed', jobId: J, result: 'promoted' });
    await bed.startWorker(createRecordingProvider().provider);
    const ended = await bed.waitForAll([J, K], 10_000);
    expect([ended.get(J), ended.get(K)]).toEqual(['completed', 'completed']);
  });
});

describe('the same with real worker processes', () => {
  it('the parking worker is killed between BullMQ\'s move to delayed and the lane repair: the sweep hands the retry off', { timeout: 60_000 }, async () => {
    bed = await TestBed.create();
    const b = bed;
    const dir = mkdtempSync(join(tmpdir(), 'lease-ops-park-kill-'));
    closers.push(async () => rmSync(dir, { recursive: true, force: true }));
    const callFile = join(dir, 'calls.jsonl');
    const common = {
      ...QUICK_RECOVERY,
      // A lock longer than the parking worker's pause below: its attempt stays the job's own.
      LEASE_OPS_LOCK_MS: '30000',
      LEASE_OPS_BACKOFF_BASE_MS: '2500',
      LEASE_OPS_BACKOFF_CAP_MS: '2500',
      LEASE_OPS_PROVIDERS: PROVIDER,
      RECORDING_FILE: callFile,
      RECORDING_MAX_MS: '0',
      RECORDING_SETTLE_FIRST: 'resume',
      // F runs until the test says (once the parking worker holds J), whatever the machine's load.
      RECORDING_HOLD: `force-stop=${join(dir, 'force-stop-may-end')}`,
    };
    // One job at a time: while it runs the force-stop, J's retry can only go to the other worker.
    const runner = new WorkerProcess(workerEnv(b, { ...common, LEASE_OPS_CONCURRENCY: '1' }));
    closers.push(() => runner.kill());
    await runner.ready;
    const L = lease('park-kill');
    const deadlineMs = 600_000;
    const J = (await b.ops.enqueue({ op: 'resume', lease: L, params: { providerLeaseId: 'park-kill', leaseMetadata: {} }, deadlineMs })).jobId;
    // J meets a settling sandbox and backs off 2.5 s; a force-stop F goes ahead of it and runs on.
    await readUntil(async () => (await b.ops.queue.getJobState(J)) === 'delayed', 10_000, 'J backing off');
    const F = (await b.ops.enqueue({ op: 'force-stop', lease: L, params: { providerLeaseId: 'park-kill' }, deadlineMs })).jobId;
    await readUntil(async () => readCallFile(callFile).some((c) => c.jobId === F), 10_000, 'F running');
    // J's retry comes due in the second worker: not its turn, it parks, and stops just before.
    const parker = new WorkerProcess(workerEnv(b, { ...common, LEASE_OPS_FAULT_POINTS: 'before-park=pause*1,after-park-move=kill*1' }));
    closers.push(async () => {
      parker.child.kill('SIGCONT');
      await parker.kill();
    });
    await parker.waitForLog('fault point before-park: pause', 20_000);
    // F ends while J is active in the stopped worker's hands: its hand-off finds J there.
    writeFileSync(join(dir, 'force-stop-may-end'), '');
    expect((await b.waitForAll([F], 20_000)).get(F)).toBe('completed');
    // The parking worker wakes, moves J to BullMQ's delayed set until its deadline, and is killed.
    parker.child.kill('SIGCONT');
    await parker.waitForLog('fault point after-park-move: kill');
    await parker.exited;
    // It moved J (its fault point after the move fired); the sweep may have handed J off already.
    expect(['delayed', 'waiting', 'active', 'completed']).toContain(await b.ops.queue.getJobState(J));
    const K = (await b.ops.enqueue({ op: 'stop', lease: L, params: { providerLeaseId: 'park-kill' }, deadlineMs })).jobId;
    // The sweep (every 0.5 s here) hands J off; it used to wait for its deadline, 10 min away.
    const ended = await b.waitForAll([J, K], 15_000).catch(async (err: Error) => {
      // Seen once in a full run (helper-66), not alone or beside a CPU hog: where J, K and
      // their lane stand, and what the worker left said, for the next sighting.
      const states = await Promise.all([J, K].map(async (id) => `${id}: ${await b.ops.queue.getJobState(id)}`));
      const lane = await b.ops.lanes.view(laneIdOf(L));
      throw new Error(`${err.message}\n${states.join('; ')}; lane ${JSON.stringify(lane)}\nthe runner's last lines:\n${runner.logs.slice(-20).join('\n')}`);
    });
    expect([ended.get(J), ended.get(K)]).toEqual(['completed', 'completed']);
    expect(readCallFile(callFile).filter((c) => c.jobId === J && c.end).map((c) => c.outcome)).toEqual(['settling', 'ok']);
  });
});

describe('a head listed as backing off whose BullMQ timer is not its retry\'s', () => {
  it('is handed off by the repair once its retry is due, not left until that timer, and never before', async () => {
    bed = await TestBed.create();
    const replica = handDrivenReplica(bed);
    /** The lease's one operation runs, meets a settling sandbox and yields; its BullMQ timer is set by `delay`. */
    const backingOff = async (leaseId: string, retryInMs: number, delay: (job: NonNullable<Awaited<ReturnType<typeof replica.fetch>>>, token: string) => Promise<unknown>) => {
      const laneId = laneIdOf(lease(leaseId));
      const id = (await bed!.ops.enqueue({ op: 'resume', lease: lease(leaseId), params: { providerLeaseId: leaseId, leaseMetadata: {} } })).jobId;
      const job = (await replica.fetch(`R:${leaseId}`))!;
      expect(job.id).toBe(id);
      const token = (await bed!.ops.lanes.view(laneId)).holder!.token;
      expect(await bed!.ops.lanes.yield(laneId, id, token, Date.now() + retryInMs)).toBe(true);
      await delay(job, `R:${leaseId}`);
      expect(await bed!.ops.queue.getJobState(id)).toBe('delayed');
      return { laneId, id };
    };
    // Its timer is its retry's: the repair leaves it to BullMQ.
    const retry = await backingOff('retry', 60_000, (job, token) => job.moveToFailed(new RetryLaterError(60_000, new Error('settling')), token));
    expect(await bed.ops.lanes.repair(retry.laneId)).toEqual({ kind: 'healthy' });
    // Its timer is 3 s later than the due time it gave the lane (its worker paused between the
    // two): nothing starts it before that due time (a second attack found it started early).
    const late = await backingOff('late', 5_000, (job, token) => job.moveToDelayed(Date.now() + 8_000, token));
    expect(await bed.ops.lanes.repair(late.laneId)).toEqual({ kind: 'healthy' });
    // Whatever path put it there without a word to the lane: its retry due, delayed for an hour.
    const lost = await backingOff('lost', 0, (job, token) => job.moveToDelayed(Date.now() + 3_600_000, token));
    expect(await bed.ops.lanes.repair(lost.laneId)).toEqual({ kind: 'handed', jobId: lost.id, result: 'promoted' });
  });
});

describe('a replica that dies between fetching a sweep and scheduling the next', () => {
  it('holds the sweeps back for one lock and two stall checks of the deployment\'s settings, not BullMQ\'s 30 s defaults', { timeout: 60_000 }, async () => {
    bed = await TestBed.create({ LEASE_OPS_LOCK_MS: '2000', LEASE_OPS_STALLED_INTERVAL_MS: '1000', LEASE_OPS_WATCHDOG: 'false' });
    const b = bed;
    await b.startWorker(createRecordingProvider().provider);
    // A second replica, never started: its maintenance worker takes one step of BullMQ's fetch
    // (the move to active, which locks the sweep iteration with that worker's lock), and the
    // replica dies before the next step, where BullMQ adds the schedule's next iteration.
    const dying = new LeaseWorker(b.config, new ProviderRegistry([createRecordingProvider().provider]), createLogger({ level: 'silent' }));
    closers.push(() => dying.close());
    const maintenance = (dying as unknown as { maintenanceWorker: Worker }).maintenanceWorker;
    await maintenance.waitUntilReady();
    const backend = (maintenance as unknown as { backend: { moveToActive(token: string): Promise<[unknown, string?]> } }).backend;
    const took = await readUntil(async () => (await backend.moveToActive('dead:1'))[1], 10_000, 'the dying replica taking a sweep');
    expect(String(took)).toMatch(/lane-sweep/);
    // A lane only the sweep repairs: paused, J and K accepted, and the unpause died between
    // its two steps (the flag gone, its repair never sent).
    const L = lease('swept');
    const laneId = laneIdOf(L);
    await b.ops.lanes.pause(laneId, 'operator', Date.now(), L);
    const J = (await b.ops.enqueue({ op: 'resume', lease: L, params: { providerLeaseId: 'swept', leaseMetadata: {} } })).jobId;
    const K = (await b.ops.enqueue({ op: 'stop', lease: L, params: { providerLeaseId: 'swept' } })).jobId;
    await b.redis.hdel(b.ops.lanes.pausedKey, laneId);
    const from = Date.now();
    const ended = await b.waitForAll([J, K], 25_000);
    expect([ended.get(J), ended.get(K)]).toEqual(['completed', 'completed']);
    // Lock (2 s) + two stall checks (1 s each) + the sweep's stale time and interval (0.3 s
    // each) + 5 s to spare (4 s here). With BullMQ's defaults (a 30 s lock) it took 30 to 60 s.
    expect(Date.now() - from).toBeLessThan(2_000 + 2 * 1_000 + 300 + 300 + 5_000);
  });
});

describe('a stale attempt\'s late park repair, while another attempt runs the job', () => {
  it('does not mark the running job parked: its later backoff is not cut short by a repair', async () => {
    bed = await TestBed.create();
    const L = lease('late-repair');
    const laneId = laneIdOf(L);
    const replica = handDrivenReplica(bed);
    const J = (await bed.ops.enqueue({ op: 'resume', lease: L, params: { providerLeaseId: 'late-repair', leaseMetadata: {} } })).jobId;
    const j = (await replica.fetch('R:2'))!;
    expect(j.id).toBe(J);
    // A frozen attempt of J that had parked it wakes and sends the repair its park ends with.
    await bed.ops.lanes.repair(laneId, J);
    expect(await bed.redis.hget(bed.ops.queue.toKey(J), 'lo:parked')).toBeNull();
    // The running attempt meets a settling sandbox and backs off for 5 s: a repair meanwhile
    // (an operator's unpause, a removal in the board) leaves it to its retry.
    const token = (await bed.ops.lanes.view(laneId)).holder!.token;
    expect(await bed.ops.lanes.yield(laneId, J, token, Date.now() + 5_000)).toBe(true);
    await j.moveToFailed(new RetryLaterError(5_000, new Error('settling')), 'R:2');
    expect(await bed.ops.lanes.repair(laneId)).toEqual({ kind: 'healthy' });
  });
});
