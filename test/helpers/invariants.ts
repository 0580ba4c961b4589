import { readFileSync } from 'node:fs';
import type { OperationName } from '../../src/operations.ts';
import type { CallRecord } from './recording-provider.ts';

/** Joins the start and end records of each call; a call with no end never returned (its process died). */
export function joinCalls(records: CallRecord[]): CallRecord[] {
  const byKey = new Map<string, CallRecord>();
  for (const r of records) {
    const key = `${r.pid}|${r.jobId}|${r.attempt}|${r.start}`;
    byKey.set(key, { ...byKey.get(key), ...r });
  }
  return [...byKey.values()];
}

export function readCallFile(path: string): CallRecord[] {
  let text = '';
  try {
    text = readFileSync(path, 'utf8');
  } catch {
    return [];
  }
  return joinCalls(
    text
      .split('\n')
      .filter(Boolean)
      .map((line) => JSON.parse(line) as CallRecord),
  );
}

function byLease(calls: CallRecord[]): Map<string, CallRecord[]> {
  const lanes = new Map<string, CallRecord[]>();
  for (const c of calls) {
    const list = lanes.get(c.leaseId) ?? [];
    list.push(c);
    lanes.set(c.leaseId, list);
  }
  for (const list of lanes.values()) list.sort((a, b) => (BigInt(a.start) < BigInt(b.start) ? -1 : 1));
  return lanes;
}

/**
 * Pairs of calls of one lease that were executing at the same instant. A call whose process
 * was killed ends at the kill (`killedAt`, by pid); one with no end and no kill never ended.
 */
export function findOverlaps(calls: CallRecord[], killedAt: Map<number, bigint> = new Map()): string[] {
  const found: string[] = [];
  for (const [leaseId, list] of byLease(calls)) {
    let busyUntil = 0n;
    let busyWith = '';
    for (const c of list) {
      const start = BigInt(c.start);
      if (start < busyUntil) found.push(`${leaseId}: ${c.jobId} started while ${busyWith} ran`);
      const end = c.end ? BigInt(c.end) : (killedAt.get(c.pid) ?? BigInt(Number.MAX_SAFE_INTEGER) * 1_000_000n);
      if (end > busyUntil) {
        busyUntil = end;
        busyWith = c.jobId;
      }
    }
  }
  return found;
}

/**
 * Order violations: per lease, the jobs in the order their calls started (retries of one job
 * collapsed) must follow the accepted order, and no job may run again once a later one started.
 */
export function findOrderViolations(calls: CallRecord[], accepted: Map<string, string[]>): string[] {
  const found: string[] = [];
  for (const [leaseId, list] of byLease(calls)) {
    const order = accepted.get(leaseId) ?? [];
    const rank = new Map(order.map((id, i) => [id, i]));
    const seen = new Set<string>();
    let last = -1;
    let lastJob = '';
    for (const c of list) {
      if (c.jobId === lastJob) continue;
      const r = rank.get(c.jobId);
      if (r === undefined) found.push(`${leaseId}: ${c.jobId} was never accepted`);
      else if (seen.has(c.jobId)) found.push(`${leaseId}: ${c.jobId} ran again after a later operation started`);
      else if (r < last) found.push(`${leaseId}: ${c.jobId} (#${r}) started after #${last}`);
      seen.add(c.jobId);
      last = Math.max(last, r ?? last);
      lastJob = c.jobId;
    }
  }
  return found;
}

/** An operation of a mix that `enqueueInOrder` cycles through, with its parameters for a lease. */
export interface MixedOperation {
  op: OperationName;
  params: (leaseId: string) => Record<string, unknown>;
}

/**
 * Enqueues `perLease` operations on each of `leaseIds`, concurrently across leases and one
 * after another within a lease (the accepted order the lanes must keep). Returns that order
 * per lease and every job id.
 */
export async function enqueueInOrder(
  enqueue: (op: OperationName, leaseId: string, params: Record<string, unknown>) => Promise<{ jobId: string }>,
  leaseIds: string[],
  perLease: number,
  mix: MixedOperation[],
): Promise<{ accepted: Map<string, string[]>; ids: string[] }> {
  const accepted = new Map<string, string[]>();
  const ids: string[] = [];
  await Promise.all(
    leaseIds.map(async (leaseId, l) => {
      const order: string[] = [];
      accepted.set(leaseId, order);
      for (let i = 0; i < perLease; i++) {
        const kind = mix[(l + i) % mix.length]!;
        const { jobId } = await enqueue(kind.op, leaseId, kind.params(leaseId));
        order.push(jobId);
        ids.push(jobId);
      }
    }),
  );
  return { accepted, ids };
}
