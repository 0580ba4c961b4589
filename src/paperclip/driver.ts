import { randomUUID } from 'node:crypto';
import { z } from 'zod';
import type { LeaseIdentity } from '../lease.ts';
import type { OperationName } from '../operations.ts';
import type { OperationView } from '../queues/inspect.ts';
import { ended, LeaseOpsHookError, type LeaseOpsBackend, type Started } from './backend.ts';
import { LeaseOpsDriverConfigSchema, releaseDispositionOf, type LeaseOpsDriverConfig } from './config.ts';
import { MAX_EXEC_TIMEOUT_MS } from '../queues/exec-jobs.ts';

// paperclip's hook parameters and results (its plugin SDK's dist/protocol.d.ts), as far as
// lease-ops reads and answers them, written out so these hooks work without the SDK (the
// in-process driver); plugin.ts hands them to the SDK's definePlugin, whose types check them.
interface BaseParams {
  driverKey: string;
  companyId: string;
  environmentId: string;
  issueId?: string | null;
  config: Record<string, unknown>;
}
export interface AcquireParams extends BaseParams {
  runId: string;
  workspaceMode?: string;
  requestedCwd?: string;
  agentId?: string;
  executionWorkspaceId?: string | null;
  adapterType?: string;
  executionWorkspaceSettings?: Record<string, unknown> | null;
  requestedExpiresAt?: string | null;
}
export interface ResumeParams extends BaseParams {
  providerLeaseId: string;
  leaseMetadata?: Record<string, unknown>;
}
export interface ReleaseParams extends BaseParams {
  providerLeaseId: string | null;
  leaseMetadata?: Record<string, unknown>;
  /** Terminate active work instead of waiting for it (paperclip's operator cancel). */
  cancelActiveWork?: boolean;
  /** Newer hosts say what to leave behind; older ones leave it to the driver's config. */
  resourceDisposition?: string;
}
export interface ExecuteParams extends BaseParams {
  lease: Lease;
  command: string;
  args?: string[];
  cwd?: string;
  env?: Record<string, string>;
  stdin?: string;
  timeoutMs?: number;
  bypassSession?: boolean;
}
export interface ExecuteResult {
  exitCode: number | null;
  signal?: string | null;
  timedOut: boolean;
  stdout: string;
  stderr: string;
  metadata?: Record<string, unknown>;
}
export interface Lease {
  providerLeaseId: string | null;
  metadata?: Record<string, unknown>;
  expiresAt?: string | null;
}
export interface TerminationReceipt {
  providerLeaseId: string;
  state: 'stopped' | 'destroyed';
}
export interface ValidationResult {
  ok: boolean;
  warnings?: string[];
  errors?: string[];
  normalizedConfig?: Record<string, unknown>;
}
export interface ProbeResult {
  ok: boolean;
  summary?: string;
  diagnostics?: { severity: 'info' | 'warning' | 'error'; message: string; code?: string; details?: Record<string, unknown> }[];
  metadata?: Record<string, unknown>;
}

/** Each hook's wait per round trip: long polls well under any proxy's idle timeout. */
const POLL_MS = 25_000;
/** validateConfig has no environment: it asks lease-ops briefly, and warns if it cannot. */
const VALIDATE_MS = 5_000;
/** How many times a run's acquire is started anew after earlier hooks' acquires failed. */
const MAX_ACQUIRE_GENERATIONS = 5;
/** Failures of an earlier hook's acquire that a new acquire may not meet (a refusal it would). */
const RETRIED_ANEW = new Set(['cancelled', 'deadline_exceeded', 'stalled_too_often', 'orphaned', 'removed', 'hook_timeout']);
/** A command's timeout when the host gives none (paperclip's adapters give one). */
const DEFAULT_EXEC_TIMEOUT_MS = 300_000;
/** What lease-ops may take beyond a command's timeout to answer (its cancel's grace, a queue wait). */
const EXEC_ANSWER_MARGIN_MS = 45_000;
/** A long poll asks lease-ops to answer this long before the hook's deadline. */
const ANSWER_MARGIN_MS = 1_000;
/** The part of an acquire hook's time kept for cancelling the acquire when it gives up (at most a quarter). */
const ABANDON_MS = 3_000;

/**
 * The environment-driver hooks, served by lease-ops: each hook is one lease-ops operation in
 * the lease's lane (acquire, resume, release, destroy), waited for with a blocking enqueue
 * and long polls until it ends or the hook's timeout passes. `backendFor` gives the lease-ops
 * an environment's config points at (its URL and token), or an in-process one.
 */
export function leaseOpsDriverHooks(backendFor: (config: LeaseOpsDriverConfig) => LeaseOpsBackend) {
  const configOf = (raw: Record<string, unknown>): LeaseOpsDriverConfig => {
    const parsed = LeaseOpsDriverConfigSchema.safeParse(raw);
    if (!parsed.success) throw new LeaseOpsHookError('invalid_config', z.prettifyError(parsed.error));
    return parsed.data;
  };

  /** One operation, from enqueue to its end: its result, or its failure as a LeaseOpsHookError. */
  async function operate(config: LeaseOpsDriverConfig, op: OperationName, lease: LeaseIdentity, params: Record<string, unknown>, idempotencyKey: string): Promise<unknown> {
    const backend = backendFor(config);
    const end = Date.now() + config.hookTimeoutMs;
    // An acquire keeps a little of the hook's time for cancelling itself if it must give up.
    const deadline = op === 'acquire' ? end - Math.min(ABANDON_MS, config.hookTimeoutMs / 4) : end;
    // What lease-ops is asked to wait: its answer must arrive before the hook's deadline.
    const waitFor = () => Math.max(0, Math.min(POLL_MS, deadline - Date.now() - ANSWER_MARGIN_MS));
    const request = { op, lease, params, idempotencyKey };
    let started: Started;
    try {
      started = await backend.enqueue(request, waitFor(), deadline);
    } catch (err) {
      // Given up before the enqueue answered: the acquire may have been accepted all the same.
      if (op === 'acquire' && err instanceof LeaseOpsHookError && err.code === 'hook_timeout') {
        const known = await backend.enqueue(request, 0, Math.max(end, Date.now() + 500)).catch(() => null);
        if (known) return giveUp(backend, known.jobId, end, err);
      }
      throw err;
    }
    const { jobId } = started;
    let view = started.operation;
    try {
      for (let quick = 0; !ended(view); ) {
        if (Date.now() >= deadline - ANSWER_MARGIN_MS) {
          throw new LeaseOpsHookError('hook_timeout', `${op} did not end within ${config.hookTimeoutMs} ms (hookTimeoutMs)`, jobId);
        }
        const asked = waitFor();
        const askedAt = Date.now();
        view = await backend.wait(jobId, asked, deadline);
        // A wait answered at once, not ended (a lease-ops whose waits are capped at 0): the next
        // after a backoff from 100 ms to 2 s, not at once (helper-38: 100 polls a second).
        if (ended(view) || Date.now() - askedAt >= Math.min(asked, 100)) quick = 0;
        else await new Promise((r) => setTimeout(r, Math.max(0, Math.min(2_000, 100 * 2 ** quick++, deadline - ANSWER_MARGIN_MS - Date.now()))));
      }
    } catch (err) {
      // The host gives up on this hook: an acquire must not leave a sandbox behind with no owner.
      if (op === 'acquire' && err instanceof LeaseOpsHookError && (err.code === 'hook_timeout' || err.code === 'unreachable')) return giveUp(backend, jobId, end, err);
      throw err;
    }
    return resultOf(view, jobId, started.joined);
  }

  /** An operation's result, or its failure as a LeaseOpsHookError. */
  function resultOf(view: OperationView, jobId: string, joined: boolean): unknown {
    if (view.state === 'failed') throw new LeaseOpsHookError(view.error?.code ?? 'failed', view.error?.message ?? 'the operation failed', jobId, joined);
    return view.result;
  }

  /**
   * Cancels an acquire the hook gives up on; its clean-up destroys what it made. One that
   * completed first is a lease the host must not lose: the hook answers with it (a host that
   * retries the acquire for the run gets the same one). One that cannot be cancelled (lease-ops
   * unreachable) leaves the hook's error as it was.
   */
  async function giveUp(backend: LeaseOpsBackend, jobId: string, end: number, err: LeaseOpsHookError): Promise<unknown> {
    const until = Math.max(end, Date.now() + 500);
    const outcome = await backend.cancel(jobId, until);
    if (outcome === 'cancelled') throw new LeaseOpsHookError(err.code, `${err.detail}; the acquire was cancelled, and what it made is destroyed`, jobId);
    if (outcome === 'unknown') throw new LeaseOpsHookError(err.code, `${err.detail}; the acquire could not be cancelled (lease-ops did not take the cancel in time), and may still make its sandbox`, jobId);
    const view = await backend.wait(jobId, 0, Math.max(until, Date.now() + 500)).catch(() => null);
    if (!ended(view)) throw err;
    return resultOf(view, jobId, false);
  }

  const leaseOf = (config: LeaseOpsDriverConfig, params: BaseParams, leaseId: string): LeaseIdentity => ({
    provider: config.provider,
    companyId: params.companyId,
    environmentId: params.environmentId,
    leaseId,
  });
  /** Not a request id (hooks have none): the same key serves a POST repeated within one hook call. */
  const callKey = (op: string) => `paperclip:${op}:${randomUUID()}`;
  const withoutUndefined = (o: Record<string, unknown>) => Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined));

  return {
    async onValidateConfig(params: { driverKey: string; config: Record<string, unknown> }): Promise<ValidationResult> {
      const parsed = LeaseOpsDriverConfigSchema.safeParse(params.config);
      if (!parsed.success) return { ok: false, errors: parsed.error.issues.map((i) => `${i.path.join('.') || 'config'}: ${i.message}`) };
      const known = new Set(Object.keys(LeaseOpsDriverConfigSchema.shape));
      const warnings = Object.keys(params.config).filter((k) => !known.has(k)).map((k) => `${k}: not a lease-ops setting (ignored)`);
      try {
        const provider = await backendFor(parsed.data).provider(parsed.data.provider, false, Date.now() + VALIDATE_MS);
        if (!provider) return { ok: false, errors: [`provider: lease-ops serves no provider "${parsed.data.provider}"`], warnings };
      } catch (err) {
        const code = err instanceof LeaseOpsHookError ? err.code : 'error';
        // A token lease-ops refuses is wrong config; lease-ops being away now is not.
        if (code === 'unauthorized' || code === 'forbidden') return { ok: false, errors: [`token: ${(err as Error).message}`], warnings };
        warnings.push(`could not check the provider with lease-ops now: ${(err as Error).message}`);
      }
      return { ok: true, warnings, normalizedConfig: { ...params.config, ...parsed.data } };
    },

    async onProbe(params: BaseParams): Promise<ProbeResult> {
      let config: LeaseOpsDriverConfig;
      try {
        config = configOf(params.config);
      } catch (err) {
        return { ok: false, summary: (err as Error).message, diagnostics: [{ severity: 'error', code: 'invalid_config', message: (err as Error).message }] };
      }
      try {
        const provider = await backendFor(config).provider(config.provider, true, Date.now() + Math.min(config.hookTimeoutMs, 30_000), { companyId: params.companyId, environmentId: params.environmentId });
        if (!provider) return { ok: false, summary: `lease-ops serves no provider "${config.provider}"`, diagnostics: [{ severity: 'error', code: 'unknown_provider', message: `lease-ops serves no provider "${config.provider}"` }] };
        const probe = provider.probe;
        const ok = probe?.ok ?? false;
        return {
          ok,
          summary: ok ? `lease-ops provider ${config.provider}: ${probe?.message}` : `lease-ops provider ${config.provider}: ${probe?.code ?? 'no probe'}: ${probe?.message ?? ''}`,
          diagnostics: [{ severity: ok ? 'info' : 'error', code: probe?.code ?? 'probe_failed', message: probe?.message ?? 'no answer' }],
          metadata: { provider: config.provider, capabilities: provider.capabilities, probedAt: probe?.at ?? null },
        };
      } catch (err) {
        const code = err instanceof LeaseOpsHookError ? err.code : 'error';
        return { ok: false, summary: (err as Error).message, diagnostics: [{ severity: 'error', code, message: (err as Error).message }] };
      }
    },

    /**
     * Keyed by the run: a host's retry of the acquire joins the first one (also when its
     * requestedExpiresAt was recomputed: lease-ops then names the first one's job), so a run
     * gets one sandbox however often the host asks; once an earlier hook's acquire failed, the
     * next key of the run starts a new one.
     */
    async onAcquireLease(params: AcquireParams): Promise<Lease> {
      const config = configOf(params.config);
      const body = withoutUndefined({
        runId: params.runId,
        requestedExpiresAt: params.requestedExpiresAt,
        requireExpiry: config.requireExpiry || undefined,
        agentId: params.agentId,
        adapterType: params.adapterType,
        workspaceMode: params.workspaceMode,
        requestedCwd: params.requestedCwd,
        issueId: params.issueId,
        executionWorkspaceId: params.executionWorkspaceId,
        executionWorkspaceSettings: params.executionWorkspaceSettings,
      });
      const lease = leaseOf(config, params, params.runId);
      for (let generation = 0; ; generation++) {
        const key = `paperclip:acquire:${params.runId}${generation === 0 ? '' : `:${generation}`}`;
        try {
          const acquired = (await operate(config, 'acquire', lease, body, key)) as Lease;
          return { providerLeaseId: acquired.providerLeaseId, metadata: acquired.metadata ?? {}, expiresAt: acquired.expiresAt ?? null };
        } catch (err) {
          // An earlier hook's acquire for this run failed (or was cancelled when the host gave
          // up on it): this one acquires anew. Every hook of the run takes the same next key.
          if (err instanceof LeaseOpsHookError && err.joined && RETRIED_ANEW.has(err.code) && generation < MAX_ACQUIRE_GENERATIONS) continue;
          throw err;
        }
      }
    },

    /** The lease, with the host's metadata and what was read now over it; expired (a result) when the sandbox cannot be used. */
    async onResumeLease(params: ResumeParams): Promise<Lease> {
      const config = configOf(params.config);
      const lease = (await operate(config, 'resume', leaseOf(config, params, params.providerLeaseId), { providerLeaseId: params.providerLeaseId, leaseMetadata: params.leaseMetadata ?? {} }, callKey('resume'))) as Lease;
      return lease.providerLeaseId === null ? { providerLeaseId: null, metadata: { expired: true } } : { providerLeaseId: lease.providerLeaseId, metadata: lease.metadata ?? {}, expiresAt: lease.expiresAt ?? null };
    },

    /**
     * A termination receipt once the service confirmed that execution ended; nothing when the
     * sandbox was kept running. `cancelActiveWork` kills instead of letting work finish.
     */
    async onReleaseLease(params: ReleaseParams): Promise<TerminationReceipt | undefined> {
      if (params.providerLeaseId === null) return undefined;
      const config = configOf(params.config);
      let disposition = releaseDispositionOf(config, params.resourceDisposition);
      // An operator's cancel ends the work: a keep_running release of it stops and keeps the sandbox.
      if (params.cancelActiveWork && disposition === 'keep_running') disposition = 'stop_and_retain';
      const receipt = (await operate(
        config,
        'release',
        leaseOf(config, params, params.providerLeaseId),
        { providerLeaseId: params.providerLeaseId, leaseMetadata: params.leaseMetadata ?? {}, cancelActiveWork: params.cancelActiveWork ?? false, resourceDisposition: disposition },
        callKey('release'),
      )) as TerminationReceipt | null;
      return receipt ?? undefined;
    },

    /**
     * A command in the lease's sandbox, bracketed by an activity gate: a release or destroy
     * with cancelActiveWork cancels it (its answer then says so in `metadata.cancelled`), any
     * other waits for it, and none can stop the sandbox under it.
     */
    async onExecute(params: ExecuteParams): Promise<ExecuteResult> {
      const config = configOf(params.config);
      const sandbox = params.lease?.providerLeaseId;
      if (!sandbox) throw new LeaseOpsHookError('no_sandbox', 'the lease has no sandbox to run the command in');
      const timeoutMs = Math.min(params.timeoutMs ?? DEFAULT_EXEC_TIMEOUT_MS, MAX_EXEC_TIMEOUT_MS);
      const result = await backendFor(config).exec(
        leaseOf(config, params, sandbox),
        {
          providerLeaseId: sandbox,
          command: params.command,
          ...(params.args ? { args: params.args } : {}),
          ...(params.cwd ? { cwd: params.cwd } : {}),
          ...(params.env && Object.keys(params.env).length > 0 ? { env: params.env } : {}),
          ...(params.stdin === undefined ? {} : { stdin: params.stdin }),
          timeoutMs,
        },
        Date.now() + timeoutMs + EXEC_ANSWER_MARGIN_MS,
      );
      return { exitCode: result.exitCode, signal: result.signal, timedOut: result.timedOut, stdout: result.stdout, stderr: result.stderr, metadata: { cancelled: result.cancelled } };
    },

    async onDestroyLease(params: ReleaseParams): Promise<TerminationReceipt | undefined> {
      if (params.providerLeaseId === null) return undefined;
      const config = configOf(params.config);
      return (await operate(config, 'destroy', leaseOf(config, params, params.providerLeaseId), { providerLeaseId: params.providerLeaseId }, callKey('destroy'))) as TerminationReceipt;
    },
  };
}

export type LeaseOpsDriverHooks = ReturnType<typeof leaseOpsDriverHooks>;
