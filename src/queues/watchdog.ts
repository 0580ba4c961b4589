import type { Logger } from '../logger.ts';
import * as telemetry from '../telemetry.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import type { OperationContext } from '../providers/types.ts';
import { isStopping, type LeaseRecords } from './lease-records.ts';
import type { OperationsQueue } from './operations-queue.ts';

export interface WatchdogSettings {
  stuckAfterMs: number;
  maxForceStops: number;
  /** How long one queued force-stop holds its claim before a later scan may queue another. */
  claimMs: number;
}

export interface WatchdogReport {
  inspected: number;
  settled: number;
  queued: number;
  unsupported: number;
  exhausted: number;
}

/**
 * The stuck-stop watchdog (one BullMQ Job Scheduler runs it, however many replicas): for
 * each lease seen `stopping` for longer than `stuckAfterMs`, read the sandbox fresh; if it
 * is still stopping, queue one force-stop through its lane (it goes ahead of queued and
 * backing-off operations, never alongside an executing one). A sandbox that stopped by
 * itself is only recorded, never forced. A refused force-stop is retried by its own
 * operation; once that ends, a later scan may queue another, up to `maxForceStops`.
 */
export async function runWatchdog(
  ops: OperationsQueue,
  records: LeaseRecords,
  providers: ProviderRegistry,
  settings: WatchdogSettings,
  log: Logger,
): Promise<WatchdogReport> {
  const report: WatchdogReport = { inspected: 0, settled: 0, queued: 0, unsupported: 0, exhausted: 0 };
  for (const laneId of await records.stoppingSince(Date.now() - settings.stuckAfterMs)) {
    report.inspected++;
    const record = await records.get(laneId);
    const provider = record && providers.get(record.lease.provider);
    if (!record || !provider) {
      await records.forget(laneId);
      continue;
    }
    const ctx: OperationContext = {
      lease: record.lease,
      jobId: `watchdog.${laneId}`,
      attempt: 1,
      attemptId: `watchdog.${laneId}:read`,
      signal: AbortSignal.timeout(10_000),
      deadlineAt: Date.now() + 10_000,
      fence: async () => undefined, // a read, not a change
      fenceIsFresh: () => true,
      observe: () => undefined,
      log: log.child({ leaseId: record.lease.leaseId, laneId }),
      checkpoint: { read: async () => ({}), write: async () => undefined },
    };
    let state;
    try {
      state = await provider.status(ctx, { providerLeaseId: record.providerLeaseId });
    } catch (err) {
      log.warn({ err, laneId }, 'watchdog could not read the sandbox; trying again next scan');
      continue;
    }
    const since = await records.observe(laneId, record.lease, record.providerLeaseId, state);
    if (!isStopping(state)) {
      report.settled++;
      continue;
    }
    if (Date.now() - since < settings.stuckAfterMs) continue;
    if (!provider.capabilities.forceStop) {
      report.unsupported++;
      log.warn({ laneId, provider: provider.name, providerState: state.providerState }, 'sandbox stuck on its way to stopped, and its provider cannot force a stop');
      continue;
    }
    if (record.forceStops >= settings.maxForceStops) {
      report.exhausted++;
      log.error({ laneId, forceStops: record.forceStops }, 'sandbox still stuck stopping after the most force-stops the watchdog tries');
      continue;
    }
    if (!(await records.claimForceStop(laneId, settings.claimMs))) continue;
    // Through the sandbox's own lane (a record may have been made by an acquire's lane).
    const { jobId } = await ops.enqueue({ op: 'force-stop', lease: { ...record.lease, leaseId: record.providerLeaseId }, params: { providerLeaseId: record.providerLeaseId } });
    report.queued++;
    telemetry.forceStop('queued', { 'lease.provider': provider.name });
    telemetry.stuckStopping((Date.now() - since) / 1000, { 'lease.provider': provider.name });
    log.warn({ laneId, jobId, stuckForMs: Date.now() - since }, 'sandbox stuck stopping; force-stop queued');
  }
  return report;
}
