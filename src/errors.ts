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

/** The lease's lane, or the whole queue, holds as many operations as it may; try again later. */
export class QueueFullError extends LeaseOpsError {
  override name = 'QueueFullError';
  constructor(
    readonly limit: 'lease' | 'queue',
    readonly count: number,
    readonly retryAfterMs: number,
  ) {
    super(
      limit === 'lease' ? 'lease_queue_full' : 'queue_full',
      limit === 'lease'
        ? `the lease already has ${count} operations queued (LEASE_OPS_MAX_QUEUED_PER_LEASE)`
        : `the queue already holds ${count} operations (LEASE_OPS_MAX_QUEUED)`,
    );
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
