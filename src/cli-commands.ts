import { userInfo } from 'node:os';
import { LeaseOpsClient } from './client.ts';
import { loadConfig, unknownSettings } from './config.ts';
import { ActivityNotFoundError, InvalidRequestError, LeaseClosingError } from './errors.ts';
import type { LeaseIdentity } from './lease.ts';
import { OperationNameSchema } from './operations.ts';
import type { LeaseView, OperationView, QueueOverview } from './queues/inspect.ts';
import { duration, moment } from './time-format.ts';
import { OperatorActionRefusedError } from './queues/operator-actions.ts';
import { changePartitionCount } from './queues/layout.ts';

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
  json?: boolean;
}
export interface StatusCliOptions extends LeaseCliOptions {
  json?: boolean;
}

/** The CLI's exit codes, one per outcome (README, Commands). */
export const EXIT = { ok: 0, operationFailed: 1, badInput: 2, notEnded: 3, redisUnavailable: 4 } as const;

export const out = (line: string) => process.stdout.write(`${line}\n`);
export const err = (line: string) => process.stderr.write(`lease-ops: ${line}\n`);

function leaseOf(opts: LeaseCliOptions): LeaseIdentity {
  return { provider: opts.provider ?? '', companyId: opts.company ?? '', environmentId: opts.environment ?? '', leaseId: opts.lease ?? '' };
}

/** Runs `run` with a client of the environment's settings, closed after. */
export async function withClient<T>(run: (client: LeaseOpsClient) => Promise<T>): Promise<T> {
  for (const { name, closest } of unknownSettings()) err(`warning: ${name} is not a lease-ops setting (did you mean ${closest}?); it is ignored`);
  const client = new LeaseOpsClient(loadConfig({ LEASE_OPS_LOG_LEVEL: 'warn', ...process.env }));
  try {
    return await run(client);
  } finally {
    await client.close();
  }
}

/**
 * `lease-ops enqueue`: 0 when accepted (and, with --wait, completed), 1 when it failed, 2 for
 * bad input, 3 when --wait ended before the operation did (no worker took it, say).
 */
export async function runEnqueue(op: string, opts: EnqueueCliOptions): Promise<number> {
  const name = OperationNameSchema.safeParse(op);
  if (!name.success) {
    err(`unknown operation "${op}"; use one of ${OperationNameSchema.options.join(', ')}`);
    return EXIT.badInput;
  }
  let params: unknown;
  try {
    params = JSON.parse(opts.params);
  } catch {
    err('--params is not valid JSON');
    return EXIT.badInput;
  }
  const deadlineMs = opts.deadlineMs === undefined ? undefined : Number(opts.deadlineMs);
  // Checked before anything is written: a bad --wait must not leave an operation behind.
  if (opts.wait !== undefined && opts.wait !== true && opts.wait !== false && !/^\d{1,9}$/.test(opts.wait)) {
    err('--wait takes a whole number of milliseconds');
    return EXIT.badInput;
  }
  return withClient(async (client) => {
    try {
      // An operation on a sandbox names it in its params; given the lease by either of its
      // names without one, the CLI fills in the sandbox the lease has (or --lease itself).
      if (name.data !== 'acquire' && params !== null && typeof params === 'object' && !Array.isArray(params) && !('providerLeaseId' in params)) {
        const known = await client.getLease(leaseOf(opts)).catch(() => null);
        params = { ...params, providerLeaseId: known?.sandboxId ?? opts.lease };
      }
      const enqueued = await client.enqueue(name.data, leaseOf(opts), params as Record<string, unknown>, {
        ...(deadlineMs === undefined ? {} : { deadlineMs }),
        ...(opts.idempotencyKey === undefined ? {} : { idempotencyKey: opts.idempotencyKey }),
      });
      const waiting = opts.wait !== undefined && opts.wait !== false;
      if (!opts.json) out(`${enqueued.jobId}${enqueued.deduplicated ? `  (existing operation: ${enqueued.deduplicated})` : ''}`);
      if (!waiting) {
        if (opts.json) out(JSON.stringify(enqueued));
        return EXIT.ok;
      }
      const waitMs = opts.wait === true ? 60_000 : Number(opts.wait);
      const tty = process.stderr.isTTY;
      // On a terminal, show the operation moving through its states while waiting.
      const events = tty ? await client.queueEventStream(client.partitionOf(enqueued.jobId).index) : null;
      const show = (state: string) => process.stderr.write(`\r${op} ${enqueued.jobId}: ${state.padEnd(12)}`);
      const onEvent = ({ jobId }: { jobId: string }) => {
        if (jobId === enqueued.jobId) void client.getOperation(jobId).then((v) => v && show(v.state));
      };
      for (const event of ['active', 'delayed', 'waiting'] as const) events?.on(event, onEvent);
      if (tty) show('accepted');
      const view = await client.getOperation(enqueued.jobId, { waitMs });
      for (const event of ['active', 'delayed', 'waiting'] as const) events?.off(event, onEvent);
      if (tty) process.stderr.write('\n');
      // One JSON document with --json; the operation as indented JSON after its id line without.
      out(opts.json ? JSON.stringify({ ...enqueued, operation: view }) : JSON.stringify(view, null, 2));
      if (view?.state === 'completed') return EXIT.ok;
      if (view?.state === 'failed') return EXIT.operationFailed;
      if (view?.state === 'paused' && view.paused) {
        err(`operation ${enqueued.jobId} waits in a paused lane (paused by ${view.paused.by} since ${new Date(view.paused.since).toISOString()}): lease-ops unpause --provider ${opts.provider} --company ${opts.company} --environment ${opts.environment} --lease ${opts.lease} lets it run`);
      } else {
        err(`operation ${enqueued.jobId} is still ${view?.state ?? 'unknown'} after ${waitMs} ms (is a worker running?)`);
      }
      return EXIT.notEnded;
    } catch (e) {
      if (e instanceof InvalidRequestError) {
        err(`invalid request:\n${e.message}`);
        return EXIT.badInput;
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
    return EXIT.badInput;
  }
  return withClient(async (client) => {
    try {
      const view = given === 4 ? await client.getLease(leaseOf(opts)) : await client.overview();
      if (opts.json) out(JSON.stringify(view));
      else out('laneId' in view ? formatLease(view) : formatOverview(view));
      return EXIT.ok;
    } catch (e) {
      if (e instanceof InvalidRequestError) {
        err(`invalid lease:\n${e.message}`);
        return EXIT.badInput;
      }
      throw e;
    }
  });
}

/**
 * `lease-ops cancel|rerun <jobId>` and `lease-ops pause|unpause --provider ... --lease ...`:
 * 0 when done, 1 when refused (it would break the lane's guarantees: the reason is printed),
 * 2 for bad input or no such operation.
 */
export async function runOperatorAction(action: 'cancel' | 'rerun' | 'pause' | 'unpause' | 'ack', jobId: string | undefined, opts: LeaseCliOptions & { json?: boolean }): Promise<number> {
  const by = `cli:${userInfo().username}`;
  if ((action === 'pause' || action === 'unpause' || action === 'ack') && [opts.provider, opts.company, opts.environment, opts.lease].some((v) => v === undefined)) {
    err(`${action} needs --provider, --company, --environment and --lease`);
    return EXIT.badInput;
  }
  return withClient(async (client) => {
    try {
      const done =
        action === 'cancel'
          ? await client.cancelOperation(jobId ?? '', by)
          : action === 'rerun'
            ? await client.rerunOperation(jobId ?? '', by, { override: true })
            : action === 'pause'
              ? await client.pauseLane(leaseOf(opts), by, { override: true })
              : action === 'ack'
                ? await client.acknowledgeFailures(leaseOf(opts), by)
                : await client.unpauseLane(leaseOf(opts), by);
      if (!done) {
        err(`no operation ${jobId}`);
        return EXIT.badInput;
      }
      if (opts.json) out(JSON.stringify(done));
      else if ('cancelled' in done) out(`cancelled ${done.jobId}: it left its lane and fails with code cancelled`);
      else if ('deadlineAt' in done) out(`${done.jobId} runs again: it joined its lane's tail, deadline ${new Date(done.deadlineAt).toISOString()}`);
      else if ('acknowledged' in done) out(done.acknowledged.length ? `acknowledged ${done.acknowledged.length} failure${done.acknowledged.length === 1 ? '' : 's'} (${done.acknowledged.map((f) => `${f.op} ${f.jobId}`).join(', ')}): they leave the attention list` : 'nothing to acknowledge: no failure of this lease is on the attention list');
      else out(`lane ${done.laneId} ${done.paused ? 'paused' : 'unpaused'}${done.changed ? '' : ' (it already was)'}`);
      return EXIT.ok;
    } catch (e) {
      if (e instanceof OperatorActionRefusedError) {
        err(`refused (${e.code}): ${e.message}`);
        return EXIT.operationFailed;
      }
      if (e instanceof InvalidRequestError) {
        err(`invalid lease:\n${e.message}`);
        return EXIT.badInput;
      }
      throw e;
    }
  });
}

const opLine = (v: OperationView) =>
  `${v.op} ${v.jobId} ${v.state}${v.attempts ? `, ${v.attempts} attempt(s) ended` : ''}${v.retryAt ? `, retry ${moment(v.retryAt, Date.now())}` : ''}${v.paused ? `, lane paused by ${v.paused.by}` : ''}`;

function formatLease(view: LeaseView): string {
  const l = view.lease;
  const lines = [`lease ${l.provider}/${l.companyId}/${l.environmentId}/${l.leaseId} (lane ${view.laneId})`];
  lines.push(`  executing:   ${view.executing ? opLine(view.executing) : '-'}`);
  lines.push(`  backing off: ${view.backingOff ? opLine(view.backingOff) : '-'}`);
  lines.push(`  queued:      ${view.queuedTotal}`);
  for (const q of view.queued) lines.push(`    ${opLine(q)}`);
  if (view.sandboxId || view.acquiredAs) lines.push(`  names:       ${[view.acquiredAs ? `acquired as ${view.acquiredAs}` : '', view.sandboxId ? `sandbox ${view.sandboxId}` : ''].filter(Boolean).join(', ')}`);
  const now = Date.now();
  lines.push(`  observed:    ${view.observed ? `${view.observed.providerState} (${view.observed.kind}) since ${moment(view.observed.since, now)}, sandbox ${view.observed.providerLeaseId}` : '-'}`);
  if (view.stuck) lines.push(`  STUCK:       stopping since ${moment(view.stuck.since, now)}, past the budget of ${duration(view.stuck.budgetMs)}: the watchdog forces it`);
  if (view.paused) lines.push(`  PAUSED:      by ${view.paused.by} since ${moment(view.paused.since, now)}: nothing new starts (lease-ops unpause)`);
  lines.push(`  last failure: ${view.lastFailure ? `${view.lastFailure.code}: ${view.lastFailure.message} (${moment(view.lastFailure.at, now)})` : '-'}`);
  return lines.join('\n');
}

function formatOverview(view: QueueOverview): string {
  const lines = ['operations by state:'];
  for (const [state, n] of Object.entries(view.counts)) lines.push(`  ${state.padEnd(12)} ${n}`);
  lines.push(`open lanes: ${view.openLanes}`);
  // One line per lease, with every reason it has: the same leases as /v1/attention and the page.
  lines.push(`leases needing attention: ${view.attentionLeases}${view.attentionLeases > view.attention.length ? ` (the first ${view.attention.length} below)` : ''}`);
  for (const a of view.attention) {
    const l = a.lease;
    lines.push(`  ${l ? `${l.provider}/${l.companyId}/${l.environmentId}/${l.leaseId}` : a.laneId}  [${a.reasons.join(', ')}]  ${a.detail}`);
  }
  return lines.join('\n');
}

/**
 * `lease-ops partitions [--set N]`: the deployment's partition count and, per partition, its
 * open lanes, jobs and workers. With --set: refused (exit 1) while any partition has a worker,
 * an open lane or a job to run; else the count changes (every process must then be started
 * with it). See docs/scaling.md.
 */
export async function runPartitions(opts: { set?: string; json?: boolean }): Promise<number> {
  const wanted = opts.set === undefined ? null : /^\d+$/.test(opts.set) ? Number(opts.set) : NaN;
  if (wanted !== null && !(Number.isInteger(wanted) && wanted >= 1 && wanted <= 256)) {
    err(`--set takes a partition count from 1 to 256, not "${opts.set}"`);
    return EXIT.badInput;
  }
  const config = loadConfig({ LEASE_OPS_LOG_LEVEL: 'warn', ...process.env });
  const probe = new LeaseOpsClient(config);
  let held: number | null;
  try {
    held = await probe.heldPartitionCount();
  } finally {
    await probe.close();
  }
  // The partitions as the deployment has them. With no count recorded, they may be those of
  // one partition (a deployment from before partitions) or of the count configured here: both
  // are looked at.
  const shown = new LeaseOpsClient({ ...config, LEASE_OPS_PARTITIONS: held ?? config.LEASE_OPS_PARTITIONS });
  const alsoOne = held === null && config.LEASE_OPS_PARTITIONS !== 1 ? new LeaseOpsClient({ ...config, LEASE_OPS_PARTITIONS: 1 }) : null;
  const rowsOf = (c: LeaseOpsClient) =>
    Promise.all(
      c.partitions.map(async (p) => {
        const counts = await p.ops.queue.getJobCounts('wait', 'prioritized', 'active', 'delayed');
        return {
          partition: p.index,
          prefix: p.settings.LEASE_OPS_PREFIX,
          openLanes: await p.ops.lanes.openLaneCount(),
          jobs: Object.values(counts).reduce((n, c) => n + c, 0),
          workers: await p.ops.queue.getWorkersCount(),
        };
      }),
    );
  try {
    const rows = await rowsOf(shown);
    const legacy = alsoOne ? (await rowsOf(alsoOne)).map((r) => ({ ...r, partition: -1 })) : [];
    const busy = [...rows, ...legacy].filter((r) => r.openLanes > 0 || r.jobs > 0 || r.workers > 0);
    if (wanted === null || wanted === held) {
      if (opts.json) out(JSON.stringify({ partitions: held, configured: config.LEASE_OPS_PARTITIONS, byPartition: rows }));
      else {
        out(`partitions: ${held ?? `none recorded yet (LEASE_OPS_PARTITIONS=${config.LEASE_OPS_PARTITIONS} here)`}`);
        for (const r of rows) out(`  ${r.partition}  ${r.prefix}  open lanes ${r.openLanes}, jobs to run ${r.jobs}, workers ${r.workers}`);
      }
      return EXIT.ok;
    }
    if (busy.length > 0) {
      err(
        `not changed: ${busy.map((r) => (r.partition === -1 ? `the one-partition layout under ${r.prefix}` : `partition ${r.partition}`)).join(', ')} still ha${busy.length > 1 ? 've' : 's'} workers, open lanes or jobs to run. ` +
          'A lease would map to another partition while its operations wait in the old one. Stop the producers and the workers, let the lanes drain ' +
          '(with one worker per partition running, then stopped), and run this again.',
      );
      return EXIT.operationFailed;
    }
    if (!(await changePartitionCount(shown.ops.connection, config.LEASE_OPS_PREFIX, held, wanted))) {
      err('not changed: the partition count changed meanwhile; look again with `lease-ops partitions`');
      return EXIT.operationFailed;
    }
    out(`partitions: ${held ?? 'none'} -> ${wanted}. Start every worker, API and client with LEASE_OPS_PARTITIONS=${wanted}.`);
    out('  Each lease\'s last observed state and history stay under its old partition and are not shown any more; its next operation records them afresh.');
    return EXIT.ok;
  } finally {
    await shown.close();
    await alsoOne?.close();
  }
}

export interface ActivityCliOptions extends LeaseCliOptions {
  kind?: string;
  ttlMs: string;
  json?: boolean;
}

/**
 * `lease-ops activity begin|heartbeat|end|run`: activity gates from the shell. `run` begins an
 * activity, runs a command while heartbeating it, sends the command SIGTERM once a stop asks the
 * activity to cancel, and ends it when the command exits (with the command's exit code).
 * 1 when refused (lease_closing) or gone, 2 for bad input.
 */
export async function runActivity(action: 'begin' | 'heartbeat' | 'end' | 'run', token: string | undefined, opts: ActivityCliOptions, command: string[] = []): Promise<number> {
  const ttlMs = Number(opts.ttlMs);
  if ((action === 'begin' || action === 'run') && ([opts.provider, opts.company, opts.environment, opts.lease, opts.kind].some((v) => v === undefined) || (action === 'run' && command.length === 0))) {
    err(`activity ${action} needs --provider, --company, --environment, --lease and --kind${action === 'run' ? ', and a command after --' : ''}`);
    return EXIT.badInput;
  }
  return withClient(async (client) => {
    try {
      if (action === 'begin') {
        const begun = await client.beginActivity(leaseOf(opts), opts.kind!, ttlMs);
        out(opts.json ? JSON.stringify(begun) : begun.token);
        return EXIT.ok;
      }
      if (action === 'heartbeat') {
        const beat = await client.heartbeatActivity(token ?? '', ttlMs);
        out(opts.json ? JSON.stringify(beat) : `open until ${new Date(beat.expiresAt).toISOString()}${beat.cancel ? '; a stop asked it to cancel' : ''}`);
        return EXIT.ok;
      }
      if (action === 'end') {
        if (!(await client.endActivity(token ?? ''))) throw new ActivityNotFoundError();
        return EXIT.ok;
      }
      return await runUnderActivity(client, leaseOf(opts), opts.kind!, ttlMs, command);
    } catch (e) {
      if (e instanceof LeaseClosingError || e instanceof ActivityNotFoundError) {
        err(`${e.code}: ${e.message}`);
        return EXIT.operationFailed;
      }
      if (e instanceof InvalidRequestError) {
        err(`invalid request:\n${e.message}`);
        return EXIT.badInput;
      }
      throw e;
    }
  });
}

async function runUnderActivity(client: LeaseOpsClient, lease: LeaseIdentity, kind: string, ttlMs: number, command: string[]): Promise<number> {
  const { spawn } = await import('node:child_process');
  const { token } = await client.beginActivity(lease, kind, ttlMs);
  const child = spawn(command[0]!, command.slice(1), { stdio: 'inherit' });
  let cancelled = false;
  const beat = setInterval(() => {
    client.heartbeatActivity(token, ttlMs).then(
      ({ cancel }) => {
        if (cancel && !cancelled) {
          cancelled = true;
          child.kill('SIGTERM');
        }
      },
      (e: unknown) => err(`heartbeat: ${(e as Error).message}`),
    );
  }, Math.max(200, Math.floor(ttlMs / 3)));
  const code = await new Promise<number>((resolve) => {
    child.on('exit', (exitCode, signal) => resolve(exitCode ?? (signal === 'SIGTERM' ? 143 : 1)));
    child.on('error', (e) => {
      err(`cannot run ${command[0]}: ${e.message}`);
      resolve(127);
    });
  });
  clearInterval(beat);
  await client.endActivity(token);
  return code;
}
