import { DelayedError, type Job } from 'bullmq';
import { z } from 'zod';
import { LeaseIdentitySchema, type LeaseIdentity } from '../lease.ts';
import type { Logger } from '../logger.ts';
import { SealedSchema, seal, unseal, type MasterKeys } from '../providers/instances/sealing.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import { ProviderError } from '../providers/errors.ts';
import type { ExecResult, OperationContext } from '../providers/types.ts';
import type { Activities } from './activities.ts';
import { passOnUnserved } from './pass-on.ts';
import { WaitedQueue } from './queue-events.ts';
import type { RedisClient } from './redis.ts';

/** The queue (per partition) whose jobs run commands in sandboxes, beside the lanes. */
export const execQueueName = (queue: string) => `${queue}-exec`;

/** How long a cancelled or timed-out command is read on, waiting for it to exit. */
export const EXEC_GRACE_MS = 30_000;
export const MAX_EXEC_TIMEOUT_MS = 15 * 60_000;

const EnvNameSchema = z.string().regex(/^[A-Za-z_][A-Za-z0-9_]{0,127}$/, 'an environment variable name is letters, digits and _');
/** Text that reaches a shell: no NUL (no shell can hold one; a provider's error would quote it back). */
const ShellTextSchema = (max: number) => z.string().max(max).regex(/^[^\0]*$/, 'must not contain NUL characters');
/** The whole command as the sandbox's shell gets it (command, args, cwd, env, stdin): below any shell's argument limit. */
export const MAX_EXEC_REQUEST_CHARS = 96 * 1024;
/** Of each of stdout and stderr, what an answer carries (the rest is cut, and the answer says how much). */
export const MAX_EXEC_OUTPUT_CHARS = 1024 * 1024;

/** A command to run in a lease's sandbox (the API's body, the client's argument). */
export const ExecRequestSchema = z.strictObject({
  /** The sandbox, by the id its acquire answered. */
  providerLeaseId: z.string().min(1).max(256),
  command: ShellTextSchema(32_768).min(1),
  args: z.array(ShellTextSchema(32_768)).max(256).optional(),
  cwd: ShellTextSchema(4_096).min(1).optional(),
  env: z.record(EnvNameSchema, ShellTextSchema(32_768)).optional(),
  stdin: ShellTextSchema(MAX_EXEC_REQUEST_CHARS).optional(),
  timeoutMs: z.number().int().min(100).max(MAX_EXEC_TIMEOUT_MS).default(60_000),
  /** What the activity that brackets the command is called (the lease's timeline shows it). */
  kind: z.string().min(1).max(64).regex(/^[^\p{Cc}]+$/u).default('exec'),
  /** The activity's TTL: a worker that dies mid-command lets go of the lease this long after its last heartbeat. */
  ttlMs: z.number().int().min(1_000).max(600_000).default(15_000),
}).refine(
  (r) => r.command.length + (r.cwd?.length ?? 0) + (r.stdin?.length ?? 0) + (r.args ?? []).reduce((n, a) => n + a.length + 3, 0) + Object.entries(r.env ?? {}).reduce((n, [k, v]) => n + k.length + v.length + 4, 0) <= MAX_EXEC_REQUEST_CHARS,
  { message: `the command with its args, cwd, env and stdin is over ${MAX_EXEC_REQUEST_CHARS} characters: pass large input as a file in the sandbox` },
);
export type ExecRequestInput = z.input<typeof ExecRequestSchema>;

/** What goes in the job: the command, with its environment and stdin sealed (they may hold secrets). */
const ExecJobSchema = z.object({
  lease: LeaseIdentitySchema,
  token: z.string().min(1),
  ttlMs: z.number().int(),
  request: z.object({
    providerLeaseId: z.string(),
    command: z.string(),
    args: z.array(z.string()).optional(),
    cwd: z.string().optional(),
    timeoutMs: z.number().int(),
  }),
  secrets: SealedSchema.optional(),
  /** For the lease's company's provider instance of its name only (as an operation's `instance`). */
  instance: z.literal(true).optional(),
});
type ExecJob = z.infer<typeof ExecJobSchema>;

/** An exec's answer: how the command ended, or why it could not run. */
export type ExecOutcome = { ok: true; result: ExecResult } | { ok: false; code: string; message: string };
const ExecOutcomeSchema = z.union([
  z.object({ ok: z.literal(true), result: z.object({ exitCode: z.number().nullable(), signal: z.string().nullable(), timedOut: z.boolean(), cancelled: z.boolean(), stdout: z.string(), stderr: z.string() }) }),
  z.object({ ok: z.literal(false), code: z.string(), message: z.string() }),
]);

const secretsAad = (jobId: string) => `lease-ops/exec/v1\0${jobId}`;

/**
 * Where an exec's answer waits for its caller (60 s at most): not in the job's return value,
 * which BullMQ also copies into the queue's event stream, kept there for as long as the
 * stream's length allows.
 */
const outcomeKey = (prefix: string, jobId: string) => `${prefix}:exec-outcome:${jobId}`;
const OUTCOME_TTL_MS = 60_000;
const StoredSchema = z.object({ stored: z.literal(true) });

/**
 * Queues a command for a worker of the lease's partition and waits for its end. The caller
 * has begun the activity that brackets it (`token`); the worker heartbeats it while the
 * command runs, cancels the command when a stop asks, and ends it after.
 */
export class ExecJobs {
  private readonly waited: WaitedQueue;

  constructor(
    private readonly connection: RedisClient,
    private readonly settings: { REDIS_URL: string; LEASE_OPS_QUEUE: string; LEASE_OPS_PREFIX: string },
    private readonly keys: () => MasterKeys | null,
  ) {
    this.waited = new WaitedQueue(connection, settings, execQueueName(settings.LEASE_OPS_QUEUE), 'lease-ops-client-exec');
  }

  async run(lease: LeaseIdentity, token: string, request: z.output<typeof ExecRequestSchema>, jobId: string, companyInstance = false): Promise<ExecOutcome> {
    const { queue, events } = await this.waited.open();
    let secrets: ExecJob['secrets'];
    if (request.env !== undefined || request.stdin !== undefined) {
      const keys = this.keys();
      if (!keys) return { ok: false, code: 'secrets_key_missing', message: 'a command with env or stdin needs LEASE_OPS_SECRETS_KEY here and on the workers: they travel sealed, never in plaintext through Redis' };
      secrets = seal(keys, secretsAad(jobId), { env: JSON.stringify(request.env ?? {}), ...(request.stdin === undefined ? {} : { stdin: request.stdin }) });
    }
    const data: ExecJob = {
      lease,
      token,
      ttlMs: request.ttlMs,
      request: { providerLeaseId: request.providerLeaseId, command: request.command, ...(request.args ? { args: request.args } : {}), ...(request.cwd ? { cwd: request.cwd } : {}), timeoutMs: request.timeoutMs },
      ...(secrets ? { secrets } : {}),
      ...(companyInstance ? { instance: true as const } : {}),
    };
    const job: Job = await queue.add('exec', data, { jobId, attempts: 1, removeOnComplete: { age: 60 }, removeOnFail: { age: 60 } });
    try {
      const stored = StoredSchema.safeParse(await this.waited.waitFor(jobId, events, request.timeoutMs + EXEC_GRACE_MS + 15_000));
      const text = stored.success ? await this.connection.getdel(outcomeKey(this.settings.LEASE_OPS_PREFIX, jobId)) : null;
      const outcome = ExecOutcomeSchema.safeParse(text === null ? null : JSON.parse(text));
      if (outcome.success) return outcome.data;
      return { ok: false, code: 'exec_failed', message: 'the worker\'s answer is gone or unreadable' };
    } catch (err) {
      const message = (err as Error).message ?? '';
      // Still waiting (no worker took it): take it back, so it does not run after its caller left.
      await job.remove().catch(() => undefined);
      if (/timed out/i.test(message)) return { ok: false, code: 'exec_timeout', message: 'no worker ran the command in time (is one running that serves this provider?)' };
      return { ok: false, code: 'exec_failed', message: /stalled/i.test(message) ? 'the worker running the command stopped (it is not run again: it may have run)' : message };
    }
  }

  close(): Promise<void> {
    return this.waited.close();
  }
}

/**
 * Runs an exec job on a worker: the provider's exec, heartbeating the activity that brackets
 * it (a cancel asked by a stop, or the activity gone, cancels the command), then ends the
 * activity. Never throws for the command's own outcome; a job is never run twice (a worker
 * that dies mid-command leaves it failed, not re-run: it may have run).
 */
export async function runExec(job: Job, token: string | undefined, deps: ExecDeps & { redis: RedisClient; prefix: string }): Promise<{ stored: true }> {
  const outcome = await runExecJob(job, token, deps);
  await deps.redis.set(outcomeKey(deps.prefix, job.id!), JSON.stringify(outcome), 'PX', OUTCOME_TTL_MS);
  return { stored: true };
}

interface ExecDeps {
  providers: ProviderRegistry;
  activities: Activities;
  keys: MasterKeys | null;
  log: Logger;
  /** Whether some worker has announced a provider (it may serve what this one does not). */
  announced: (provider: string) => Promise<boolean>;
}

async function runExecJob(job: Job, jobToken: string | undefined, deps: ExecDeps): Promise<ExecOutcome> {
  const parsed = ExecJobSchema.safeParse(job.data);
  if (!parsed.success) return { ok: false, code: 'invalid_job', message: 'an exec job this version cannot read' };
  const { lease, token, ttlMs, request, instance } = parsed.data;
  const log = deps.log.child({ lease, job: job.id, op: 'exec' });
  /** Gone back for another worker: its activity stays open for the worker that runs it. */
  let passedOn = false;
  try {
    const resolved = await deps.providers.resolve(lease, instance === true);
    if (!('provider' in resolved)) {
      // Not served here (another replica may serve it): back for another worker, while its activity is open.
      // Until its ttlMs: a command that waited for a worker longer does not run anyway.
      if (!resolved.forGood && (await passOnUnserved(job, jobToken, job.timestamp + ttlMs, () => deps.announced(lease.provider)))) {
        passedOn = true;
        throw new DelayedError();
      }
      return { ok: false, code: resolved.code, message: resolved.message };
    }
    const provider = resolved.provider;
    if (!provider.exec) return { ok: false, code: 'exec_unsupported', message: `${lease.provider} cannot run commands in its sandboxes` };
    let env: Record<string, string> | undefined;
    let stdin: string | undefined;
    if (parsed.data.secrets) {
      if (!deps.keys) return { ok: false, code: 'secrets_key_missing', message: 'this worker holds no LEASE_OPS_SECRETS_KEY to open the command\'s env and stdin' };
      try {
        const opened = unseal(deps.keys, secretsAad(job.id!), parsed.data.secrets);
        env = JSON.parse(opened.env ?? '{}') as Record<string, string>;
        stdin = opened.stdin;
      } catch {
        return { ok: false, code: 'exec_secrets_unreadable', message: "the command's sealed env and stdin do not open with this worker's key" };
      }
    }
    // Its activity must still be open as it starts: one that lapsed while the job waited for a
    // worker (or was cancelled) means a stop may have gone on, and the command must not run.
    const open = await deps.activities.heartbeat(token, ttlMs);
    if (open === null || open.cancel) {
      return { ok: false, code: 'activity_lapsed', message: open === null ? `the command waited for a worker longer than its ttlMs (${ttlMs} ms): it did not run` : 'a stop asked to cancel the command before it started: it did not run' };
    }
    const cancel = new AbortController();
    // The activity is kept open while the command runs; a cancel asked (or the activity gone)
    // cancels it. Often enough that a cancel is seen within a second (a heartbeat costs Redis ~40 µs).
    const beat = setInterval(() => {
      void deps.activities.heartbeat(token, ttlMs).then(
        (answer) => {
          if (answer === null || answer.cancel) cancel.abort();
        },
        (err: unknown) => log.warn({ err }, 'could not heartbeat the exec\'s activity'),
      );
    }, Math.max(200, Math.min(1_000, Math.floor(ttlMs / 3))));
    const startedAt = Date.now();
    const ctx: OperationContext = {
      lease,
      jobId: job.id!,
      attempt: 1,
      attemptId: `${job.id}:exec`,
      signal: cancel.signal,
      deadlineAt: startedAt + request.timeoutMs + EXEC_GRACE_MS + 10_000,
      // Outside the lane: the activity, not the lane, orders it against the lease's stops.
      fence: async () => undefined,
      fenceIsFresh: () => true,
      observe: () => undefined,
      log,
      checkpoint: { read: async () => ({}), write: async () => undefined },
    };
    try {
      const result = await provider.exec(ctx, request.providerLeaseId, { command: request.command, ...(request.args ? { args: request.args } : {}), ...(request.cwd ? { cwd: request.cwd } : {}), ...(env ? { env } : {}), ...(stdin === undefined ? {} : { stdin }), timeoutMs: request.timeoutMs }, { graceMs: EXEC_GRACE_MS });
      log.info({ exitCode: result.exitCode, cancelled: result.cancelled, timedOut: result.timedOut, ms: Date.now() - startedAt }, 'exec ended');
      return { ok: true, result: { ...result, stdout: capped(result.stdout), stderr: capped(result.stderr) } };
    } catch (err) {
      const code = typeof (err as { code?: unknown }).code === 'string' ? (err as { code: string }).code : 'exec_failed';
      // The provider's own errors say what the service answered (their text never quotes the
      // command); anything else stays in the worker's log.
      if (!(err instanceof ProviderError)) log.error({ err }, 'exec failed');
      return { ok: false, code, message: err instanceof ProviderError ? err.message : 'the command could not be run (the worker\'s log says why)' };
    } finally {
      clearInterval(beat);
    }
  } finally {
    if (!passedOn) await deps.activities.end(token).catch((err: unknown) => log.warn({ err }, 'could not end the exec\'s activity'));
  }
}

/** At most MAX_EXEC_OUTPUT_CHARS of an output, the rest cut with a marker saying how much. */
function capped(text: string): string {
  if (text.length <= MAX_EXEC_OUTPUT_CHARS) return text;
  return `${text.slice(0, MAX_EXEC_OUTPUT_CHARS)}\n[lease-ops: ${text.length - MAX_EXEC_OUTPUT_CHARS} more characters cut]`;
}
