import type { z } from 'zod';

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
