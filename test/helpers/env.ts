import { randomBytes, randomInt } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { QueueEvents, type Queue } from 'bullmq';
import { Cluster } from 'ioredis';
import { afterAll, beforeAll, inject } from 'vitest';
import { loadConfig, type Config } from '../../src/config.ts';
import { createLogger } from '../../src/logger.ts';
import { partitionPrefixes } from '../../src/partitions.ts';
import { ProviderRegistry } from '../../src/providers/registry.ts';
import type { LeaseProvider } from '../../src/providers/types.ts';
import { OperationsQueue } from '../../src/queues/operations-queue.ts';
import { createRedis, type RedisClient } from '../../src/queues/redis.ts';
import { LeaseWorker } from '../../src/queues/worker.ts';
import type { LeaseIdentity } from '../../src/lease.ts';

/**
 * The Redis of this test project: the `cluster` project's own cluster (provided by its global
 * set-up, and set in this worker's environment for the child processes its tests start), or
 * REDIS_URL, or the shared one.
 */
const clusterUrl = inject('clusterRedisUrl');
if (clusterUrl) process.env.REDIS_URL = clusterUrl;
export const REDIS_URL = process.env.REDIS_URL ?? 'redis://127.0.0.1:6379';

/**
 * Settings for one test: its own hash-tagged prefix, so tests never see each other's keys. On
 * the cluster, the prefix is one of six partitions' (chosen at random), so the suites there
 * run in every partition's share of the slots, on every master, over the test files.
 */
export function testConfig(overrides: Record<string, string> = {}): Config {
  const prefix = `{lo-test-${randomBytes(4).toString('hex')}}`;
  return loadConfig({
    REDIS_URL,
    LEASE_OPS_PREFIX: REDIS_URL.startsWith('redis+cluster://') ? partitionPrefixes(prefix, 6)[randomInt(6)]! : prefix,
    LEASE_OPS_LOG_LEVEL: 'silent',
    LEASE_OPS_LOCK_MS: '2000',
    LEASE_OPS_STALLED_INTERVAL_MS: '1000',
    LEASE_OPS_SWEEP_INTERVAL_MS: '300',
    LEASE_OPS_SWEEP_STALE_MS: '300',
    LEASE_OPS_BACKOFF_BASE_MS: '20',
    LEASE_OPS_BACKOFF_CAP_MS: '200',
    // The suites drive the API far faster than a company's default rates allow; the rates have
    // tests of their own (test/neighbours.test.ts), which set them.
    LEASE_OPS_API_COMPANY_RATES: JSON.stringify({ read: { perSecond: 0, burst: 1 }, walk: { perSecond: 0, burst: 1 }, write: { perSecond: 0, burst: 1 } }),
    ...overrides,
  });
}

export const lease = (leaseId: string, companyId = 'co'): LeaseIdentity => ({
  provider: 'recording',
  companyId,
  environmentId: 'env',
  leaseId,
});

/**
 * Worker settings for tests about crashes and recovery: a short lock, stall check, sweep and
 * backoff, so that recovery happens within a test; finished jobs are kept for inspection.
 */
export const QUICK_RECOVERY: Readonly<Record<string, string>> = {
  LEASE_OPS_LOCK_MS: '2000',
  LEASE_OPS_STALLED_INTERVAL_MS: '1000',
  LEASE_OPS_SWEEP_INTERVAL_MS: '500',
  LEASE_OPS_SWEEP_STALE_MS: '1000',
  LEASE_OPS_BACKOFF_BASE_MS: '20',
  LEASE_OPS_BACKOFF_CAP_MS: '200',
  LEASE_OPS_KEEP_COMPLETED_S: '3600',
};

/** The environment of a `lease-ops worker` child process for this bed, plus overrides. */
export function workerEnv(bed: TestBed, overrides: Record<string, string>): Record<string, string> {
  return { REDIS_URL: bed.config.REDIS_URL, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, ...overrides };
}

/** A producer, an event listener and a tidy-up for one test's prefix. */
export class TestBed {
  readonly redis: RedisClient;
  readonly ops: OperationsQueue;
  readonly events: QueueEvents;
  private readonly eventsConnection: RedisClient;
  private readonly workers: LeaseWorker[] = [];

  constructor(readonly config: Config) {
    this.redis = createRedis(config.REDIS_URL);
    this.ops = new OperationsQueue(this.redis, config);
    this.eventsConnection = createRedis(config.REDIS_URL);
    this.events = new QueueEvents(config.LEASE_OPS_QUEUE, { connection: this.eventsConnection, prefix: config.LEASE_OPS_PREFIX });
  }

  static async create(overrides: Record<string, string> = {}): Promise<TestBed> {
    const bed = new TestBed(testConfig(overrides));
    await bed.events.waitUntilReady();
    return bed;
  }

  async startWorker(...providers: LeaseProvider[]): Promise<LeaseWorker> {
    return this.startWorkerWith(new ProviderRegistry(providers));
  }

  /** A worker with a registry of the test's making (provider instances attached, say). */
  async startWorkerWith(registry: ProviderRegistry): Promise<LeaseWorker> {
    const worker = new LeaseWorker(this.config, registry, createLogger({ level: 'silent' }));
    await worker.start();
    this.workers.push(worker);
    return worker;
  }

  /** Resolves with each job's end state once every one of them completed or failed (from BullMQ's events). */
  waitForAll(jobIds: string[], timeoutMs = 30_000): Promise<Map<string, 'completed' | 'failed'>> {
    return waitForJobs(this.events, this.ops.queue, jobIds, timeoutMs);
  }

  /**
   * An attempt's lane step, as a worker that holds the job takes it: the job's BullMQ lock is
   * set to `lock` first (the lane refuses a start whose lock is not the job's).
   */
  async laneAcquire(laneId: string, jobId: string, lock = 'test-lock'): ReturnType<OperationsQueue['lanes']['acquire']> {
    await this.redis.set(this.ops.lanes.lockKey(jobId), lock);
    return this.ops.lanes.acquire(laneId, jobId, lock);
  }

  /** Keys left under this test's prefix that belong to lanes. */
  async laneKeys(): Promise<string[]> {
    return scanKeys(this.redis, `${this.config.LEASE_OPS_PREFIX}:lane*`);
  }

  private closing: Promise<void> | undefined;

  /** Closes it once: a second call waits for the first. */
  close(): Promise<void> {
    return (this.closing ??= this.closeOnce());
  }

  private async closeOnce(): Promise<void> {
    await Promise.all(this.workers.map((w) => w.close()));
    await this.events.close();
    await this.ops.close();
    for (const key of await scanKeys(this.redis, `${this.config.LEASE_OPS_PREFIX}*`)) await this.redis.unlink(key);
    this.eventsConnection.disconnect();
    this.redis.disconnect();
  }
}

/**
 * Resolves with each job's end state once every one of them completed or failed, driven by
 * BullMQ's events (jobs that ended before the call are read once); rejects after `timeoutMs`.
 */
export function waitForJobs(events: QueueEvents, queue: Queue, jobIds: string[], timeoutMs: number): Promise<Map<string, 'completed' | 'failed'>> {
  const pending = new Set(jobIds);
  const ended = new Map<string, 'completed' | 'failed'>();
  return new Promise((resolve, reject) => {
    const finish = (state: 'completed' | 'failed') => ({ jobId }: { jobId: string }) => {
      if (!pending.delete(jobId)) return;
      ended.set(jobId, state);
      if (pending.size === 0) done();
    };
    const onCompleted = finish('completed');
    const onFailed = finish('failed');
    const timer = setTimeout(() => {
      cleanup();
      reject(new Error(`${pending.size} of ${jobIds.length} operations did not end within ${timeoutMs} ms`));
    }, timeoutMs);
    const cleanup = () => {
      clearTimeout(timer);
      events.off('completed', onCompleted);
      events.off('failed', onFailed);
    };
    const done = () => {
      cleanup();
      resolve(ended);
    };
    events.on('completed', onCompleted);
    events.on('failed', onFailed);
    // Jobs that ended before we listened.
    void Promise.all(
      [...pending].map(async (id) => {
        const state = await queue.getJobState(id);
        if (state === 'completed' || state === 'failed') finish(state)({ jobId: id });
      }),
    );
  });
}

/** Keys matching `pattern`: on one server, or on every master of a cluster. */
export async function scanKeys(redis: RedisClient, pattern: string): Promise<string[]> {
  const keys: string[] = [];
  for (const node of redis instanceof Cluster ? redis.nodes('master') : [redis]) {
    let cursor = '0';
    do {
      const [next, batch] = await node.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
      cursor = next;
      keys.push(...batch);
    } while (cursor !== '0');
  }
  return keys;
}

/** A promise and the function that settles it: for tests that release a provider call on cue. */
export function gate<T = void>(): { promise: Promise<T>; open: (value: T) => void } {
  let open!: (value: T) => void;
  const promise = new Promise<T>((r) => (open = r));
  return { promise, open };
}

/** What `promise` rejects with, or null when it resolves: for tests that look at the error itself. */
export function rejectionOf(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    () => null,
    (err: unknown) => err,
  );
}

/**
 * Resolves with the first truthy value `read` gives, asking again after each answer, for
 * state that is only observable by reading it (Redis records, a fake's log); rejects after
 * `timeoutMs`. Each read waits for the previous one, so this is paced by round trips.
 */
export async function readUntil<T>(read: () => Promise<T | null | undefined | false>, timeoutMs = 10_000, what = 'the condition'): Promise<T> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    const value = await read();
    if (value) return value;
    if (Date.now() > until) throw new Error(`${what} did not hold within ${timeoutMs} ms`);
    await new Promise((r) => setImmediate(r));
  }
}

/**
 * For a describe block that works with BullMQ directly: a prefix of its own, a connection, and
 * closers run (last first) after its tests, before its keys are deleted.
 */
export function scratchRedis(name: string): { prefix: string; redis: () => RedisClient; closers: (() => Promise<void> | void)[] } {
  const prefix = `{${name}-${randomBytes(4).toString('hex')}}`;
  let redis: RedisClient | undefined;
  const closers: (() => Promise<void> | void)[] = [];
  beforeAll(() => {
    redis = createRedis(REDIS_URL);
  });
  afterAll(async () => {
    for (const close of closers.reverse()) await close();
    for (const k of await scanKeys(redis!, `${prefix}*`)) await redis!.unlink(k);
    redis!.disconnect();
  });
  return { prefix, redis: () => redis!, closers };
}

/**
 * What a test opened, to be closed in order when it ends (pass the test context's
 * onTestFinished): tests that keep their own list can run at once.
 */
export function cleanupFor(finished: Finished): (() => Promise<void>)[] {
  const cleanup: (() => Promise<void>)[] = [];
  finished(async () => {
    for (const c of cleanup) await c();
  });
  return cleanup;
}

/** A test context's onTestFinished: what it is given runs when the test ends (the last given first). */
export type Finished = (close: () => void | Promise<void>) => void;

/** A test bed, closed when the test ends (if the test did not close it first). */
export async function bedFor(finished: Finished, overrides?: Record<string, string>): Promise<TestBed> {
  const bed = await TestBed.create(overrides);
  finished(() => bed.close());
  return bed;
}

/** A temporary directory, removed when the test ends. */
export function dirFor(finished: Finished, name: string): string {
  const dir = mkdtempSync(join(tmpdir(), name));
  finished(() => rmSync(dir, { recursive: true, force: true }));
  return dir;
}

/** Records the name of every command sent on `connection` until `restore` (what a request cost Redis). */
export function spyCommands(connection: RedisClient): { sent: string[]; restore: () => void } {
  const send = connection.sendCommand.bind(connection);
  const sent: string[] = [];
  connection.sendCommand = ((command: { name: string }) => {
    sent.push(command.name);
    return send(command as Parameters<typeof send>[0]);
  }) as typeof connection.sendCommand;
  return { sent, restore: () => void (connection.sendCommand = send) };
}
