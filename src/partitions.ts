/**
 * Partitions: a deployment's lanes split over N BullMQ queues, each under its own hash tag,
 * so that on Redis Cluster they spread over the masters. Everything of a lease (its lane, its
 * jobs, its record, its history) lives in the partition its lane id maps to; only what all
 * replicas share across leases (provider pacing, the embedded cloud's claim, the layout
 * itself) stays under the configured prefix.
 *
 * With one partition (the default) the partition's prefix is the configured one: keys are
 * exactly as before partitions existed.
 */

/** Redis Cluster's slot count. */
export const SLOTS = 16_384;

/** CRC16/XMODEM, the checksum Redis Cluster maps keys to slots with. */
function crc16(bytes: Uint8Array): number {
  let crc = 0;
  for (const byte of bytes) {
    crc ^= byte << 8;
    for (let bit = 0; bit < 8; bit++) crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
  }
  return crc;
}

/** The slot Redis Cluster gives a key: the hash of its first non-empty {hash tag}, or of the whole key. */
export function keySlot(key: string): number {
  const open = key.indexOf('{');
  if (open !== -1) {
    const close = key.indexOf('}', open + 1);
    if (close > open + 1) key = key.slice(open + 1, close);
  }
  return crc16(new TextEncoder().encode(key)) % SLOTS;
}

/**
 * Each partition's key prefix: the configured prefix with its hash tag made the partition's
 * own. Partition i's tag is `<tag>:p<i>` (with a suffix `.<j>` where needed) chosen so its slot
 * falls in the i-th of N equal slot ranges: a cluster whose masters own equal contiguous
 * ranges (as `redis-cli --cluster create` makes them) gets the partitions evenly.
 */
export function partitionPrefixes(prefix: string, partitions: number): string[] {
  if (partitions === 1) return [prefix];
  const tag = /\{([^{}]+)\}/.exec(prefix)?.[1];
  if (!tag) throw new Error(`the prefix ${prefix} holds no {hash tag}`);
  return Array.from({ length: partitions }, (_, i) => {
    const low = Math.floor((i * SLOTS) / partitions);
    const high = Math.floor(((i + 1) * SLOTS) / partitions);
    for (let j = 0; ; j++) {
      const candidate = j === 0 ? `${tag}:p${i}` : `${tag}:p${i}.${j}`;
      const slot = keySlot(candidate);
      if (slot >= low && slot < high) return prefix.replace(`{${tag}}`, `{${candidate}}`);
    }
  });
}

/** The partition a lane belongs to: FNV-1a of its id, so the same lease always maps to the same one. */
export function partitionOfLane(laneId: string, partitions: number): number {
  if (partitions === 1) return 0;
  let hash = 0x811c9dc5;
  for (let i = 0; i < laneId.length; i++) {
    hash ^= laneId.charCodeAt(i);
    hash = Math.imul(hash, 0x01000193) >>> 0;
  }
  return hash % partitions;
}

/**
 * The partitions a worker serves: LEASE_OPS_WORKER_PARTITIONS ('all', or indices and ranges
 * such as `0,2-3`), in order; or, for a list that names no partition or one out of range, why.
 */
export function parsePartitionList(list: string, partitions: number): number[] | string {
  if (list.trim() === 'all') return Array.from({ length: partitions }, (_, i) => i);
  const chosen = new Set<number>();
  for (const part of list.split(',')) {
    const range = /^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$/.exec(part);
    if (!range) return `"${part.trim()}" is not a partition index or a range like 0-2`;
    const from = Number(range[1]);
    const to = range[2] === undefined ? from : Number(range[2]);
    if (to < from) return `the range ${from}-${to} runs backwards`;
    if (to >= partitions) return `partition ${to} does not exist: LEASE_OPS_PARTITIONS=${partitions} makes 0-${partitions - 1}`;
    for (let i = from; i <= to; i++) chosen.add(i);
  }
  return [...chosen].sort((a, b) => a - b);
}
