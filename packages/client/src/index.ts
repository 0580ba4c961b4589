/**
 * lease-ops-client: the HTTP API of lease-ops as a typed client, for a control plane that
 * enqueues lease operations and reads leases without running lease-ops itself. No
 * dependencies: it needs only `fetch`.
 *
 * Every failure is a LeaseOpsRequestError with the API's own `{ code, message }` (and the
 * HTTP status, 0 when no answer came); an operation that failed carries the same shape in
 * its `error`.
 */

export type OperationName = 'acquire' | 'resume' | 'release' | 'stop' | 'force-stop' | 'destroy';

/** A lease: by the id its acquire was enqueued under, or by its sandbox's id (one lease, either name). */
export interface LeaseIdentity {
  provider: string;
  companyId: string;
  environmentId: string;
  leaseId: string;
}

/** The one shape of an error: the API's bodies, an operation's failure, and this client's throws. */
export interface ErrorShape {
  code: string;
  message: string;
}

export type OperationState = 'queued' | 'ready' | 'running' | 'backing-off' | 'paused' | 'completed' | 'failed';

export interface OperationView {
  jobId: string;
  laneId: string;
  op: OperationName | string;
  lease: LeaseIdentity | null;
  state: OperationState;
  /** Attempts that ended (failed and were retried, or the final one). */
  attempts: number;
  acceptedAt: number | null;
  deadlineAt: number | null;
  startedAt: number | null;
  finishedAt: number | null;
  retryAt: number | null;
  paused?: { by: string; since: number };
  result?: unknown;
  error?: ErrorShape;
}

export interface LeaseView {
  lease: LeaseIdentity;
  laneId: string;
  sandboxId: string | null;
  acquiredAs: string | null;
  executing: OperationView | null;
  backingOff: OperationView | null;
  queued: OperationView[];
  queuedTotal: number;
  observed: {
    providerLeaseId: string;
    kind: string;
    providerState: string;
    since: number;
    observedAt: number;
    forceStops: number;
    forceJob: string | null;
  } | null;
  lastFailure: { jobId: string; at: number; code: string; message: string } | null;
  paused: { by: string; since: number } | null;
  stuck: { since: number; budgetMs: number } | null;
}

export type HistoryEventKind =
  | 'accepted'
  | 'absorbed'
  | 'started'
  | 'observed'
  | 'backing-off'
  | 'completed'
  | 'failed'
  | 'stuck'
  | 'removed'
  | 'cancelled'
  | 'rerun'
  | 'paused'
  | 'unpaused'
  | 'named'
  | 'acknowledged';

export interface HistoryEvent {
  at: number;
  kind: HistoryEventKind;
  jobId: string | null;
  op?: string;
  ahead?: number;
  attempt?: number;
  until?: number;
  since?: number;
  by?: string;
  code?: string;
  message?: string;
  state?: string;
  providerState?: string;
  sandbox?: string;
}

export interface LeaseTimeline extends LeaseView {
  now: number;
  events: HistoryEvent[];
  historyFull: boolean;
  operations: OperationView[];
}

export type AttentionReason = 'stuck_stopping' | 'operation_failed' | 'paused' | 'blocked';

/** One lease that needs someone, with every reason it has (`reason` is the first). */
export interface AttentionItem {
  laneId: string;
  lease: LeaseIdentity | null;
  reason: AttentionReason;
  reasons: AttentionReason[];
  since: number;
  detail: string;
}

export interface Enqueued {
  jobId: string;
  laneId: string;
  deduplicated?: 'coalesced' | 'idempotency-key' | 'absorbed-stop';
  location: string;
}

/** How an operation ended, as `waitForResult` answers: a failure carries `{ code, message }`. */
export interface OperationResult {
  jobId: string;
  state: 'completed' | 'failed';
  result?: unknown;
  error?: ErrorShape;
}

export interface EnqueueOptions {
  /** The same key returns the same operation for 24 h. */
  idempotencyKey?: string;
  /** ms after acceptance by which the operation must have succeeded. */
  deadlineMs?: number;
}

export interface ExecRequest {
  providerLeaseId: string;
  command: string;
  args?: string[];
  cwd?: string;
  env?: Record<string, string>;
  stdin?: string;
  timeoutMs?: number;
  kind?: string;
  ttlMs?: number;
}

export interface ExecResult {
  exitCode: number | null;
  signal: string | null;
  timedOut: boolean;
  cancelled: boolean;
  stdout: string;
  stderr: string;
}

export interface Activity {
  token: string;
  laneId: string;
  expiresAt: number;
}

export type CancelResult = { jobId: string; laneId: string; cancelled: true; whileExecuting: boolean };
export type RerunResult = { jobId: string; laneId: string; deadlineAt: number; location: string; overLimit?: string };
export type PauseResult = { laneId: string; paused: boolean; changed: boolean; since: number | null; overLimit?: 'company_pauses_full' };
export type AcknowledgeResult = { acknowledged: { op: string; jobId: string; at: number }[] };

/** A request lease-ops refused or could not answer: its `{ code, message }`, and the HTTP status (0: no answer). */
export class LeaseOpsRequestError extends Error implements ErrorShape {
  override name = 'LeaseOpsRequestError';
  constructor(
    readonly code: string,
    message: string,
    readonly status: number,
    /** From Retry-After, when the API sent one (a full queue, Redis away). */
    readonly retryAfterMs: number | null = null,
    /** The body's other fields (the job id an idempotency key already names, ...). */
    readonly details: Record<string, unknown> = {},
  ) {
    super(message);
  }
}

export interface LeaseOpsHttpClientOptions {
  /** Where the API is, e.g. http://lease-ops:3000 (without /v1). */
  url: string;
  /** A token of LEASE_OPS_API_TOKENS (sent as a Bearer token). */
  token: string;
  /** Another fetch (a proxy agent's, a test's). */
  fetch?: typeof fetch;
  /** How long one request may take besides the waits it asks for (default 10 s). */
  requestTimeoutMs?: number;
}

/** The longest one wait the API takes (LEASE_OPS_API_MAX_WAIT_MS caps it lower on a server). */
const ONE_WAIT_MS = 20_000;

/** A path segment: percent-encoded, and `.` or `..` (which URLs would resolve away) refused. */
const segment = (part: string) => {
  if (part === '.' || part === '..') throw new LeaseOpsRequestError('invalid_request', `"${part}" cannot be a lease's provider, company, environment or id`, 0);
  return encodeURIComponent(part);
};
const leasePath = (l: LeaseIdentity) => `/v1/leases/${[l.provider, l.companyId, l.environmentId, l.leaseId].map(segment).join('/')}`;
const operationPath = (jobId: string) => `/v1/operations/${encodeURIComponent(jobId)}`;

/** Why a connection failed that a moment may see past (a restart, a container coming back); a redirect or TLS failure is not one. */
const PASSING_CAUSES = new Set(['ECONNREFUSED', 'ECONNRESET', 'EPIPE', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH', 'EAI_AGAIN', 'ENOTFOUND', 'UND_ERR_SOCKET', 'UND_ERR_CLOSED', 'UND_ERR_CONNECT_TIMEOUT']);
/** The API's 503s that pass: closing, Redis away, a walk thread gone (not a deployment fault such as secrets_key_mismatch). */
const PASSING_503 = new Set(['client_closed', 'redis_unavailable', 'walk_unavailable', 'http_503']);
/** A failure that a moment may see past: no answer, too many requests, the API or its Redis away. */
const passes = (err: unknown): err is LeaseOpsRequestError => {
  if (!(err instanceof LeaseOpsRequestError)) return false;
  if (err.status === 0) return err.code === 'request_timeout' || (err.code === 'unreachable' && PASSING_CAUSES.has(String(err.details.cause)));
  return err.status === 503 ? PASSING_503.has(err.code) : [429, 502, 504].includes(err.status);
};
/** The longest pause between two polls of a wait, whatever Retry-After says (timers overflow past 2^31 ms). */
const MAX_PAUSE_MS = 60_000;

export class LeaseOpsHttpClient {
  private readonly base: string;
  private readonly fetch: typeof fetch;
  private readonly timeoutMs: number;

  constructor(private readonly options: LeaseOpsHttpClientOptions) {
    if (!URL.canParse(options.url)) throw new LeaseOpsRequestError('invalid_request', `url "${options.url}" is not a URL`, 0);
    this.base = options.url.replace(/\/+$/, '');
    this.fetch = options.fetch ?? globalThis.fetch;
    this.timeoutMs = options.requestTimeoutMs ?? 10_000;
  }

  /** Accepts an operation into its lease's lane: 202 at once with its job id. */
  async enqueue(op: OperationName, lease: LeaseIdentity, params: Record<string, unknown>, opts: EnqueueOptions = {}): Promise<Enqueued> {
    return this.request<Enqueued>('POST', `${leasePath(lease)}/operations`, { body: { op, params, ...opts } });
  }

  /** An operation now, or after waiting up to `waitMs` for it to end; null when there is no such operation. */
  async getOperation(jobId: string, opts: { waitMs?: number; signal?: AbortSignal } = {}): Promise<OperationView | null> {
    const asked = opts.waitMs ?? 0;
    if (!Number.isFinite(asked)) throw new LeaseOpsRequestError('invalid_request', `waitMs must be a number of ms, not ${String(asked)}`, 0);
    return this.readOperation(jobId, Math.floor(Math.max(0, Math.min(asked, ONE_WAIT_MS))), opts.signal);
  }

  private async readOperation(jobId: string, wait: number, signal?: AbortSignal, timeoutMs?: number): Promise<OperationView | null> {
    try {
      return await this.request<OperationView>('GET', `${operationPath(jobId)}${wait ? `?waitMs=${wait}` : ''}`, { waitMs: wait, ...(signal ? { signal } : {}), ...(timeoutMs === undefined ? {} : { timeoutMs }) });
    } catch (err) {
      if (err instanceof LeaseOpsRequestError && err.code === 'operation_not_found') return null;
      throw err;
    }
  }

  /**
   * Waits for an operation to end (long polls of at most 20 s each). Throws `operation_not_found`
   * when there is no such operation, `wait_timeout` when it has not ended in `timeoutMs`, and
   * `aborted` when `signal` aborts. What passes (the API restarting or briefly without Redis, a
   * full wait budget: a refused or cut connection, 429, 502, 503 `client_closed`,
   * `redis_unavailable` or `walk_unavailable`, 504) is asked through again, after its
   * Retry-After or a backoff from 100 ms to 2 s, whichever is longer, until `timeoutMs`; if it
   * has not passed by then, that failure is thrown. A poll answered at once (a server whose
   * waits are capped at 0) backs off as well. No request runs more than a second past `timeoutMs`.
   */
  async waitForResult(jobId: string, timeoutMs = 60_000, opts: { signal?: AbortSignal } = {}): Promise<OperationResult> {
    if (!Number.isFinite(timeoutMs) || timeoutMs < 0) throw new LeaseOpsRequestError('invalid_request', `timeoutMs must be a number of ms (0 or more), not ${String(timeoutMs)}`, 0);
    const until = Date.now() + timeoutMs;
    const { signal } = opts;
    let setbacks = 0;
    const pause = async (atLeastMs: number) => {
      const ms = Math.min(until - Date.now(), MAX_PAUSE_MS, Math.max(atLeastMs, Math.min(2_000, 100 * 2 ** setbacks++)));
      await new Promise<void>((resolve) => {
        const done = () => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', done);
          resolve();
        };
        const timer = setTimeout(done, Math.max(0, ms));
        signal?.addEventListener('abort', done, { once: true });
      });
      if (signal?.aborted) throw new LeaseOpsRequestError('aborted', `the wait for operation ${jobId} was given up by its caller`, 0);
    };
    for (;;) {
      const left = until - Date.now();
      const wait = Math.floor(Math.max(0, Math.min(left, ONE_WAIT_MS)));
      const askedAt = Date.now();
      let view: OperationView | null;
      try {
        // The request's own time: its wait and a second, never far past the caller's.
        view = await this.readOperation(jobId, wait, signal, Math.min(this.timeoutMs, Math.max(0, left - wait) + 1_000));
      } catch (err) {
        if (!passes(err) || until - Date.now() <= 0) throw err;
        // Reading an operation changes nothing: asking again is safe.
        await pause(err.retryAfterMs ?? 0);
        continue;
      }
      if (!view) throw new LeaseOpsRequestError('operation_not_found', `no operation ${jobId}`, 404);
      if (view.state === 'completed') return { jobId, state: 'completed', result: view.result };
      if (view.state === 'failed') return { jobId, state: 'failed', ...(view.error ? { error: view.error } : {}) };
      if (until - Date.now() <= 0) throw new LeaseOpsRequestError('wait_timeout', `operation ${jobId} still ${view.state} after ${timeoutMs} ms`, 0);
      if (Date.now() - askedAt < Math.min(wait, 100)) await pause(0);
      else setbacks = 0;
    }
  }

  /** A lease's lane now: what executes, waits and backs off, what was last seen of the sandbox, whether it is stuck or paused. */
  async getLease(lease: LeaseIdentity): Promise<LeaseView> {
    return this.request<LeaseView>('GET', leasePath(lease));
  }

  /** A lease's lane with its recent history and the operations it names. */
  async getLeaseTimeline(lease: LeaseIdentity): Promise<LeaseTimeline> {
    return this.request<LeaseTimeline>('GET', `${leasePath(lease)}/timeline`);
  }

  /** Leases that need someone (a page of them; `next` is the next page's offset). */
  async attention(opts: { offset?: number; limit?: number } = {}): Promise<{ items: AttentionItem[]; next: number | null }> {
    const query = new URLSearchParams();
    if (opts.offset !== undefined) query.set('offset', String(opts.offset));
    if (opts.limit !== undefined) query.set('limit', String(opts.limit));
    return this.request('GET', `/v1/attention${query.size ? `?${query}` : ''}`);
  }

  async cancelOperation(jobId: string): Promise<CancelResult> {
    return this.request('POST', `${operationPath(jobId)}/cancel`);
  }

  async rerunOperation(jobId: string): Promise<RerunResult> {
    return this.request('POST', `${operationPath(jobId)}/rerun`);
  }

  async pauseLane(lease: LeaseIdentity): Promise<PauseResult> {
    return this.request('POST', `${leasePath(lease)}/pause`);
  }

  async unpauseLane(lease: LeaseIdentity): Promise<PauseResult> {
    return this.request('POST', `${leasePath(lease)}/unpause`);
  }

  /** Takes the lease's failures off the attention list (its history keeps them). */
  async acknowledgeFailures(lease: LeaseIdentity): Promise<AcknowledgeResult> {
    return this.request('POST', `${leasePath(lease)}/acknowledge`);
  }

  /** Runs a command in the lease's sandbox and answers how it ended (the API's exec). */
  async exec(lease: LeaseIdentity, request: ExecRequest, opts: { signal?: AbortSignal } = {}): Promise<ExecResult> {
    return this.request('POST', `${leasePath(lease)}/exec`, { body: request, waitMs: (request.timeoutMs ?? 60_000) + 5_000, ...(opts.signal ? { signal: opts.signal } : {}) });
  }

  /** Work in the sandbox that the lease's stop, release or destroy waits for: heartbeat it, end it. */
  async beginActivity(lease: LeaseIdentity, kind: string, ttlMs: number): Promise<Activity> {
    return this.request('POST', `${leasePath(lease)}/activities`, { body: { kind, ttlMs } });
  }

  async heartbeatActivity(token: string, ttlMs: number): Promise<{ expiresAt: number; cancel: boolean }> {
    return this.request('POST', `/v1/activities/${encodeURIComponent(token)}/heartbeat`, { body: { ttlMs } });
  }

  async endActivity(token: string): Promise<void> {
    await this.request('DELETE', `/v1/activities/${encodeURIComponent(token)}`, { noContent: true });
  }

  private async request<T>(method: string, path: string, opts: { body?: unknown; waitMs?: number; signal?: AbortSignal; noContent?: boolean; timeoutMs?: number } = {}): Promise<T> {
    const timeout = AbortSignal.timeout((opts.timeoutMs ?? this.timeoutMs) + (opts.waitMs ?? 0));
    const signal = opts.signal ? AbortSignal.any([timeout, opts.signal]) : timeout;
    // Whatever goes wrong on the way (no answer, a cut connection, a body that stalls): one error shape.
    const failed = (err: unknown): LeaseOpsRequestError => {
      if (opts.signal?.aborted) return new LeaseOpsRequestError('aborted', `${method} ${path} was given up by its caller`, 0);
      if (timeout.aborted) return new LeaseOpsRequestError('request_timeout', `lease-ops did not answer ${method} ${path} in time`, 0);
      const cause = (err as { cause?: { code?: string } }).cause?.code;
      const reason = cause ?? (err as Error).message ?? (err as Error).name;
      return new LeaseOpsRequestError('unreachable', `lease-ops could not be reached at ${this.base}, or the connection broke (${reason})`, 0, null, cause ? { cause } : {});
    };
    let res: Response;
    let text: string;
    try {
      res = await this.fetch(`${this.base}${path}`, {
        method,
        headers: { authorization: `Bearer ${this.options.token}`, ...(opts.body === undefined ? {} : { 'content-type': 'application/json' }) },
        ...(opts.body === undefined ? {} : { body: JSON.stringify(opts.body) }),
        signal,
        redirect: 'error',
      });
      text = await res.text();
    } catch (err) {
      throw failed(err);
    }
    if (res.ok && opts.noContent) return undefined as T;
    let body: unknown = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch {
      // not JSON: a proxy's page, say
    }
    if (res.ok) {
      // Every answer this client reads is one JSON object (a list comes inside one).
      if (body === null || typeof body !== 'object' || Array.isArray(body)) {
        throw new LeaseOpsRequestError('invalid_answer', `lease-ops answered ${method} ${path} with HTTP ${res.status} and no JSON object`, res.status);
      }
      return body as T;
    }
    const error = (body as { error?: { code?: unknown; message?: unknown } } | null)?.error;
    const retryAfter = Number(res.headers.get('retry-after'));
    const { code, message, ...details } = (error ?? {}) as Record<string, unknown>;
    throw new LeaseOpsRequestError(
      typeof code === 'string' ? code : `http_${res.status}`,
      typeof message === 'string' ? message : `lease-ops answered ${method} ${path} with HTTP ${res.status}`,
      res.status,
      // Seconds (an HTTP date, or a value below 0, says nothing here).
      Number.isFinite(retryAfter) && retryAfter >= 0 && res.headers.get('retry-after')?.trim() ? retryAfter * 1000 : null,
      details,
    );
  }
}
