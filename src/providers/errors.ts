/**
 * Typed provider errors. Retry decisions are made on `kind`, never on message text, so a
 * provider states once what an error means and callers never pattern-match strings.
 */
export type ProviderErrorKind = 'settling' | 'transient' | 'permanent';

// A provider module may import these classes from another copy of lease-ops than the
// worker's (its own install, or the compiled package beside the sources): errors carry a
// brand that every copy recognises, so `instanceof` holds across copies.
const BRAND = Symbol.for('lease-ops.provider-error');

export abstract class ProviderError extends Error {
  /** The kind a subclass stands for (undefined: any provider error). */
  static readonly KIND: ProviderErrorKind | undefined = undefined;

  static override [Symbol.hasInstance](value: unknown): boolean {
    if (typeof value !== 'object' || value === null || (value as Record<symbol, unknown>)[BRAND] !== true) return false;
    return this.KIND === undefined || (value as { kind?: unknown }).kind === this.KIND;
  }

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
    Object.defineProperty(this, BRAND, { value: true });
  }
}

/** The provider is still finishing a transition or a cleanup: the same call will work later. */
export class SettlingError extends ProviderError {
  static override readonly KIND = 'settling' as const;
  readonly kind = 'settling' as const;
  override name = 'SettlingError';
}

/** Rate limits, 5xx, resets, timeouts: the call may work if tried again. */
export class TransientError extends ProviderError {
  static override readonly KIND = 'transient' as const;
  readonly kind = 'transient' as const;
  override name = 'TransientError';
}

/** Trying again cannot help: wrong environment, identity mismatch, bad config or payload. */
export class PermanentError extends ProviderError {
  static override readonly KIND = 'permanent' as const;
  readonly kind = 'permanent' as const;
  override name = 'PermanentError';
}

export function isProviderError(err: unknown): err is ProviderError {
  return err instanceof ProviderError;
}
