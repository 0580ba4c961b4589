import { execFile } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ClientClosedError, InvalidRequestError, LeaseHasSandboxError, LeaseOpsClient, LeaseOpsError, OperationNotFoundError, WaitTimeoutError, RedisUnavailableError } from '../src/index.ts';
import { createLogger } from '../src/logger.ts';
import { loadConfig } from '../src/config.ts';
import { startWorker } from '../src/runtime.ts';
import { loadProviders } from '../src/providers/registry.ts';
import { LeaseWorker } from '../src/queues/worker.ts';
import { gate, lease, readUntil, rejectionOf, TestBed } from './helpers/env.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { createRedis } from '../src/queues/redis.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

const EXAMPLE = fileURLToPath(new URL('../examples/control-plane.ts', import.meta.url));

describe('typed client', () => {
  let bed: TestBed;
  let client: LeaseOpsClient;
  const hold = gate<void>();

  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '600' });
    const { provider } = createRecordingProvider({
      behaviour: async ({ ctx }) => {
        if (ctx.lease.leaseId === 'held') await hold.promise;
        return 'ok' as const;
      },
    });
    await bed.startWorker(provider);
    client = new LeaseOpsClient(bed.config);
  });

  afterAll(async () => {
    hold.open();
    await client?.close();
    await bed?.close();
  });

  it('refuses bad input with InvalidRequestError naming each bad field, and writes nothing', async () => {
    const err = await client.enqueue('stop', lease('x'), { providerLeaseId: 42 } as never).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidRequestError);
    expect(err).toBeInstanceOf(LeaseOpsError);
    expect((err as InvalidRequestError).code).toBe('invalid_request');
    expect((err as InvalidRequestError).issues.map((i) => i.path.join('.'))).toContain('providerLeaseId');
    const badLease = await client.enqueue('stop', { ...lease('x'), companyId: '' }, { providerLeaseId: 'x' }).catch((e: unknown) => e);
    expect(badLease).toBeInstanceOf(InvalidRequestError);
    expect(await bed.ops.queue.count()).toBe(0);
    await expect(client.getLease({ ...lease('x'), leaseId: 'a\u0000b' })).rejects.toBeInstanceOf(InvalidRequestError);
  });

  it('tells a missing operation from a slow one', async () => {
    expect(await client.getOperation('AAAAAAAAAAAAAAAAAAAAAA.none')).toBeNull();
    await expect(client.waitForResult('AAAAAAAAAAAAAAAAAAAAAA.none', 100)).rejects.toBeInstanceOf(OperationNotFoundError);
    const { jobId } = await client.enqueue('acquire', lease('held'), { runId: 'r' });
    const slow = await client.waitForResult(jobId, 200).catch((e: unknown) => e);
    expect(slow).toBeInstanceOf(WaitTimeoutError);
    expect((slow as WaitTimeoutError).code).toBe('wait_timeout');
    const view = await client.getOperation(jobId, { waitMs: 50 });
    expect(['ready', 'running']).toContain(view?.state);
    hold.open();
    expect(await client.waitForResult(jobId, 10_000)).toMatchObject({ state: 'completed', result: { providerLeaseId: 'held' } });
  });

  it('a retry with the same idempotency key finishes an enqueue that was cut short before its lane push', async () => {
    const push = client.ops.lanes.push.bind(client.ops.lanes);
    client.ops.lanes.push = async () => {
      throw new Error('Connection is closed.'); // Redis went away between storing the job and the push
    };
    const first = await client.enqueue('destroy', lease('cut-short'), { providerLeaseId: 'cut-short' }, { idempotencyKey: 'cut-1' }).catch((e: unknown) => e);
    client.ops.lanes.push = push;
    // A connection error reaches the caller as RedisUnavailableError, with the error as its cause.
    expect(first).toBeInstanceOf(RedisUnavailableError);
    expect(((first as Error).cause as Error).message).toMatch(/Connection is closed/);
    const stored = await bed.ops.queue.getJobs(['delayed']);
    const orphan = stored.find((j) => (j.data as { lease: { leaseId: string } }).lease.leaseId === 'cut-short');
    expect(orphan).toBeDefined();
    expect((await bed.ops.lanes.view(orphan!.id!.slice(0, 22))).jobs).toEqual([]);

    const retried = await client.enqueue('destroy', lease('cut-short'), { providerLeaseId: 'cut-short' }, { idempotencyKey: 'cut-1' });
    expect(retried).toMatchObject({ jobId: orphan!.id, deduplicated: 'idempotency-key' });
    expect(await client.waitForResult(retried.jobId, 10_000)).toMatchObject({ state: 'completed' });
    // A second retry once it is done changes nothing.
    const again = await client.enqueue('destroy', lease('cut-short'), { providerLeaseId: 'cut-short' }, { idempotencyKey: 'cut-1' });
    expect(again.jobId).toBe(orphan!.id);
    expect((await bed.ops.lanes.view(orphan!.id!.slice(0, 22))).jobs).toEqual([]);
  });

  it('runs the example of docs/api.md against a worker on the simulated cloud', async () => {
    const readme = await readFile(new URL('../docs/api.md', import.meta.url), 'utf8');
    expect(readme).toContain(await readFile(EXAMPLE, 'utf8'));
    // A queue of its own: this file's other worker only knows the recording provider.
    const simulated = await TestBed.create();
    const worker = new LeaseWorker(simulated.config, await loadProviders('simulated'), createLogger({ level: 'silent' }));
    await worker.start();
    try {
      const { stdout } = await promisify(execFile)(process.execPath, ['--import', 'tsx', EXAMPLE], {
        env: { ...process.env, REDIS_URL: simulated.config.REDIS_URL, LEASE_OPS_PREFIX: simulated.config.LEASE_OPS_PREFIX },
        timeout: 60_000,
      });
      const lines = stdout.trim().split('\n');
      expect(lines[0]).toMatch(/^lane of \S+: executing (stop|resume|-), [0-2] queued$/);
      expect(lines.slice(1, 3)).toEqual(['completed', 'completed']);
      expect(lines[3]).toBe('observed: running');
      expect(lines[4]).toBe('refused: invalid_request: providerLeaseId');
    } finally {
      await worker.close();
      await simulated.close();
    }
  });
});

describe("the client's connections", () => {
  it('carry names in CLIENT LIST, as docs/operating.md gives them: the main one, the walks\', the event stream\'s, an exec\'s and a probe\'s; closeNow() ends an exec and a probe waiting (helper-38)', { timeout: 20_000 }, async () => {
    const redis = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: redis.url });
    const named = new LeaseOpsClient(bed.config);
    const names = async () => ((await bed.redis.client('LIST')) as string).split('\n').map((line) => /\bname=(\S*)/.exec(line)?.[1]).filter((name) => name?.startsWith('lease-ops-'));
    try {
      await named.connected();
      expect(await names()).toEqual(['lease-ops-client']);
      const { jobId } = await named.enqueue('stop', lease('named'), { providerLeaseId: 'named' });
      await named.getOperation(jobId, { waitMs: 50 });
      await named.leasesNeedingAttention(5);
      expect((await names()).sort()).toEqual(['lease-ops-client', 'lease-ops-client-events', 'lease-ops-client-walks']);
      // A command and a probe, neither answered (no worker here): closeNow() ends both with client_closed.
      const running = named.exec(lease('named-exec'), { providerLeaseId: 'named-exec', command: 'true' }).catch((e: unknown) => e);
      const probing = named.probeProvider('recording').catch((e: unknown) => e);
      const all = ['lease-ops-client', 'lease-ops-client-events', 'lease-ops-client-exec', 'lease-ops-client-probes', 'lease-ops-client-walks'];
      await readUntil(async () => JSON.stringify((await names()).sort()) === JSON.stringify(all), 5_000, 'the exec and probe connections');
      const docs = await readFile(new URL('../docs/operating.md', import.meta.url), 'utf8');
      for (const name of all) expect(docs).toContain(`\`${name}\``);
      await named.closeNow();
      expect([await running, await probing].map((e) => (e as ClientClosedError).code)).toEqual(['client_closed', 'client_closed']);
    } finally {
      await named.close();
      await bed.close();
      await redis.stop();
    }
  });
});

describe("a worker's connections", () => {
  it('all carry names in CLIENT LIST, each one docs/operating.md gives (helper-37: two had none)', { timeout: 30_000 }, async () => {
    const redis = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: redis.url });
    const ids = async () => ((await bed.redis.client('LIST')) as string).split('\n').filter((line) => line.includes('addr='));
    const before = new Set((await ids()).map((line) => /^id=(\d+)/.exec(line)![1]));
    const workers = await startWorker(loadConfig({ REDIS_URL: redis.url, LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX, LEASE_OPS_PROVIDERS: 'simulated' }), createLogger({ level: 'silent' }));
    try {
      // The worker's connections: those it opened (BullMQ names its blocking copies after their queue).
      const names = (await ids()).filter((line) => !before.has(/^id=(\d+)/.exec(line)![1]!)).map((line) => /\bname=(\S*)/.exec(line)?.[1] ?? '');
      expect(names.filter((name) => name === '')).toEqual([]);
      const ours = [...new Set(names.filter((name) => name.startsWith('lease-ops-')))].sort();
      expect(ours).toEqual(['lease-ops-worker', 'lease-ops-worker-exec', 'lease-ops-worker-jobs', 'lease-ops-worker-maintenance', 'lease-ops-worker-pacing', 'lease-ops-worker-partitions']);
      const docs = await readFile(new URL('../docs/operating.md', import.meta.url), 'utf8');
      for (const name of ours) expect(docs).toContain(`\`${name}\``);
    } finally {
      await workers.close();
      await bed.close();
      await redis.stop();
    }
  });
});

describe('the client starting up', () => {
  it('shares one wait for its connection among the calls made before it is up: no listener is left behind', async () => {
    const bed = await TestBed.create();
    const fresh = new LeaseOpsClient(bed.config);
    try {
      const connection = fresh.ops.connection;
      const before = { ready: connection.listenerCount('ready'), end: connection.listenerCount('end') };
      // Twenty enqueues at start-up (a bench's 17 warned of an EventEmitter leak).
      const enqueued = await Promise.all(Array.from({ length: 20 }, (_, i) => fresh.enqueue('stop', lease(`startup-${i}`), { providerLeaseId: `startup-${i}` })));
      expect(enqueued).toHaveLength(20);
      // No more than the connection's own (some of which it has shed by now).
      expect(connection.listenerCount('ready')).toBeLessThanOrEqual(before.ready);
      expect(connection.listenerCount('end')).toBeLessThanOrEqual(before.end);
    } finally {
      await fresh.close();
      await bed.close();
    }
  });
});

describe("a client's waits for an operation's end", () => {
  it('end at once when the client closes, with ClientClosedError (client_closed), not at their time with redis_unavailable (helper-32)', { timeout: 20_000 }, async () => {
    const bed = await TestBed.create();
    const fresh = new LeaseOpsClient(bed.config);
    try {
      // No worker: the stop stays queued.
      const { jobId } = await fresh.enqueue('stop', lease('closing-wait'), { providerLeaseId: 'closing-wait' });
      const waiting = rejectionOf(fresh.getOperation(jobId, { waitMs: 60_000 }));
      const queue = fresh.partitions[0]!.ops.queue;
      await readUntil(async () => queue.listenerCount('closing') > 0, 10_000, 'the wait to listen');
      await fresh.close();
      const ended = await waiting;
      expect(ended).toBeInstanceOf(ClientClosedError);
      expect((ended as ClientClosedError).code).toBe('client_closed');
      expect((ended as ClientClosedError).message).toContain(jobId);
    } finally {
      await fresh.close();
      await bed.close();
    }
  });

  it('begun together on a new client (each waits for the event stream to open), warn of no listener leak', { timeout: 20_000 }, async () => {
    const bed = await TestBed.create();
    const fresh = new LeaseOpsClient(bed.config);
    const warnings: string[] = [];
    const onWarning = (warning: Error) => warnings.push(`${warning.name}: ${warning.message}`);
    process.on('warning', onWarning);
    try {
      const { jobId } = await fresh.enqueue('stop', lease('many-waits'), { providerLeaseId: 'many-waits' });
      const views = await Promise.all(Array.from({ length: 20 }, () => fresh.getOperation(jobId, { waitMs: 200 })));
      expect(views.map((v) => v?.state)).toEqual(views.map(() => 'ready'));
      // A warning is emitted on the next tick.
      await new Promise((resolve) => setImmediate(resolve));
      expect(warnings.filter((w) => w.startsWith('MaxListenersExceededWarning'))).toEqual([]);
    } finally {
      process.off('warning', onWarning);
      await fresh.close();
      await bed.close();
    }
  });

  it("begun as the client closes (still reading the operation), or after, end with client_closed too, and open no connection (helper-34)", { timeout: 20_000 }, async () => {
    const redis = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: redis.url });
    const admin = createRedis(redis.url);
    const clients = async () => Number(/connected_clients:(\d+)/.exec(await admin.info('clients'))?.[1]);
    const before = await clients();
    const fresh = new LeaseOpsClient(bed.config);
    try {
      const { jobId } = await fresh.enqueue('stop', lease('closing-early'), { providerLeaseId: 'closing-early' });
      // In their first step when the client closes: reading the operation, or its job.
      const early = Array.from({ length: 20 }, () => rejectionOf(fresh.getOperation(jobId, { waitMs: 60_000 })));
      await fresh.close();
      const after = await rejectionOf(fresh.getOperation(jobId, { waitMs: 60_000 }));
      for (const ended of [...(await Promise.all(early)), after]) {
        expect(ended).toBeInstanceOf(ClientClosedError);
        expect((ended as ClientClosedError).code).toBe('client_closed');
      }
      // Nothing of the client's stays connected (a wait begun after close() opened a stream that did).
      await readUntil(async () => (await clients()) === before, 10_000, "the client's connections to go");
    } finally {
      await fresh.close();
      admin.disconnect();
      await bed.close();
      await redis.stop();
    }
  });

  it("end, after endWaits(), with the operation as it is for getOperation, and with client_closed for waitForResult, not a timeout that was not (helper-36)", { timeout: 20_000 }, async () => {
    const bed = await TestBed.create();
    const fresh = new LeaseOpsClient(bed.config);
    try {
      const { jobId } = await fresh.enqueue('stop', lease('ended-waits'), { providerLeaseId: 'ended-waits' });
      const pending = rejectionOf(fresh.waitForResult(jobId, 60_000));
      await readUntil(async () => fresh.partitions[0]!.ops.queue.listenerCount('closing') > 0, 10_000, 'the wait to listen');
      fresh.endWaits();
      const ended = await pending;
      expect(ended).toBeInstanceOf(ClientClosedError);
      expect((ended as ClientClosedError).message).toContain(jobId);
      // Later waits answer at once: the operation as it is, or client_closed for a result.
      expect((await fresh.getOperation(jobId, { waitMs: 60_000 }))?.state).toBe('ready');
      expect(await rejectionOf(fresh.waitForResult(jobId, 60_000))).toBeInstanceOf(ClientClosedError);
    } finally {
      await fresh.close();
      await bed.close();
    }
  });

  it("keeps a call's own answer when close() comes while it runs, and refuses every call after close() with client_closed (helper-35)", { timeout: 20_000 }, async () => {
    const bed = await TestBed.create();
    const fresh = new LeaseOpsClient(bed.config);
    try {
      // A definitive answer of its own (here, the lease's sandbox lives) while the client closes.
      let closing: Promise<void> | undefined;
      fresh.ops.lanes.push = async () => {
        closing = fresh.close();
        throw new LeaseHasSandboxError('sb-1');
      };
      const answered = await rejectionOf(fresh.enqueue('stop', lease('own-answer'), { providerLeaseId: 'own-answer' }));
      expect(answered).toBeInstanceOf(LeaseHasSandboxError);
      await closing;
      for (const after of [fresh.laneOf(lease('own-answer')), fresh.connected(), fresh.getLease(lease('own-answer'))]) {
        const refused = await rejectionOf(after);
        expect(refused).toBeInstanceOf(ClientClosedError);
      }
    } finally {
      await fresh.close();
      await bed.close();
    }
  });

  it("close() cuts the event stream's connection while it is still opening (a Redis taking no new connection): none connects once Redis takes them again (helper-34)", { timeout: 20_000 }, async () => {
    const redis = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: redis.url });
    const admin = createRedis(redis.url);
    const fresh = new LeaseOpsClient(bed.config);
    try {
      const { jobId } = await fresh.enqueue('stop', lease('closing-opening'), { providerLeaseId: 'closing-opening' });
      const clients = async () => Number(/connected_clients:(\d+)/.exec(await admin.info('clients'))?.[1]);
      await admin.config('SET', 'maxclients', String(await clients()));
      const waiting = rejectionOf(fresh.getOperation(jobId, { waitMs: 60_000 }));
      // The wait is opening the stream: its connection is refused, again and again.
      const partition = fresh.partitions[0]!;
      const eventsConnection = () => (partition as unknown as { eventsConnection: { status: string } | null }).eventsConnection;
      await readUntil(async () => eventsConnection() !== null, 10_000, 'the event stream to be opening');
      const opening = eventsConnection()!;
      await fresh.close();
      expect(await waiting).toBeInstanceOf(ClientClosedError);
      await admin.config('SET', 'maxclients', '10000');
      // Cut for good: it will not connect when Redis takes connections again.
      expect(opening.status).toBe('end');
    } finally {
      await fresh.close();
      await admin.config('SET', 'maxclients', '10000').catch(() => undefined);
      admin.disconnect();
      await bed.close();
      await redis.stop();
    }
  });

  it('count opening the event stream in their time: with Redis taking no new connection, a 1 s wait answers the view it has (helper-32: a 2 s wait ran 10.6 s)', { timeout: 20_000 }, async () => {
    const redis = await RedisProcess.start();
    const bed = await TestBed.create({ REDIS_URL: redis.url });
    const fresh = new LeaseOpsClient(bed.config);
    const admin = createRedis(redis.url);
    try {
      const { jobId } = await fresh.enqueue('stop', lease('no-stream'), { providerLeaseId: 'no-stream' });
      // Every connection it has is open; the next one (the wait's event stream) is refused.
      const clients = Number(/connected_clients:(\d+)/.exec(await admin.info('clients'))?.[1]);
      await admin.config('SET', 'maxclients', String(clients));
      const asked = Date.now();
      const view = await fresh.getOperation(jobId, { waitMs: 1_000 });
      const took = Date.now() - asked;
      expect(view?.state).toBe('ready');
      // Its 1 s, and one read of the view after it (within LEASE_OPS_REDIS_TIMEOUT_MS), not more.
      expect(took).toBeGreaterThanOrEqual(1_000);
      expect(took).toBeLessThan(1_000 + bed.config.LEASE_OPS_REDIS_TIMEOUT_MS + 1_000);
      await admin.config('SET', 'maxclients', '10000');
    } finally {
      await fresh.close();
      admin.disconnect();
      await bed.close();
      await redis.stop();
    }
  });
});
