import { PermanentError, ProviderError, SettlingError, TransientError } from './errors.ts';

const NETWORK_CODES = new Set(['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'EAI_AGAIN', 'ENOTFOUND', 'ECONNABORTED', 'UND_ERR_SOCKET', 'UND_ERR_CONNECT_TIMEOUT', 'UND_ERR_HEADERS_TIMEOUT']);

/** Failures before a request left: nothing of it can be running at the cloud. */
const NEVER_SENT_CODES = new Set(['ECONNREFUSED', 'EAI_AGAIN', 'ENOTFOUND', 'UND_ERR_CONNECT_TIMEOUT']);

/** Retry-After as ms: seconds or an HTTP date. */
export function retryAfterMs(value: string | null | undefined, now = Date.now()): number | undefined {
  if (!value) return undefined;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const at = Date.parse(value);
  return Number.isFinite(at) ? Math.max(0, at - now) : undefined;
}

/**
 * The error taxonomy for an HTTP answer that no operation handled itself: 409 is a state
 * change in progress (settling); 429 and 5xx are transient (Retry-After honoured); 401 means
 * missing or wrong credentials, 403 a refusal for this account (a quota, a permission); any
 * other 4xx is a bad request. All of those are permanent.
 */
export function errorForStatus(provider: string, status: number, message: string, retryAfter?: string | null): ProviderError {
  const text = `${provider}: ${message} (HTTP ${status})`;
  if (status === 409) return new SettlingError('state_change_in_progress', text);
  if (status === 429) return new TransientError('rate_limited', text, { retryAfterMs: retryAfterMs(retryAfter) });
  if (status >= 500) return new TransientError('provider_unavailable', text, { retryAfterMs: retryAfterMs(retryAfter) });
  if (status === 401) return new PermanentError('unauthorized', text);
  if (status === 403) return new PermanentError('forbidden', text);
  if (status === 404) return new PermanentError('not_found', text);
  return new PermanentError('bad_request', text);
}

/**
 * Connection refused, reset, timed out: the request may work if tried again. The HTTP
 * client's own error is not kept as the cause: it carries the request, headers included,
 * and a logged cause would print the credential.
 */
export function networkError(provider: string, err: unknown): ProviderError | null {
  const code = (err as { code?: unknown; cause?: { code?: unknown } })?.code ?? (err as { cause?: { code?: unknown } })?.cause?.code;
  const name = (err as { name?: unknown })?.name;
  if ((typeof code === 'string' && NETWORK_CODES.has(code)) || name === 'TimeoutError') {
    const requestMayBeInFlight = !(typeof code === 'string' && NEVER_SENT_CODES.has(code));
    // The client's message names the address it tried: operators read it in the logs.
    const what = typeof code === 'string' ? code : 'timeout';
    return new TransientError('network', `${provider}: the provider could not be reached (${what})`, { requestMayBeInFlight, detail: (err as Error).message });
  }
  return null;
}
