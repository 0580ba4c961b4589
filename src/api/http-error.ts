import { LeaseOpsError } from '../errors.ts';

/** An API answer other than success: its status and code, and a Retry-After when waiting helps. */
export class HttpError extends LeaseOpsError {
  constructor(
    readonly status: number,
    code: string,
    message: string,
    readonly opts: { retryAfterS?: number } = {},
  ) {
    super(code, message);
  }
}
