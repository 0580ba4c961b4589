import type { Config } from '../config.ts';
import type { Logger } from '../logger.ts';
import { parsePartitionList, partitionOfLane, partitionPrefixes } from '../partitions.ts';
import { LaneNames } from './lane-names.ts';
import { OperationsQueue } from './operations-queue.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import { claimPartitionLayout, LayoutError } from './layout.ts';
import { createRedis, type RedisClient } from './redis.ts';
import { LeaseWorker } from './worker.ts';

/**
 * One worker replica: a LeaseWorker for each partition it serves (LEASE_OPS_WORKER_PARTITIONS),
 * each with the partition's prefix, its own BullMQ worker at LEASE_OPS_CONCURRENCY, and its own
 * sweep and watchdog. The providers (and their shared request pacing) serve them all.
 */
export class LeaseWorkers {
  readonly workers: { partition: number; worker: LeaseWorker }[];
  /** For the deployment's partition count, and with several partitions, every partition's queue. */
  private readonly connection: RedisClient;
  /** Every partition's queue (served here or not), for what a worker queues in another's lanes (the watchdog). */
  private readonly queues: OperationsQueue[] = [];
  private layoutCheck: NodeJS.Timeout | null = null;

  constructor(
    private readonly settings: Config,
    private readonly providers: ProviderRegistry,
    private readonly log: Logger,
  ) {
    const count = settings.LEASE_OPS_PARTITIONS;
    const prefixes = partitionPrefixes(settings.LEASE_OPS_PREFIX, count);
    const served = parsePartitionList(settings.LEASE_OPS_WORKER_PARTITIONS, count) as number[];
    this.connection = createRedis(settings.REDIS_URL, { connectionName: 'lease-ops-worker-partitions' });
    const queueOf = (laneId: string) => this.queues[partitionOfLane(laneId, count)]!;
    // One set of second names for every partition: a sandbox's name lives in its own lane's partition.
    const names = count > 1 ? new LaneNames((laneId) => queueOf(laneId).lanes) : undefined;
    if (count > 1) this.queues = prefixes.map((prefix) => new OperationsQueue(this.connection, { ...settings, LEASE_OPS_PREFIX: prefix }, names));
    const shared = count === 1 ? null : providers.shared();
    this.workers = served.map((partition) => ({
      partition,
      worker: new LeaseWorker(
        { ...settings, LEASE_OPS_PREFIX: prefixes[partition]! },
        shared ?? providers,
        count === 1 ? log : log.child({ partition }),
        { index: partition, count, queueOf, names },
      ),
    }));
  }

  /**
   * Refuses a partition count other than the deployment's (see layout.ts), then starts every
   * partition's worker. While it runs, it records the count again every 10 s: after Redis lost
   * its data, the next process with another count is refused again (and a mismatch is logged).
   */
  async start(): Promise<void> {
    await claimPartitionLayout(this.connection, this.settings);
    await Promise.all(this.workers.map(({ worker }) => worker.start()));
    let lastReport = 0;
    this.layoutCheck = setInterval(() => {
      claimPartitionLayout(this.connection, this.settings).catch((err: unknown) => {
        if (!(err instanceof LayoutError) || Date.now() - lastReport < 60_000) return;
        lastReport = Date.now();
        this.log.error({ code: err.code }, err.message);
      });
    }, 10_000);
    this.layoutCheck.unref();
  }

  async ready(): Promise<boolean> {
    return (await Promise.all(this.workers.map(({ worker }) => worker.ready()))).every(Boolean);
  }

  async close(): Promise<void> {
    if (this.layoutCheck) clearInterval(this.layoutCheck);
    await Promise.all(this.workers.map(({ worker }) => worker.close()));
    await Promise.all(this.queues.map((q) => q.close()));
    this.connection.disconnect();
    if (this.settings.LEASE_OPS_PARTITIONS !== 1) await this.providers.close();
  }
}
