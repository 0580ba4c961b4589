import { appendFileSync, existsSync, watch } from 'node:fs';
import { dirname } from 'node:path';
import { createHash } from 'node:crypto';
import { SettlingError, PermanentError } from '../../src/providers/errors.ts';
import type { LeaseProvider, OperationContext } from '../../src/providers/types.ts';
import type { OperationName } from '../../src/operations.ts';

/** One provider call, as the provider saw it. Times are process.hrtime ns: one clock for all processes. */
export interface CallRecord {
  pid: number;
  leaseId: string;
  jobId: string;
  op: OperationName;
  attempt: number;
  start: string;
  end?: string;
  outcome?: 'ok' | 'settling' | 'permanent';
}

export type Behaviour = (call: { ctx: OperationContext; op: OperationName }) => Promise<'ok' | 'settling' | 'permanent'> | 'ok' | 'settling' | 'permanent';

/**
 * A provider for tests that records every call (start and end) and behaves as told. In a
 * child process it appends records to a JSON-lines file, so a test can check the calls of
 * many worker processes against one clock.
 */
export function createRecordingProvider(opts: { behaviour?: Behaviour; sink?: (record: CallRecord) => void; name?: string; callsPerOp?: number } = {}) {
  const calls: CallRecord[] = [];
  const sink = opts.sink ?? ((r: CallRecord) => calls.push(r));
  const behaviour = opts.behaviour ?? (() => 'ok' as const);

  const call = async <T>(op: OperationName, ctx: OperationContext, result: () => T): Promise<T> => {
    await ctx.fence();
    const record: CallRecord = {
      pid: process.pid,
      leaseId: ctx.lease.leaseId,
      jobId: ctx.jobId,
      op,
      attempt: ctx.attempt,
      start: String(process.hrtime.bigint()),
    };
    sink({ ...record });
    const outcome = await behaviour({ ctx, op });
    record.end = String(process.hrtime.bigint());
    record.outcome = outcome;
    sink(record);
    // Some operations take several provider calls (read, act, read): each one is fenced.
    for (let i = 1; i < (opts.callsPerOp ?? 1) && outcome === 'ok'; i++) {
      await ctx.fence();
      const more: CallRecord = { pid: process.pid, leaseId: ctx.lease.leaseId, jobId: ctx.jobId, op, attempt: ctx.attempt, start: String(process.hrtime.bigint()) };
      sink({ ...more });
      await behaviour({ ctx, op });
      sink({ ...more, end: String(process.hrtime.bigint()), outcome: 'ok' });
    }
    if (outcome === 'settling') throw new SettlingError('still_settling', `lease ${ctx.lease.leaseId} is still settling`);
    if (outcome === 'permanent') throw new PermanentError('refused', `lease ${ctx.lease.leaseId} refused ${op}`);
    return result();
  };

  const provider: LeaseProvider = {
    name: opts.name ?? 'recording',
    capabilities: { stop: true, pause: false, forceStop: true },
    acquire: (ctx) => call('acquire', ctx, () => ({ providerLeaseId: ctx.lease.leaseId, metadata: {}, expiresAt: null })),
    resume: (ctx, p) => call('resume', ctx, () => ({ providerLeaseId: p.providerLeaseId, metadata: {}, expiresAt: null })),
    release: (ctx, p) =>
      call('release', ctx, () =>
        p.resourceDisposition === 'keep_running' ? null : { providerLeaseId: p.providerLeaseId, state: p.resourceDisposition === 'destroy' ? ('destroyed' as const) : ('stopped' as const) },
      ),
    stop: (ctx, p) => call('stop', ctx, () => ({ providerLeaseId: p.providerLeaseId, state: 'stopped' as const })),
    forceStop: (ctx, p) => call('force-stop', ctx, () => ({ providerLeaseId: p.providerLeaseId, state: 'stopped' as const })),
    destroy: (ctx, p) => call('destroy', ctx, () => ({ providerLeaseId: p.providerLeaseId, state: 'destroyed' as const })),
    status: async () => ({ kind: 'running' as const }),
  };
  return { provider, calls };
}

/** A number in [0, 1) fixed by the seed and the key, so a job attempt behaves the same wherever it runs. */
export function seededFraction(seed: string, key: string): number {
  return createHash('sha256').update(`${seed}:${key}`).digest().readUInt32BE(0) / 2 ** 32;
}

/**
 * The module form, for worker child processes (LEASE_OPS_PROVIDERS=<this file>):
 *   RECORDING_FILE      where to append call records (JSON lines)
 *   RECORDING_SEED      seed for durations and failures
 *   RECORDING_MIN_MS    shortest call duration (default 0)
 *   RECORDING_MAX_MS    longest call duration
 *   RECORDING_SETTLE_P  chance that an attempt fails with a settling error
 *   RECORDING_CALLS     provider calls per operation (default 1), each fenced
 *   RECORDING_SETTLE_FIRST  '1': every operation's first attempt fails with a settling error;
 *                       or a comma-separated list of operations whose first attempt does
 *   RECORDING_MS_BY_OP  call durations of some operations, overriding the above: 'force-stop=4000,stop=10'
 *   RECORDING_HOLD      calls of some operations last until a file exists: 'force-stop=/tmp/x/go'
 */
export default function createProvider(env: NodeJS.ProcessEnv): LeaseProvider {
  const file = env.RECORDING_FILE;
  if (!file) throw new Error('RECORDING_FILE is not set');
  const seed = env.RECORDING_SEED ?? '1';
  const minMs = Number(env.RECORDING_MIN_MS ?? '0');
  const maxMs = Number(env.RECORDING_MAX_MS ?? '10');
  const settleP = Number(env.RECORDING_SETTLE_P ?? '0');
  const settleFirst = (env.RECORDING_SETTLE_FIRST ?? '').split(',');
  const msByOp = new Map((env.RECORDING_MS_BY_OP ?? '').split(',').filter(Boolean).map((entry) => {
    const [op, ms] = entry.split('=');
    return [op!, Number(ms)] as const;
  }));
  const holdByOp = new Map((env.RECORDING_HOLD ?? '').split(',').filter(Boolean).map((entry) => {
    const at = entry.indexOf('=');
    return [entry.slice(0, at), entry.slice(at + 1)] as const;
  }));
  return createRecordingProvider({
    callsPerOp: Number(env.RECORDING_CALLS ?? '1'),
    sink: (r) => appendFileSync(file, `${JSON.stringify(r)}\n`),
    behaviour: async ({ ctx, op }) => {
      const key = `${ctx.jobId}:${ctx.attempt}`;
      const ms = msByOp.get(op) ?? minMs + Math.floor(seededFraction(seed, `d:${key}`) * (maxMs - minMs));
      if (ms > 0) await new Promise((r) => setTimeout(r, ms));
      const hold = holdByOp.get(op);
      if (hold) await fileExists(hold);
      if ((settleFirst.includes('1') || settleFirst.includes(op)) && ctx.attempt === 1) return 'settling';
      return seededFraction(seed, `s:${key}`) < settleP ? 'settling' : 'ok';
    },
  }).provider;
}

/** Resolves once `file` exists (watching its directory). */
function fileExists(file: string): Promise<void> {
  return new Promise((resolve) => {
    const check = () => {
      if (!existsSync(file)) return;
      watcher.close();
      resolve();
    };
    const watcher = watch(dirname(file), check);
    check();
  });
}
