import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import type { Config } from '../src/config.ts';
import { keySlot, partitionPrefixes } from '../src/partitions.ts';
import { lease, QUICK_RECOVERY, testConfig } from './helpers/env.ts';
import { enqueueInOrder, findOrderViolations, findOverlaps, readCallFile, type MixedOperation } from './helpers/invariants.ts';
import { RedisCluster } from './helpers/redis-cluster.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));
const LEASES = 60;
const PER_LEASE = 15;
const MIX: MixedOperation[] = [
  { op: 'stop', params: (id) => ({ providerLeaseId: id }) },
  { op: 'resume', params: (id) => ({ providerLeaseId: id, leaseMetadata: {} }) },
];

// A private cluster of three masters with a replica each, with the persistence the README
// recommends (AOF, fsync always), and a deployment of six partitions over it.
describe('a master failover (CLUSTER FAILOVER on its replica) in the middle of a run', () => {
  let cluster: RedisCluster;
  let config: Config;
  let client: LeaseOpsClient;
  let dir: string;
  const workers: WorkerProcess[] = [];
  beforeAll(async () => {
    cluster = await RedisCluster.start(3, { replicas: 1, persistence: ['--appendonly', 'yes', '--appendfsync', 'always'] });
    config = testConfig({ REDIS_URL: cluster.url, LEASE_OPS_PARTITIONS: '6', LEASE_OPS_KEEP_COMPLETED_S: '3600' });
    client = new LeaseOpsClient(config);
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-failover-'));
  }, 60_000);
  afterAll(async () => {
    await Promise.all(workers.map((w) => w.terminate()));
    await client?.close();
    await cluster?.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  it('loses no accepted operation, and every lease keeps one operation at a time in accepted order', { timeout: 120_000 }, async () => {
    const callFile = join(dir, 'calls.jsonl');
    const env = {
      REDIS_URL: config.REDIS_URL,
      LEASE_OPS_PREFIX: config.LEASE_OPS_PREFIX,
      LEASE_OPS_PARTITIONS: '6',
      LEASE_OPS_PROVIDERS: PROVIDER,
      ...QUICK_RECOVERY,
      LEASE_OPS_CONCURRENCY: '10',
      RECORDING_FILE: callFile,
      RECORDING_SEED: '11',
      RECORDING_MAX_MS: '20',
      RECORDING_SETTLE_P: '0.1',
    };
    workers.push(new WorkerProcess(env), new WorkerProcess(env));
    await Promise.all(workers.map((w) => w.ready));

    const { accepted, ids } = await enqueueInOrder(
      (op, leaseId, params) => client.enqueue(op, lease(leaseId), params),
      Array.from({ length: LEASES }, (_, l) => `f-${l}`),
      PER_LEASE,
      MIX,
    );

    // Once a third has ended, the master of partition 0 hands over to its replica.
    while ((await client.overview()).counts.completed < ids.length / 3) await new Promise((r) => setTimeout(r, 50));
    const { master, replica } = await cluster.ownerOf(keySlot(partitionPrefixes(config.LEASE_OPS_PREFIX, 6)[0]!));
    await cluster.failover(replica!);
    expect((await cluster.ownerOf(keySlot(partitionPrefixes(config.LEASE_OPS_PREFIX, 6)[0]!))).master.port).not.toBe(master.port);
    const failedOver = process.hrtime.bigint();

    const results = await Promise.all(ids.map((id) => client.waitForResult(id, 90_000)));
    expect(results.filter((r) => r.state !== 'completed')).toEqual([]);
    const calls = readCallFile(callFile);
    expect(new Set(calls.map((c) => c.jobId)).size).toBe(ids.length);
    // Mid-run: operations went on after the master changed.
    expect(calls.filter((c) => BigInt(c.start) > failedOver).length).toBeGreaterThan(0);
    expect(findOverlaps(calls)).toEqual([]);
    expect(findOrderViolations(calls, accepted)).toEqual([]);
    expect((await client.overview()).openLanes).toBe(0);
  });
});
