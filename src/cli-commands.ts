import { LeaseOpsClient } from './client.ts';
import { loadConfig } from './config.ts';
import { InvalidRequestError } from './errors.ts';
import type { LeaseIdentity } from './lease.ts';
import { OperationNameSchema } from './operations.ts';
import type { LeaseView, OperationView, QueueOverview } from './queues/inspect.ts';

export interface LeaseCliOptions {
  provider?: string;
  company?: string;
  environment?: string;
  lease?: string;
}
export interface EnqueueCliOptions extends LeaseCliOptions {
  params: string;
  deadlineMs?: string;
  idempotencyKey?: string;
  wait?: string | boolean;
}
export interface StatusCliOptions extends LeaseCliOptions {
  json?: boolean;
}

const out = (line: string) => process.stdout.write(`${line}\n`);
const err = (line: string) => process.stderr.write(`lease-ops: ${line}\n`);

function leaseOf(opts: LeaseCliOptions): LeaseIdentity {
  return { provider: opts.provider ?? '', companyId: opts.company ?? '', environmentId: opts.environment ?? '', leaseId: opts.lease ?? '' };
}

async function withClient<T>(run: (client: LeaseOpsClient) => Promise<T>): Promise<T> {
  const client = new LeaseOpsClient(loadConfig({ LEASE_OPS_LOG_LEVEL: 'warn', ...process.env }));
  try {
    return await run(client);
  } finally {
    await client.close();
  }
}

/** `lease-ops enqueue`: 0 when accepted (and, with --wait, completed), 1 when it failed, 2 for bad input. */
export async function runEnqueue(op: string, opts: EnqueueCliOptions): Promise<number> {
  const name = OperationNameSchema.safeParse(op);
  if (!name.success) {
    err(`unknown operation "${op}"; use one of ${OperationNameSchema.options.join(', ')}`);
    return 2;
  }
  let params: unknown;
  try {
    params = JSON.parse(opts.params);
  } catch {
    err('--params is not valid JSON');
    return 2;
  }
  const deadlineMs = opts.deadlineMs === undefined ? undefined : Number(opts.deadlineMs);
  return withClient(async (client) => {
    try {
      const enqueued = await client.enqueue(name.data, leaseOf(opts), params as Record<string, unknown>, {
        ...(deadlineMs === undefined ? {} : { deadlineMs }),
        ...(opts.idempotencyKey === undefined ? {} : { idempotencyKey: opts.idempotencyKey }),
      });
      out(`${enqueued.jobId}${enqueued.deduplicated ? `  (existing operation: ${enqueued.deduplicated})` : ''}`);
      if (opts.wait === undefined || opts.wait === false) return 0;
      const waitMs = opts.wait === true ? 60_000 : Number(opts.wait);
      const tty = process.stderr.isTTY;
      // On a terminal, show the operation moving through its states while waiting.
      const events = tty ? await client.queueEventStream() : null;
      const show = (state: string) => process.stderr.write(`\r${op} ${enqueued.jobId}: ${state.padEnd(12)}`);
      const onEvent = ({ jobId }: { jobId: string }) => {
        if (jobId === enqueued.jobId) void client.getOperation(jobId).then((v) => v && show(v.state));
      };
      for (const event of ['active', 'delayed', 'waiting'] as const) events?.on(event, onEvent);
      if (tty) show('accepted');
      const view = await client.getOperation(enqueued.jobId, { waitMs });
      for (const event of ['active', 'delayed', 'waiting'] as const) events?.off(event, onEvent);
      if (tty) process.stderr.write('\n');
      out(JSON.stringify(view, null, 2));
      return view?.state === 'completed' ? 0 : 1;
    } catch (e) {
      if (e instanceof InvalidRequestError) {
        err(`invalid request:\n${e.message}`);
        return 2;
      }
      throw e;
    }
  });
}

/** `lease-ops status`: one lease with all four lease options, else the whole queue. */
export async function runStatus(opts: StatusCliOptions): Promise<number> {
  const given = [opts.provider, opts.company, opts.environment, opts.lease].filter((v) => v !== undefined).length;
  if (given !== 0 && given !== 4) {
    err('give all of --provider, --company, --environment and --lease for one lease, or none for the whole queue');
    return 2;
  }
  return withClient(async (client) => {
    try {
      const view = given === 4 ? await client.getLease(leaseOf(opts)) : await client.overview();
      if (opts.json) out(JSON.stringify(view, null, 2));
      else out('laneId' in view ? formatLease(view) : formatOverview(view));
      return 0;
    } catch (e) {
      if (e instanceof InvalidRequestError) {
        err(`invalid lease:\n${e.message}`);
        return 2;
      }
      throw e;
    }
  });
}

const age = (since: number) => `${Math.max(0, Math.round((Date.now() - since) / 1000))} s`;
const opLine = (v: OperationView) => `${v.op} ${v.jobId} ${v.state}${v.attempts ? `, ${v.attempts} attempt(s) ended` : ''}${v.retryAt ? `, retry in ${Math.max(0, v.retryAt - Date.now())} ms` : ''}`;

function formatLease(view: LeaseView): string {
  const l = view.lease;
  const lines = [`lease ${l.provider}/${l.companyId}/${l.environmentId}/${l.leaseId} (lane ${view.laneId})`];
  lines.push(`  executing:   ${view.executing ? opLine(view.executing) : '-'}`);
  lines.push(`  backing off: ${view.backingOff ? opLine(view.backingOff) : '-'}`);
  lines.push(`  queued:      ${view.queuedTotal}`);
  for (const q of view.queued) lines.push(`    ${opLine(q)}`);
  lines.push(`  observed:    ${view.observed ? `${view.observed.providerState} (${view.observed.kind}) for ${age(view.observed.since)}, sandbox ${view.observed.providerLeaseId}` : '-'}`);
  lines.push(`  last failure: ${view.lastFailure ? `${view.lastFailure.code}: ${view.lastFailure.message} (${age(view.lastFailure.at)} ago)` : '-'}`);
  return lines.join('\n');
}

function formatOverview(view: QueueOverview): string {
  const lines = ['operations by state:'];
  for (const [state, n] of Object.entries(view.counts)) lines.push(`  ${state.padEnd(12)} ${n}`);
  lines.push(`open lanes: ${view.openLanes}`);
  lines.push(`leases needing attention: ${view.attention.length}`);
  for (const a of view.attention) {
    const l = a.lease;
    lines.push(`  ${a.reason.padEnd(22)} ${l ? `${l.provider}/${l.companyId}/${l.environmentId}/${l.leaseId}` : a.laneId}  ${a.detail}`);
  }
  return lines.join('\n');
}
