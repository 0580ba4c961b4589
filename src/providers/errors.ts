/**
 * Typed provider errors. Retry decisions are made on `kind`, never on message text, so a
 * provider states once what an error means and callers never pattern-match strings.
 */
export type ProviderErrorKind = 'settling' | 'transient' | 'permanent';

export abstract class ProviderError extends Error {
  abstract readonly kind: ProviderErrorKind;
  /** A stable, machine-readable code, e.g. `state_change_in_progress`. */
  readonly code: string;
  /** When the provider said how long to wait (Retry-After), in ms. */
  readonly retryAfterMs: number | undefined;
  /**
   * The request may have reached the cloud and still be running there (it timed out, or its
   * connection broke after it was sent): the lane waits a grace before its next call.
   */
  readonly requestMayBeInFlight: boolean;
  /**
   * What only operators should read (an address, the client library's own message): in
   * the logs, never in the message callers see.
   */
  readonly detail: string | undefined;

  constructor(code: string, message: string, opts: { retryAfterMs?: number; cause?: unknown; requestMayBeInFlight?: boolean; detail?: string } = {}) {
    super(message, opts.cause === undefined ? undefined : { cause: opts.cause });
    this.code = code;
    this.retryAfterMs = opts.retryAfterMs;
    this.requestMayBeInFlight = opts.requestMayBeInFlight ?? false;
    this.detail = opts.detail;
  }
}

/** The provider is still finishing a transition or a cleanup: the same call will work later. */
export class SettlingError extends ProviderError {
  readonly kind = 'settling' as const;
  override name = 'SettlingError';
}

/** Rate limits, 5xx, resets, timeouts: the call may work if tried again. */
export class TransientError extends ProviderError {
  readonly kind = 'transient' as const;
  override name = 'TransientError';
}

/** Trying again cannot help: wrong environment, identity mismatch, bad config or payload. */
export class PermanentError extends ProviderError {
  readonly kind = 'permanent' as const;
  override name = 'PermanentError';
}

export function isProviderError(err: unknown): err is ProviderError {
  return err instanceof ProviderError;
}
