import type { Config } from '../config.ts';
import { LeaseOpsError } from '../errors.ts';
import { faultPoint } from '../fault-points.ts';
import { partitionPrefixes } from '../partitions.ts';
import { luaCommand } from './lua-scripts.ts';
import type { RedisClient } from './redis.ts';

/** Where a deployment keeps its partition count: under the configured prefix, beside what all partitions share. */
export function layoutKey(prefix: string): string {
  return `${prefix}:partitions`;
}

/** A process whose partition count does not fit the deployment's (see the subclasses). */
export class LayoutError extends LeaseOpsError {
  override name = 'LayoutError';
}

/** A process configured with another partition count than the deployment's Redis holds. */
export class PartitionLayoutError extends LayoutError {
  override name = 'PartitionLayoutError';
  constructor(
    readonly held: number,
    readonly configured: number,
    /** The prefix whose record was read: the deployment's, or a partition's copy of it. */
    prefix: string,
  ) {
    super(
      'partition_layout_mismatch',
      `Redis holds a deployment of ${held} partition(s) (${layoutKey(prefix)} says so), and this process has LEASE_OPS_PARTITIONS=${configured}: ` +
        'its leases would map to other partitions than the running ones, and one lease\'s operations could run side by side. ' +
        `Set LEASE_OPS_PARTITIONS=${held}, or change the deployment's count as docs/scaling.md describes (drain, then \`lease-ops partitions --set\`).`,
    );
  }
}

/** Operations left under the one-partition layout, which a deployment recording a count of more must not strand. */
export class UnrecordedLayoutError extends LayoutError {
  override name = 'UnrecordedLayoutError';
  constructor(prefix: string, partitions: number) {
    super(
      'partition_layout_mismatch',
      `Redis records no partition count under ${prefix} but holds operations of one partition there (a deployment from before partitions, ` +
        `or one whose Redis lost the record); LEASE_OPS_PARTITIONS=${partitions} would strand them. Run it with LEASE_OPS_PARTITIONS=1 until they ` +
        `drain, then change the count as docs/scaling.md describes.`,
    );
  }
}

/**
 * The first process of a deployment records its partition count, in the deployment's key and
 * in each partition's copy (which lane-push checks); every later one must have the same (SET
 * NX, then read: of two first processes with different counts, one is refused). Recording a
 * count above one is refused while operations wait under the one-partition layout.
 */
export async function claimPartitionLayout(
  redis: RedisClient,
  settings: Pick<Config, 'LEASE_OPS_PREFIX' | 'LEASE_OPS_PARTITIONS' | 'LEASE_OPS_QUEUE'>,
): Promise<void> {
  const { LEASE_OPS_PREFIX: prefix, LEASE_OPS_PARTITIONS: partitions } = settings;
  const key = layoutKey(prefix);
  if (partitions > 1 && (await redis.get(key)) === null) {
    const queue = `${prefix}:${settings.LEASE_OPS_QUEUE}`;
    const [lanes, wait, delayed, active] = await Promise.all([redis.zcard(`${prefix}:lanes`), redis.llen(`${queue}:wait`), redis.zcard(`${queue}:delayed`), redis.llen(`${queue}:active`)]);
    if (lanes + wait + delayed + active > 0) throw new UnrecordedLayoutError(prefix, partitions);
  }
  const held = (await redis.set(key, String(partitions), 'NX', 'GET')) ?? String(partitions);
  if (held !== String(partitions)) throw new PartitionLayoutError(Number(held), partitions, prefix);
  // Each partition's copy, where a lost one is written again (Redis lost its data, say).
  await Promise.all(partitionPrefixes(prefix, partitions).map((p) => redis.set(layoutKey(p), String(partitions), 'NX')));
}

/** The partition count Redis holds for the deployment under `prefix`, or null before any process ran. */
export async function heldPartitionCount(redis: RedisClient, prefix: string): Promise<number | null> {
  const held = await redis.get(layoutKey(prefix));
  return held === null ? null : Number(held);
}

/**
 * Sets the deployment's partition count, if it still is `checked` (false when someone changed
 * it meanwhile), and each partition's copy, of the old layout and the new: a producer that
 * still maps leases the old way is refused by lane-push in every partition it may reach.
 * The copies go first: cut short between the two steps, old producers are already refused and
 * new processes not yet admitted, and running the change again completes it.
 */
export async function changePartitionCount(redis: RedisClient, prefix: string, checked: number | null, count: number): Promise<boolean> {
  // With one partition, its copy is the deployment's key itself, which only the compare-and-set writes.
  const copies = [...new Set([...partitionPrefixes(prefix, checked ?? 1), ...partitionPrefixes(prefix, count)])].map(layoutKey).filter((key) => key !== layoutKey(prefix));
  await Promise.all(copies.map((key) => redis.set(key, String(count))));
  await faultPoint('partitions-after-copies');
  if ((await luaCommand(redis, 'layout-change', 1)(layoutKey(prefix), checked === null ? '' : String(checked), String(count))) === 1) return true;
  // Someone changed the count meanwhile: the copies say theirs again.
  const held = await redis.get(layoutKey(prefix));
  if (held !== null) await Promise.all(copies.map((key) => redis.set(key, held)));
  return false;
}
