import { performance } from 'node:perf_hooks';
import { parentPort, workerData } from 'node:worker_threads';
import { LeaseOpsClient } from '../client.ts';
import type { Config } from '../config.ts';
import { RedisUnavailableError } from '../errors.ts';
import { LayoutError } from '../queues/layout.ts';
import type { WalkAsk, WalkReply } from './walks.ts';
import { walksInProcess } from './walks.ts';

/** A walk thread of the API (see WalkThreads): its own client and Redis connections, no provider keys. */
const client = new LeaseOpsClient((workerData as { config: Config }).config, { failFast: true, masterKeys: null });
const walks = walksInProcess(client);

/**
 * The thread's busy time, shared out among the walks in hand while it passed: what each walk
 * cost its company (WalkThreads charges it to the company's walk rate).
 */
const activeMs = new Map<number, number>();
let lastUtilization = performance.eventLoopUtilization();
function shareOutActiveTime(): void {
  const now = performance.eventLoopUtilization();
  const active = now.active - lastUtilization.active;
  lastUtilization = now;
  for (const [id, ms] of activeMs) activeMs.set(id, ms + active / activeMs.size);
}
function ended(id: number): number {
  shareOutActiveTime();
  const ms = activeMs.get(id) ?? 0;
  activeMs.delete(id);
  return ms;
}

parentPort!.on('message', (request: WalkAsk & { id: number }) => {
  shareOutActiveTime();
  activeMs.set(request.id, 0);
  const run: Promise<unknown> =
    request.kind === 'attentionPage' ? walks.attentionPage(request.offset, request.limit, request.principal) : request.kind === 'timeline' ? client.getLeaseTimeline(request.lease) : walks.overview({ name: 'walk-thread', admin: true });
  run.then(
    (value) => parentPort!.postMessage({ id: request.id, value, activeMs: ended(request.id) } satisfies WalkReply),
    (err: unknown) => {
      const e = err instanceof Error ? err : new Error(String(err));
      const redis = err instanceof RedisUnavailableError ? { url: err.url, timeoutMs: err.timeoutMs, credentialsRefused: err.credentialsRefused } : {};
      const layout = err instanceof LayoutError ? { code: err.code, layout: true } : {};
      parentPort!.postMessage({ id: request.id, activeMs: ended(request.id), error: { name: e.name, message: e.message, ...redis, ...layout } } satisfies WalkReply);
    },
  );
});
