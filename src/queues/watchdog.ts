import { faultPoint } from '../fault-points.ts';
import type { Logger } from '../logger.ts';
import * as telemetry from '../telemetry.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import { laneIdOf } from '../lease.ts';
import { historyNote } from './lease-history.ts';
import type { LeaseRecords } from './lease-records.ts';
import type { LaneNames } from './lane-names.ts';
import { enqueueRouted, ForceStopClaimOver, type EnqueuedHere, type OperationsQueue } from './operations-queue.ts';

export interface WatchdogSettings {
  stuckAfterMs: number;
  maxForceStops: number;
}

export interface WatchdogReport {
  inspected: number;
  queued: number;
  /** Still waiting for the force-stop already queued for their episode. */
  pending: number;
  /** Their provider cannot force a stop: listed as stuck, nothing to queue. */
  unsupported: number;
  /** As many force-stops as the watchdog tries per episode were queued already. */
  exhausted: number;
  /** Its force-stop could not be queued (its lane was full, or Redis failed): the next check tries again. */
  refused: number;
}

const emptyReport = (): WatchdogReport => ({ inspected: 0, queued: 0, pending: 0, unsupported: 0, exhausted: 0, refused: 0 });

/**
 * The stuck-stop watchdog. It decides from lease-ops' own records, never by calling a
 * provider: every operation that reads a sandbox records what it saw and since when, and a
 * sandbox seen on its way to stopped (Daytona `stopping`) for longer than `stuckAfterMs` gets
 * a conditional force-stop queued through its own lane. That force-stop reads the sandbox
 * inside the lane and forces it only if it is still on its way to stopped (a sandbox that
 * stopped by itself is never forced), and goes ahead of queued and backing-off operations,
 * never alongside an executing one, so no two calls to one sandbox ever overlap.
 *
 * One force-stop is queued per stuck episode at a time: the watchdog claims it on the record
 * first (only while the record still shows what it decided on), and its idempotency key
 * names the episode and the count, so replicas and repeated checks agree. Once it ended and
 * the record still shows the sandbox stuck, another, up to `maxForceStops`. A new episode
 * (the sandbox left stopping and came back) starts the count anew.
 *
 * Each episode gets a check of its own at the moment it becomes stuck (scheduled when an
 * operation first sees it, see LeaseWorker); `scan` looks at every stuck lease as a safety
 * net, in pages, with Redis reads only.
 */
export class Watchdog {
  constructor(
    private readonly ops: OperationsQueue,
    private readonly records: LeaseRecords,
    private readonly providers: ProviderRegistry,
    private readonly settings: WatchdogSettings,
    private readonly log: Logger,
    /**
     * The queue of the partition a lane belongs to: the force-stop goes through the lane of
     * the record's sandbox, which is the record's own lane once its acquire named it, and
     * otherwise the sandbox's own (maybe in another partition). One partition: this one.
     */
    private readonly queueOf: (laneId: string) => OperationsQueue = () => ops,
    private readonly names: LaneNames = ops.names,
  ) {}

  /** Every lease stuck on its way to stopped, oldest first, a page at a time. */
  async scan(page = 500): Promise<WatchdogReport> {
    const report = emptyReport();
    const before = (await this.records.now()) - this.settings.stuckAfterMs;
    for (let offset = 0; ; offset += page) {
      const stuck = await this.records.stoppingSinceWithScores(before, page, offset);
      for (const [laneId] of stuck) await this.consider(laneId, report);
      if (stuck.length < page) return report;
    }
  }

  /**
   * One lease, as its own stuck check or as part of a scan. A lease whose force-stop cannot be
   * queued is logged and counted, and the scan goes on to the next (the oldest stuck lease
   * must not hide the others).
   */
  async consider(laneId: string, report: WatchdogReport = emptyReport()): Promise<WatchdogReport> {
    try {
      return await this.considerOne(laneId, report);
    } catch (err) {
      report.refused++;
      this.log.warn({ laneId, reason: err instanceof Error ? err.message : String(err) }, 'could not queue the force-stop of a sandbox stuck on its way to stopped; the next check tries again');
      return report;
    }
  }

  private async considerOne(laneId: string, report: WatchdogReport): Promise<WatchdogReport> {
    report.inspected++;
    const record = await this.records.get(laneId);
    if (!record) {
      await this.records.forget(laneId);
      return report;
    }
    const stuckFor = (await this.records.now()) - record.since;
    if (record.kind !== 'transitioning' || stuckFor < this.settings.stuckAfterMs) return report;
    // The provider the lease's last operation ran with: its company's instance, if it was for one.
    const resolved = await this.providers.resolve(record.lease, record.companyInstance);
    if (!('provider' in resolved)) return report; // another replica serves it, or it is gone
    const provider = resolved.provider;
    const log = this.log.child({ laneId, leaseId: record.providerLeaseId, provider: provider.name, providerState: record.providerState });
    if (!provider.capabilities.forceStop) {
      report.unsupported++;
      log.debug({ stuckForMs: stuckFor }, 'sandbox stuck on its way to stopped, and its provider cannot force a stop');
      return report;
    }
    const sandboxLease = { ...record.lease, leaseId: record.providerLeaseId };
    const forceQueue = this.queueOf(await this.names.resolve(laneIdOf(sandboxLease)));
    let n: number;
    let claimed = false;
    if (record.forceStops > 0 && record.forceJob === null) {
      // Claimed and not queued yet: by a watchdog that stopped in between (a crash), or by
      // another replica that is in between now. Either way it is this same force-stop that is
      // queued: its idempotency key names the episode and the count, so it is one job.
      n = record.forceStops;
    } else {
      if (record.forceJob) {
        const state = await forceQueue.queue.getJobState(record.forceJob);
        if (state !== 'completed' && state !== 'failed' && state !== 'unknown') {
          report.pending++;
          return report;
        }
      }
      if (record.forceStops >= this.settings.maxForceStops) {
        report.exhausted++;
        log.error({ forceStops: record.forceStops }, 'sandbox still stuck after the most force-stops the watchdog tries');
        return report;
      }
      n = record.forceStops + 1;
      // What was read above may be old by now: the last force-stop's end may have seen the
      // sandbox stopped just after it. The claim holds only while the record still shows
      // this episode, this count and that job.
      if (!(await this.records.claimForceStop(laneId, record.since, n, record.forceJob))) return report;
      claimed = true;
    }
    await faultPoint('watchdog-claimed');
    let enqueued: EnqueuedHere;
    try {
      enqueued = await enqueueRouted(this.queueOf, this.names, {
        op: 'force-stop',
        // Named by its sandbox: it joins the lane the sandbox's operations run in.
        lease: sandboxLease,
        params: { providerLeaseId: record.providerLeaseId, ifStoppingSince: record.since },
        idempotencyKey: `lease-ops:watchdog:${laneId}:${record.since}:${n}`,
        companyInstance: record.companyInstance,
        // It joins only while the record still shows the claim (the episode may have ended
        // since), and the record keeps its job in that same step.
        claim: { laneId, since: record.since, forceStops: n },
        // On the timeline with the force-stop, in the step that queues it (before its attempt
        // can begin): written once, by the call that puts it into its lane.
        note: historyNote({
          kind: 'stuck',
          op: 'force-stop',
          since: record.since,
          message: `"${record.providerState}" for ${tenths(stuckFor)} s (budget ${tenths(this.settings.stuckAfterMs)} s): force-stop ${n} of at most ${this.settings.maxForceStops} queued`,
        }),
      });
    } catch (err) {
      if (err instanceof ForceStopClaimOver) {
        log.debug({ forceStop: n }, 'the stuck episode ended before its force-stop was queued: nothing queued');
        return report;
      }
      // Not queued (a full lane, Redis): given back, so no view counts a force-stop that was
      // never queued. A claim finished for another watchdog is left for the next check.
      if (claimed) await this.records.unclaimForceStop(laneId, record.since, n, record.forceJob).catch(() => undefined);
      throw err;
    }
    await faultPoint('watchdog-queued');
    // Kept on the record by the push that joined it in the record's own lane; otherwise (another
    // lane, or the key answered with a job that never joined here: removed before it joined its
    // lane, say) kept now, so the next check waits for that job or, once it has ended, claims
    // the next force-stop, and the claim never stays without its job.
    if (enqueued.laneId !== laneId || !enqueued.joinedHere) await this.records.noteForceJob(laneId, record.since, n, enqueued.jobId);
    // Counted by the call that put it into its lane, which wrote its note: once per force-stop.
    if (!enqueued.joinedHere) {
      report.pending++;
      return report;
    }
    report.queued++;
    telemetry.forceStop('queued', { 'lease.provider': provider.name });
    telemetry.stuckStopping(stuckFor / 1000, { 'lease.provider': provider.name });
    log.warn({ jobId: enqueued.jobId, stuckForMs: stuckFor, forceStop: n }, 'sandbox stuck on its way to stopped; force-stop queued');
    return report;
  }
}

/** Seconds to a tenth, without a trailing .0. */
const tenths = (ms: number) => String(Math.round(ms / 100) / 10);
