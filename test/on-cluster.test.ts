import { Cluster } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { keySlot } from '../src/partitions.ts';
import { lease, REDIS_URL, scanKeys, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// Runs in the `cluster` project only: proves its suites really run on the cluster.
describe('the cluster project', () => {
  it('runs against a local 3-master Redis Cluster, with every lease-ops key in one slot', async () => {
    expect(REDIS_URL).toMatch(/^redis\+cluster:\/\//);
    const bed = await TestBed.create();
    try {
      expect(bed.redis).toBeInstanceOf(Cluster);
      const cluster = bed.redis as Cluster;
      expect(cluster.nodes('master')).toHaveLength(3);
      await bed.startWorker(createRecordingProvider().provider);
      const { jobId } = await bed.ops.enqueue({ op: 'destroy', lease: lease('on-cluster'), params: { providerLeaseId: 'on-cluster' } });
      expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
      const keys = await scanKeys(cluster, `${bed.config.LEASE_OPS_PREFIX}*`);
      expect(keys.length).toBeGreaterThan(3);
      const slots = new Set(await Promise.all(keys.map((k) => cluster.cluster('KEYSLOT', k))));
      expect(slots.size).toBe(1);
    } finally {
      await bed.close();
    }
  });

  it('maps keys to slots as the cluster does (the partitions\' placement relies on it)', async () => {
    const bed = await TestBed.create();
    try {
      const keys = Array.from({ length: 300 }, (_, i) => [`k${i}`, `{lease-ops:p${i}}:x`, `a{}{b${i}}`, `x{{y${i}}}`, `é${i}{ü}`][i % 5]!);
      const slots = await Promise.all(keys.map((k) => (bed.redis as Cluster).cluster('KEYSLOT', k)));
      expect(keys.map(keySlot)).toEqual(slots);
    } finally {
      await bed.close();
    }
  });
});
