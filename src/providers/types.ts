import type { Logger } from '../logger.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { OperationParams } from '../operations.ts';
import type { RateLimiterFactory } from './pacing.ts';
import { ProviderError } from './errors.ts';

/** A lease as a provider hands it out. */
export interface Lease {
  providerLeaseId: string;
  metadata: Record<string, unknown>;
  /** ISO time the provider will reclaim the sandbox, or null if it will not by itself. */
  expiresAt: string | null;
}

/** Resume of a sandbox that cannot be reused (gone, identity mismatch): a result, not an error. */
export interface ExpiredLease {
  providerLeaseId: null;
  metadata: { expired: true };
}

/** Given only after the provider confirmed, by a fresh read, that execution ended. */
export interface TerminationReceipt {
  providerLeaseId: string;
  state: 'stopped' | 'destroyed';
}

/**
 * What a release ends with, in paperclip's words: a termination receipt once the service
 * confirmed that execution ended (stop_and_retain and archive: stopped; destroy: destroyed),
 * or null when nothing ended (keep_running, the sandbox still runs). A keep_running release
 * that finds the sandbox stopped or gone says so with a receipt.
 */
export type ReleaseResult = TerminationReceipt | null;

/**
 * A provider's sandbox state, normalised across providers. A transition says where it is
 * headed when the provider tells: `toward: 'stopped'` (Daytona's `stopping`, CreateOS'
 * `pausing`) is what the stuck-stop watchdog and the attention list look for. A state the
 * provider does not know is a transition with no `toward`: lease-ops waits, never acts on it.
 */
export type SandboxState =
  | { kind: 'running' }
  | { kind: 'stopped'; providerState: string }
  | { kind: 'transitioning'; providerState: string; toward?: 'running' | 'stopped' | 'gone' }
  | { kind: 'error'; providerState: string; recoverable: boolean }
  | { kind: 'gone' };

export interface ProviderCapabilities {
  stop: boolean;
  pause: boolean;
  forceStop: boolean;
  /**
   * Bounds a sandbox at acquire's `requestedExpiresAt`, and says so with the service's own
   * expiry. Without it such an acquire completes with `expiresAt: null` (or, with
   * `requireExpiry`, is refused with `expiry_unsupported`); an expiry is never claimed unbounded.
   */
  expiry?: boolean;
  /** Honours acquire's `resources`. Without it such an acquire is refused (`resources_unsupported`). */
  resources?: boolean;
  /** Takes the `archive` release disposition. Without it such a release fails with `archive_unsupported`. */
  archive?: boolean;
  /** Runs commands inside a sandbox (`exec`), cancellable. */
  exec?: boolean;
}

/** A command to run inside a sandbox (paperclip's execute hook). */
export interface ExecRequest {
  command: string;
  args?: string[];
  cwd?: string;
  env?: Record<string, string>;
  stdin?: string;
  /** The command is cancelled after this long (then `timedOut`). */
  timeoutMs: number;
}

/** How a command ended, as paperclip's execute hook answers it. */
export interface ExecResult {
  exitCode: number | null;
  signal: string | null;
  timedOut: boolean;
  /** It was cancelled (its activity was asked to cancel, or its caller gave up) before it ended by itself. */
  cancelled: boolean;
  stdout: string;
  stderr: string;
}

/** Everything a provider call gets besides its params. */
export interface OperationContext {
  lease: LeaseIdentity;
  jobId: string;
  attempt: number;
  /**
   * This attempt's id, `<jobId>:<fencing token>`: unique per attempt, also across re-runs
   * after a crash. Built-in providers send it as the X-Lease-Ops-Attempt header, so calls
   * can be traced (and fencing checked) from the cloud's side.
   */
  attemptId: string;
  /** Aborted when this attempt must stop: its lock was lost or a newer attempt superseded it. */
  signal: AbortSignal;
  /**
   * Epoch ms after which the operation fails (deadline_exceeded). A provider that would wait
   * past it (for a rate limit, say) should give up instead: see providers/pacing.ts.
   */
  deadlineAt: number;
  /**
   * Resolves if this attempt still holds its lease, throws StaleAttemptError if not. Call
   * it before every call that changes or reads the sandbox, so a stale attempt's call is
   * refused before it leaves the process. Built-in providers do.
   */
  fence(): Promise<void>;
  /**
   * Synchronous companion of fence(): true while no successor can have started since the
   * last successful fence() (it learnt how long this attempt's lock had left). Check it at
   * the moment a request leaves the process (see providers/fenced-transport.ts): it closes
   * the gap between an awaited fence() and the send, in which a paused or starved process
   * would otherwise wake up and send a stale request.
   */
  fenceIsFresh(): boolean;
  /**
   * Reports what a fresh read saw. lease-ops keeps the last state per lease and since
   * when, which is how the watchdog finds sandboxes stuck in `stopping`.
   */
  observe(providerLeaseId: string, state: SandboxState): void;
  log: Logger;
  /**
   * Small facts an operation keeps across its retries, e.g. the id of a sandbox its first
   * attempt created, so a retry finds it instead of creating another. Stored with the job.
   */
  checkpoint: {
    read(): Promise<Record<string, unknown>>;
    write(values: Record<string, unknown>): Promise<void>;
  };
}

/**
 * One interface for every cloud. Processors and the lane see nothing else.
 * Errors are thrown as SettlingError, TransientError or PermanentError.
 */
export interface LeaseProvider {
  readonly name: string;
  readonly capabilities: ProviderCapabilities;
  acquire(ctx: OperationContext, params: OperationParams['acquire']): Promise<Lease>;
  resume(ctx: OperationContext, params: OperationParams['resume']): Promise<Lease | ExpiredLease>;
  release(ctx: OperationContext, params: OperationParams['release']): Promise<ReleaseResult>;
  stop(ctx: OperationContext, params: OperationParams['stop']): Promise<TerminationReceipt>;
  forceStop(ctx: OperationContext, params: OperationParams['force-stop']): Promise<TerminationReceipt>;
  destroy(ctx: OperationContext, params: OperationParams['destroy']): Promise<TerminationReceipt>;
  /** A fresh read of the sandbox's state (never a cached one). */
  status(ctx: OperationContext, params: { providerLeaseId: string }): Promise<SandboxState>;
  /**
   * An acquire failed for good (a permanent error, its deadline, too many crashes): the id
   * of the live sandbox its attempts created, found the way a retry of that acquire would
   * find it (a name derived from its job id, or what it checkpointed: null when the job,
   * and with it its checkpoint, is gone), or null if they made none. lease-ops calls it from an `abandon-acquire` operation queued in the acquire's own
   * lane, which then destroys what it found, retrying within its own deadline.
   */
  findAcquired?(ctx: OperationContext, acquire: { jobId: string; checkpoint: Record<string, unknown> | null }): Promise<string | null>;
  /**
   * Asks the service, with one cheap read (paced like any request), whether it takes this
   * provider's credentials. Never creates anything. Without it, a probe says there is nothing
   * to check.
   */
  probe?(ctx: OperationContext): Promise<ProbeResult>;
  /**
   * Runs a command inside the sandbox and resolves once it ended. `ctx.signal` aborting
   * cancels it; the call still resolves only once the command is seen ended (a process may
   * ignore its cancel for a while) or `graceMs` after the cancel, whichever is first.
   */
  exec?(ctx: OperationContext, sandboxId: string, request: ExecRequest, opts: { graceMs: number }): Promise<ExecResult>;
  /**
   * Waits for the service to push a state of the sandbox other than `seen` (what the
   * attempt's last read saw): `changed` once one came (or came after `since`, a
   * performance.now() time taken before that read); `unchanged` when none came within
   * `timeoutMs` or `signal` aborted; `cannot_push` at once when the service cannot push now.
   * Never throws, and makes no request that counts against a rate limit. An attempt that met
   * a settling error calls it and, on `changed`, runs its operation again at once instead of
   * backing off in its lane.
   */
  waitForChange?(ctx: OperationContext, providerLeaseId: string, seen: SandboxState, opts: { since: number; timeoutMs: number; signal: AbortSignal }): Promise<'changed' | 'unchanged' | 'cannot_push'>;
  close?(): Promise<void>;
}

/** What a credentials probe learnt: `ok`, or why not (`unauthorized`, `forbidden`, `unreachable`, ...). */
export interface ProbeResult {
  ok: boolean;
  code: string;
  message: string;
}

/** A probe's answer from a provider error: its code and message (which name no credential). */
export function probeFailure(err: unknown): ProbeResult {
  // Only a provider's own errors say what the service answered; anything else (a Redis or
  // programming error) is not for tenants to read.
  if (!(err instanceof ProviderError)) return { ok: false, code: 'probe_failed', message: 'the probe failed on the worker (its log says why)' };
  return { ok: false, code: err.code, message: err.message };
}

/** What lease-ops gives a provider it builds: a rate limiter shared by every worker replica. */
export interface ProviderServices {
  rateLimiters: RateLimiterFactory;
}

/** What a provider module exports: `export default function createProvider(env, services) {...}`. */
export type ProviderFactory = (env: NodeJS.ProcessEnv, services?: ProviderServices) => LeaseProvider | Promise<LeaseProvider>;
