import { describe, expect, it } from 'vitest';
import { ConfigError, loadConfig } from '../src/config.ts';
import { laneIdOf } from '../src/lease.ts';
import { keySlot, parsePartitionList, partitionOfLane, partitionPrefixes, SLOTS } from '../src/partitions.ts';

describe('partitions', () => {
  it('map keys to slots as Redis Cluster does (its specification\'s examples)', () => {
    expect(keySlot('123456789')).toBe(0x31c3 % SLOTS);
    expect(keySlot('{user1000}.following')).toBe(keySlot('{user1000}.followers'));
    expect(keySlot('{user1000}.following')).toBe(keySlot('user1000'));
    expect(keySlot('foo{}{bar}')).not.toBe(keySlot('bar'));
    expect(keySlot('foo{{bar}}zap')).toBe(keySlot('{bar'));
    expect(keySlot('foo{bar}{zap}')).toBe(keySlot('bar'));
  });

  it('give each partition its own hash tag, in its own share of the slots; one partition keeps the prefix', () => {
    expect(partitionPrefixes('{lease-ops}', 1)).toEqual(['{lease-ops}']);
    for (const n of [2, 3, 6, 16]) {
      const prefixes = partitionPrefixes('app:{lease-ops}:x', n);
      expect(new Set(prefixes).size).toBe(n);
      prefixes.forEach((prefix, i) => {
        expect(prefix).toMatch(/^app:\{lease-ops:p\d+(\.\d+)?\}:x$/);
        const slot = keySlot(prefix);
        expect(slot).toBeGreaterThanOrEqual(Math.floor((i * SLOTS) / n));
        expect(slot).toBeLessThan(Math.floor(((i + 1) * SLOTS) / n));
      });
    }
    // Stable: a deployment's keys do not move between releases.
    expect(partitionPrefixes('{lease-ops}', 3)).toEqual(partitionPrefixes('{lease-ops}', 3));
  });

  it('map a lease to one partition, always the same, and leases evenly', () => {
    const lease = { provider: 'daytona', companyId: 'acme', environmentId: 'prod', leaseId: 'l-1' };
    const laneId = laneIdOf(lease);
    expect(partitionOfLane(laneId, 1)).toBe(0);
    expect(partitionOfLane(laneId, 6)).toBe(partitionOfLane(laneIdOf({ ...lease }), 6));
    // Pinned to FNV-1a's published vectors: changing the mapping would move every deployment's leases.
    expect(partitionOfLane('a', 2 ** 32)).toBe(0xe40c292c);
    expect(partitionOfLane('foobar', 2 ** 32)).toBe(0xbf9cf968);
    const counts = new Array<number>(6).fill(0);
    for (let i = 0; i < 6_000; i++) counts[partitionOfLane(laneIdOf({ ...lease, leaseId: `l-${i}` }), 6)]!++;
    for (const count of counts) expect(count).toBeGreaterThan(850);
    for (const count of counts) expect(count).toBeLessThan(1_150);
  });

  it('read the partitions a worker serves, and refuse a list that names one that does not exist', () => {
    expect(parsePartitionList('all', 3)).toEqual([0, 1, 2]);
    expect(parsePartitionList('2, 0-1,1', 6)).toEqual([0, 1, 2]);
    expect(parsePartitionList('3', 3)).toMatch(/partition 3 does not exist/);
    expect(parsePartitionList('2-1', 3)).toMatch(/backwards/);
    expect(parsePartitionList('x', 3)).toMatch(/not a partition index/);
    expect(() => loadConfig({ LEASE_OPS_PARTITIONS: '2', LEASE_OPS_WORKER_PARTITIONS: '0-2' })).toThrow(ConfigError);
    expect(() => loadConfig({ LEASE_OPS_PARTITIONS: '2', LEASE_OPS_WORKER_PARTITIONS: '0-2' })).toThrow(/LEASE_OPS_WORKER_PARTITIONS: partition 2 does not exist/);
    expect(() => loadConfig({ LEASE_OPS_PARTITIONS: '0' })).toThrow(/LEASE_OPS_PARTITIONS/);
  });
});
