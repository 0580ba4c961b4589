import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { lease, QUICK_RECOVERY, TestBed, workerEnv } from './helpers/env.ts';
import { enqueueInOrder, findOrderViolations, findOverlaps, readCallFile, type MixedOperation } from './helpers/invariants.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// The CI run: 3 worker processes, 50 leases, 2,000 operations, one SIGKILL. `npm run
// chaos:lanes` runs the long one.
const LONG = process.env.LEASE_OPS_CHAOS === 'long';
const LEASES = LONG ? 200 : 50;
const OPERATIONS = LONG ? 20_000 : 2_000;
const KILLS = LONG ? 4 : 1;

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));
// No force-stop here: it may go ahead of queued operations by design (tested on its own),
// and this test checks plain accepted order.
const MIX: MixedOperation[] = [
  { op: 'stop', params: (id) => ({ providerLeaseId: id }) },
  { op: 'resume', params: (id) => ({ providerLeaseId: id, leaseMetadata: {} }) },
  { op: 'release', params: (id) => ({ providerLeaseId: id, leaseMetadata: {}, resourceDisposition: 'stop_and_retain' }) },
  { op: 'destroy', params: (id) => ({ providerLeaseId: id }) },
];

describe(`${OPERATIONS} operations on ${LEASES} leases across 3 worker processes, ${KILLS} SIGKILL`, () => {
  let bed: TestBed;
  let dir: string;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-mp-'));
  });
  afterAll(async () => {
    await bed.close();
    rmSync(dir, { recursive: true, force: true });
  });

  it('keeps every invariant: no overlap, accepted order, nothing lost, lanes drained, no keys left', { timeout: LONG ? 900_000 : 180_000 }, async () => {
    const callFile = join(dir, 'calls.jsonl');
    const env = workerEnv(bed, {
      LEASE_OPS_PROVIDERS: PROVIDER,
      ...QUICK_RECOVERY,
      LEASE_OPS_CONCURRENCY: '20',
      RECORDING_FILE: callFile,
      RECORDING_SEED: '42',
      RECORDING_MAX_MS: '8',
      RECORDING_SETTLE_P: '0.1',
    });
    const workers = [new WorkerProcess(env), new WorkerProcess(env), new WorkerProcess(env)];
    await Promise.all(workers.map((w) => w.ready));

    // Kill workers mid-run, each time when another share of the operations completed.
    const killedAt = new Map<number, bigint>();
    let completed = 0;
    let nextKillAt = Math.floor(OPERATIONS / (KILLS + 2));
    let kills = 0;
    const killing: Promise<void>[] = [];
    const onCompleted = () => {
      completed++;
      if (kills < KILLS && completed >= nextKillAt) {
        kills++;
        nextKillAt += Math.floor(OPERATIONS / (KILLS + 2));
        const victim = workers.shift()!;
        killing.push(
          victim.kill().then(async (at) => {
            killedAt.set(victim.pid, at);
            const fresh = new WorkerProcess(env);
            workers.push(fresh);
            await fresh.ready;
          }),
        );
      }
    };
    bed.events.on('completed', onCompleted);

    // Enqueue concurrently across leases, one after another within a lease (that order is
    // the accepted order the lanes must keep).
    const { accepted, ids } = await enqueueInOrder(
      (op, leaseId, params) => bed.ops.enqueue({ op, lease: lease(leaseId), params }),
      Array.from({ length: LEASES }, (_, l) => `lease-${l}`),
      OPERATIONS / LEASES,
      MIX,
    );

    const ended = await bed.waitForAll(ids, LONG ? 800_000 : 150_000);
    bed.events.off('completed', onCompleted);
    await Promise.all(killing);

    // Every accepted operation ended, and ended completed (one stall is within BullMQ's allowance).
    expect(ended.size).toBe(OPERATIONS);
    const failed = [...ended].filter(([, s]) => s === 'failed').map(([id]) => id);
    const reasons = await Promise.all(failed.map(async (id) => (await bed.ops.queue.getJob(id))?.failedReason));
    expect(reasons).toEqual([]);
    expect(kills).toBe(KILLS);

    const calls = readCallFile(callFile);
    expect(new Set(calls.map((c) => c.jobId)).size).toBe(OPERATIONS);
    expect(calls.some((c) => c.outcome === 'settling')).toBe(true);
    expect(findOverlaps(calls, killedAt)).toEqual([]);
    expect(findOrderViolations(calls, accepted)).toEqual([]);
    // A killed process made no call after its kill.
    for (const [pid, at] of killedAt) expect(calls.filter((c) => c.pid === pid && BigInt(c.start) > at)).toEqual([]);

    // Every lane drained and left nothing behind.
    expect(await bed.ops.lanes.openLaneCount()).toBe(0);
    expect(await bed.laneKeys()).toEqual([]);

    // Graceful stop: SIGTERM lets in-flight work finish and the process exit cleanly.
    expect(await Promise.all(workers.map((w) => w.terminate()))).toEqual(workers.map(() => 0));
  });
});
