import { z } from 'zod';

/** Base of the errors lease-ops' client and API report; `code` is stable, branch on it or on the class. */
export class LeaseOpsError extends Error {
  override name = 'LeaseOpsError';
  constructor(
    readonly code: string,
    message: string,
    options?: ErrorOptions,
  ) {
    super(message, options);
  }
}

/**
 * Redis did not answer within LEASE_OPS_REDIS_TIMEOUT_MS: nothing was written, or what was
 * sent may still run (an idempotency key makes a retry safe). `url` is shown masked.
 */
export class RedisUnavailableError extends LeaseOpsError {
  override name = 'RedisUnavailableError';
  constructor(
    readonly url: string,
    readonly timeoutMs: number,
    options?: ErrorOptions,
    /** Redis answered but refused the credentials in REDIS_URL. */
    readonly credentialsRefused = false,
  ) {
    const code = (options?.cause as { code?: unknown } | undefined)?.code;
    super(
      'redis_unavailable',
      credentialsRefused
        ? `the Redis at ${url} refuses the credentials in REDIS_URL: fix them`
        : `no Redis answered at ${url} within ${timeoutMs} ms${typeof code === 'string' ? ` (${code})` : ''}: start Redis there, or set REDIS_URL to one that runs`,
      options,
    );
  }
}

/** The request does not validate; `issues` are zod's, with the path of each bad field. */
export class InvalidRequestError extends LeaseOpsError {
  override name = 'InvalidRequestError';
  constructor(
    message: string,
    readonly issues: z.core.$ZodIssue[],
  ) {
    super('invalid_request', message);
  }

  /** From a failed zod parse; `what` says what was parsed (e.g. "body"), if anything. */
  static fromZod(error: z.ZodError, what?: string): InvalidRequestError {
    const detail = z.prettifyError(error);
    return new InvalidRequestError(what ? `invalid ${what}: ${detail}` : detail, error.issues);
  }
}

export class OperationNotFoundError extends LeaseOpsError {
  override name = 'OperationNotFoundError';
  constructor(readonly jobId: string) {
    super('operation_not_found', `no operation ${jobId}`);
  }
}

/** Thrown by waitForResult when the operation did not finish within the timeout. */
export class WaitTimeoutError extends LeaseOpsError {
  override name = 'WaitTimeoutError';
  constructor(message: string) {
    super('wait_timeout', message);
  }
}

/** The client was closed (or its waits ended) before this call, or while it ran: nothing more is read on it. */
export class ClientClosedError extends LeaseOpsError {
  override name = 'ClientClosedError';
  constructor(readonly jobId?: string) {
    super('client_closed', jobId ? `the client is closing (its waits were ended) while this call waited for operation ${jobId} to end` : 'the client was closed: nothing more is read or written on it');
  }
}

/** Where an operation was refused for room: its lease's lane, its environment, its company, or the whole queue. */
export type QueueLimit = 'lease' | 'environment' | 'company' | 'queue';

const QUEUE_LIMITS: Record<QueueLimit, { code: string; holder: string; setting: string }> = {
  lease: { code: 'lease_queue_full', holder: 'the lease already has', setting: 'LEASE_OPS_MAX_QUEUED_PER_LEASE' },
  environment: { code: 'environment_queue_full', holder: 'the environment already has', setting: 'LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT' },
  company: { code: 'company_queue_full', holder: 'the company already has', setting: 'LEASE_OPS_MAX_QUEUED_PER_COMPANY' },
  queue: { code: 'queue_full', holder: '', setting: 'LEASE_OPS_MAX_QUEUED' },
};

/** The lease's lane, its environment, its company or the whole queue holds as many operations as it may; try again later. */
/**
 * A company's live operations hold all the Redis bytes it may (LEASE_OPS_MAX_BYTES_PER_COMPANY,
 * or its maxBytes): 429 `company_bytes_full`. Its ended operations' records had gone first.
 */
export class CompanyBytesFullError extends LeaseOpsError {
  override name = 'CompanyBytesFullError';
  readonly retryAfterMs = 5_000;
  constructor(
    readonly held: number,
    readonly budget: number,
  ) {
    super('company_bytes_full', `the company's operations on their way hold ${held} of its ${budget} bytes (LEASE_OPS_MAX_BYTES_PER_COMPANY): retry once some have ended, or send smaller metadata`);
  }
}

/** A company holds as many paused lanes as it may (LEASE_OPS_MAX_PAUSED_PER_COMPANY): 429 `company_pauses_full`. */
export class PausesFullError extends LeaseOpsError {
  override name = 'PausesFullError';
  constructor(readonly count: number) {
    super('company_pauses_full', `the company already holds ${count} paused lanes (LEASE_OPS_MAX_PAUSED_PER_COMPANY): unpause some first`);
  }
}

export class QueueFullError extends LeaseOpsError {
  override name = 'QueueFullError';
  constructor(
    readonly limit: QueueLimit,
    readonly count: number,
    readonly retryAfterMs: number,
  ) {
    const { code, holder, setting } = QUEUE_LIMITS[limit];
    // The queue's count is every company's: a tenant is told the queue is full, not its size.
    super(code, limit === 'queue' ? `the queue is full and the company holds at least its fair share of it (${setting})` : `${holder} ${count} operations queued (${setting})`);
  }
}

/**
 * The idempotency key was used before with a different request (lease, operation or
 * parameters), as payment APIs refuse it: the earlier request's job is not this one's.
 */
export class IdempotencyKeyReusedError extends LeaseOpsError {
  override name = 'IdempotencyKeyReusedError';
  constructor(readonly earlierJobId: string) {
    super('idempotency_key_reused', 'this idempotency key was used with a different request (lease, operation or parameters); use a new key for a new request');
  }
}

/**
 * An acquire named a lease that has a sandbox already (its record shows one that is not
 * gone): one lease is one sandbox. Destroy or release it first, or acquire under another id.
 */
export class LeaseHasSandboxError extends LeaseOpsError {
  override name = 'LeaseHasSandboxError';
  constructor(readonly sandboxId: string) {
    super('lease_has_sandbox', `this lease has sandbox ${sandboxId} already: destroy it first, or acquire under another id`);
  }
}

/**
 * An activity was refused: a stop, release or destroy of the lease is queued or runs (it
 * waits for the lease's open activities, so a new one would outlive it). Try again once it ended.
 */
export class LeaseClosingError extends LeaseOpsError {
  override name = 'LeaseClosingError';
  constructor(
    readonly jobId: string,
    readonly op: string,
    readonly retryAfterMs = 1_000,
  ) {
    super('lease_closing', `a ${op} of this lease is queued or running (${jobId}): no activity begins until it ended`);
  }
}

/** No open activity has this token (it ended, its TTL passed, or it never was). */
export class ActivityNotFoundError extends LeaseOpsError {
  override name = 'ActivityNotFoundError';
  constructor() {
    super('activity_not_found', 'no open activity has this token (it ended, or its holder stopped heartbeating past its TTL)');
  }
}

/**
 * A command could not run in a sandbox, or no answer came: `secrets_key_missing`,
 * `exec_unsupported`, `sandbox_not_running`, `sandbox_gone`, `exec_timeout`, `exec_failed`,
 * or the provider's own code (`unknown_provider`, `lease_environment_mismatch`, ...).
 */
export class ExecError extends LeaseOpsError {
  override name = 'ExecError';
}
