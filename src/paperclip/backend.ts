import type { LeaseOpsClient } from '../client.ts';
import { IdempotencyKeyReusedError, LeaseOpsError } from '../errors.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { OperationName } from '../operations.ts';
import type { OperationView } from '../queues/inspect.ts';
import type { AnnouncedProvider } from '../queues/operations-queue.ts';
import type { ProviderProbe } from '../queues/provider-probes.ts';
import type { ExecRequestInput } from '../queues/exec-jobs.ts';
import type { ExecResult } from '../providers/types.ts';
import { instanceCapabilities } from '../providers/instances/resolver.ts';

/**
 * A hook's failure, with lease-ops' stable code (`lease_environment_mismatch`,
 * `deadline_exceeded`, `unauthorized`, `unreachable`, `hook_timeout`, ...) and, when one was
 * accepted, the operation's job id.
 */
export class LeaseOpsHookError extends Error {
  override name = 'LeaseOpsHookError';
  constructor(
    readonly code: string,
    /** What happened, without the `lease-ops: <code>: ` the message starts with. */
    readonly detail: string,
    readonly jobId?: string,
    /** The operation that failed was an earlier request's, which this hook's key joined. */
    readonly joined = false,
  ) {
    super(`lease-ops: ${code}: ${detail}`);
  }
}

/** An enqueue's answer: the job, its view if it ended, and whether the key named an earlier request's job. */
export interface Started {
  jobId: string;
  operation: OperationView | null;
  joined: boolean;
}

export interface EnqueueRequest {
  op: OperationName;
  lease: LeaseIdentity;
  params: Record<string, unknown>;
  idempotencyKey: string;
}

/** How the plugin reaches lease-ops: its HTTP API (a remote lease-ops) or its typed client (in-process). */
export interface LeaseOpsBackend {
  /**
   * Accepts the operation and waits up to `waitMs` for it to end: its view once it ended,
   * else null (then `wait`). A key that names an earlier request answers with that one's job.
   */
  enqueue(request: EnqueueRequest, waitMs: number, deadline: number): Promise<Started>;
  /** The operation after waiting up to `waitMs` for it to end (still on its way, maybe). */
  wait(jobId: string, waitMs: number, deadline: number): Promise<OperationView>;
  /**
   * Cancels an operation (an acquire executing stops at its next step): `cancelled`, `ended`
   * (it ended first: read it), or `unknown` (lease-ops could not be asked).
   */
  cancel(jobId: string, deadline: number): Promise<'cancelled' | 'ended' | 'unknown'>;
  /** A provider and what it can do, with a probe of its credentials if asked; null if none is served by that name. */
  /**
   * The provider a config names, probed if asked. `scope`: the company and environment asking
   * (a probe hook), whose own instance of the name comes first, as for its operations (over
   * HTTP the token's company decides).
   */
  provider(name: string, probe: boolean, deadline: number, scope?: { companyId: string; environmentId: string }): Promise<(AnnouncedProvider & { probe?: ProviderProbe }) | null>;
  /**
   * Runs a command in the lease's sandbox, bracketed by an activity: how it ended. Asked once
   * (never again after no answer: it may have run); lease_closing while a stop, release or
   * destroy of the lease is queued or runs.
   */
  exec(lease: LeaseIdentity, request: ExecRequestInput, deadline: number): Promise<ExecResult>;
}

/** The typed client of an in-process lease-ops: no token, the host is trusted with every company. */
export function clientBackend(client: LeaseOpsClient): LeaseOpsBackend {
  const hookError = (err: unknown): never => {
    if (err instanceof LeaseOpsError) throw new LeaseOpsHookError(err.code, err.message);
    throw err;
  };
  return {
    async enqueue(request, waitMs) {
      try {
        const { jobId, operation, deduplicated } = await client.enqueueAndWait(request.op, request.lease, request.params, { idempotencyKey: request.idempotencyKey, waitMs });
        return { jobId, operation: ended(operation) ? operation : null, joined: deduplicated === 'idempotency-key' };
      } catch (err) {
        // The same key came with another request (a retry whose expiry was recomputed): join it.
        if (err instanceof IdempotencyKeyReusedError && err.earlierJobId) return { jobId: err.earlierJobId, operation: null, joined: true };
        return hookError(err);
      }
    },
    async wait(jobId, waitMs) {
      const view = await client.getOperation(jobId, { waitMs }).catch(hookError);
      if (!view) throw new LeaseOpsHookError('operation_not_found', `operation ${jobId} is gone`, jobId);
      return view;
    },
    async cancel(jobId) {
      try {
        return (await client.cancelOperation(jobId, 'paperclip (the host gave up)')) ? 'cancelled' : 'unknown';
      } catch (err) {
        return err instanceof LeaseOpsError && err.code === 'operation_ended' ? 'ended' : 'unknown';
      }
    },
    exec(lease, request) {
      return client.exec(lease, request).catch(hookError);
    },
    async provider(name, probe, _deadline, scope) {
      // The company's own instance first (helper-64: in-process, its probe asked the operator's provider).
      const own = scope ? await client.instances.get(scope.companyId, name).catch(hookError) : null;
      if (scope && own && (own.environmentIds === null || own.environmentIds.includes(scope.environmentId))) {
        const view: AnnouncedProvider = { name, lastSeenAt: Date.parse(own.updatedAt), capabilities: instanceCapabilities(own.type) };
        return probe ? { ...view, probe: await client.instances.probe(scope.companyId, name, scope.environmentId, own.rev).catch(hookError) } : view;
      }
      const found = (await client.providers().catch(hookError)).find((p) => p.name === name);
      if (!found) return null;
      return probe ? { ...found, probe: await client.probeProvider(name).catch(hookError) } : found;
    },
  };
}

/** The API's 503s that pass (closing, Redis away, a walk thread gone), or a proxy's without a code. */
const PASSING_503 = new Set(['client_closed', 'redis_unavailable', 'walk_unavailable', undefined]);
/**
 * The API's 429s that pass: a company's rate, requests or waits at their budget (or a proxy's 429). A
 * full queue or lane is not waited out: a paused lane never drains (helper-38: a hook spun
 * until its timeout for a refusal given at once), so the hook fails with its code at once.
 */
const PASSING_429 = new Set(['company_rate_limited', 'company_requests_full', 'company_waits_full', 'server_waits_full', 'company_walks_full', undefined]);

/**
 * The HTTP API of a remote lease-ops, with a bearer token. A lease-ops that does not answer
 * (down, restarting, its Redis away: 503) or is busy (429: the company's waits or rate at its
 * budget) is asked again, after its Retry-After or a backoff from 100 ms to 2 s (the longer),
 * until the hook's deadline; then the hook fails with `hook_timeout` (it answered; an enqueue
 * still refused fails with the refusal's code) or `unreachable`. An enqueue is retried under
 * its idempotency key, so nothing is accepted twice. A 503 or 429 that does not pass
 * (`secrets_key_mismatch`, a full lane) fails the hook at once with its code.
 */
export function httpBackend(base: string, token: string | undefined, fetchImpl: typeof fetch = fetch): LeaseOpsBackend {
  const origin = base.replace(/\/+$/, '');
  const headers = { ...(token ? { authorization: `Bearer ${token}` } : {}), 'content-type': 'application/json' };

  async function request(method: string, path: string, deadline: number, opts: { body?: unknown; extraHeaders?: Record<string, string>; answerMs?: number; refusalAtDeadline?: boolean } = {}) {
    let lastProblem = 'no answer';
    // The last try was cut by the deadline (a TimeoutError), after the problem named in lastProblem.
    let lastTryCut = false;
    // A lease-ops that answers, but not by the deadline, is slow, not unreachable.
    let answered = false;
    let retryAfterMs = 0;
    // The last 429 (a refusal: nothing was accepted), for a request that answers with it at the deadline.
    let lastRefusal: { status: number; body: Record<string, unknown> } | null = null;
    for (let tries = 0; ; tries++) {
      const left = deadline - Date.now();
      if (left <= 0) {
        if (opts.refusalAtDeadline && lastRefusal) return lastRefusal;
        if (answered || lastProblem === 'TimeoutError' || lastTryCut) throw new LeaseOpsHookError('hook_timeout', `lease-ops at ${origin} did not answer ${method} ${path.split('?')[0]} before the hook's deadline (last: ${lastProblem})`);
        throw new LeaseOpsHookError('unreachable', `lease-ops at ${origin} did not answer before the hook's deadline (${lastProblem})`);
      }
      // A reply may take as long as the wait asked for, plus a margin; never past the deadline.
      const answerWithinMs = Math.max(1, Math.min(left, (opts.answerMs ?? 0) + 10_000));
      try {
        const res = await fetchImpl(`${origin}${path}`, {
          method,
          headers: { ...headers, ...opts.extraHeaders },
          ...(opts.body === undefined ? {} : { body: JSON.stringify(opts.body) }),
          signal: AbortSignal.timeout(answerWithinMs),
        });
        const text = await res.text();
        let body: Record<string, unknown> = {};
        try {
          body = text ? (JSON.parse(text) as Record<string, unknown>) : {};
        } catch {
          // not JSON (a proxy's page): the status says what there is to say
        }
        const code = (body.error as { code?: unknown } | undefined)?.code;
        // Down or busy for a moment (its Redis away, a restart behind a proxy, a budget full): asked again.
        const known = typeof code === 'string' ? code : undefined;
        if (res.status === 502 || res.status === 504 || (res.status === 429 && PASSING_429.has(known)) || (res.status === 503 && PASSING_503.has(known))) {
          // Only a refusal in the last answer says nothing was accepted (a 502, 503 or 504 may hide one that was).
          lastRefusal = res.status === 429 ? { status: res.status, body } : null;
          lastProblem = `HTTP ${res.status}${typeof code === 'string' ? ` ${code}` : ''}`;
          answered = res.status === 503 || res.status === 429;
          const seconds = Number(res.headers.get('retry-after'));
          retryAfterMs = res.headers.get('retry-after')?.trim() && Number.isFinite(seconds) && seconds >= 0 ? seconds * 1_000 : 0;
        } else {
          return { status: res.status, body };
        }
      } catch (err) {
        const problem = (err as { cause?: { code?: string } }).cause?.code ?? (err as Error).name ?? 'error';
        // A try the hook's deadline cut says nothing new: the problem before it (an answer, a
        // 502, a refused connection) stays the one named. It fails hook_timeout, as a
        // TimeoutError always did.
        lastTryCut = problem === 'TimeoutError' && answerWithinMs === left && tries > 0;
        lastProblem = lastTryCut ? `${lastProblem}; the next try was cut at the deadline` : problem;
        retryAfterMs = 0;
        // No answer: this try may have been taken (an enqueue accepted), so no refusal stands for it (helper-39).
        lastRefusal = null;
      }
      await new Promise((r) => setTimeout(r, Math.min(Math.max(retryAfterMs, Math.min(2_000, 100 * 2 ** tries)), Math.max(1, deadline - Date.now()), 60_000)));
    }
  }
  const failure = (res: { status: number; body: Record<string, unknown> }): LeaseOpsHookError => {
    const error = (res.body.error ?? {}) as { code?: unknown; message?: unknown };
    return new LeaseOpsHookError(typeof error.code === 'string' ? error.code : `http_${res.status}`, typeof error.message === 'string' ? error.message : `HTTP ${res.status}`);
  };
  const leasePath = (lease: LeaseIdentity) => `/v1/leases/${[lease.provider, lease.companyId, lease.environmentId, lease.leaseId].map(encodeURIComponent).join('/')}`;

  return {
    async enqueue(req, waitMs, deadline) {
      const res = await request('POST', `${leasePath(req.lease)}/operations`, deadline, {
        body: { op: req.op, params: req.params },
        extraHeaders: { 'idempotency-key': req.idempotencyKey, ...(waitMs >= 1_000 ? { prefer: `wait=${Math.floor(waitMs / 1_000)}` } : {}) },
        answerMs: waitMs,
        // Still refused at the deadline: nothing was accepted, and the hook fails with the
        // refusal's code, not hook_timeout (whose acquire would be looked for, by enqueueing it).
        refusalAtDeadline: true,
      });
      const joined = res.body.deduplicated === 'idempotency-key';
      if (res.status === 200) return { jobId: String(res.body.jobId), operation: res.body as unknown as OperationView, joined };
      if (res.status === 202) return { jobId: String(res.body.jobId), operation: null, joined };
      const error = (res.body.error ?? {}) as { code?: unknown; jobId?: unknown };
      if (res.status === 422 && error.code === 'idempotency_key_reused' && typeof error.jobId === 'string') return { jobId: error.jobId, operation: null, joined: true };
      throw failure(res);
    },
    async wait(jobId, waitMs, deadline) {
      const res = await request('GET', `/v1/operations/${encodeURIComponent(jobId)}?waitMs=${Math.max(0, Math.floor(waitMs))}`, deadline, { answerMs: waitMs });
      if (res.status !== 200) throw failure(res);
      return res.body as unknown as OperationView;
    },
    async cancel(jobId, deadline) {
      const res = await request('POST', `/v1/operations/${encodeURIComponent(jobId)}/cancel`, deadline).catch(() => null);
      if (res?.status === 200) return 'cancelled';
      return res?.status === 409 && (res.body.error as { code?: unknown } | undefined)?.code === 'operation_ended' ? 'ended' : 'unknown';
    },
    async exec(lease, body, deadline) {
      // One request: a command is never sent twice (a 502 or a cut connection may mean it ran).
      let res: Response;
      try {
        res = await fetchImpl(`${origin}${leasePath(lease)}/exec`, { method: 'POST', headers, body: JSON.stringify(body), signal: AbortSignal.timeout(Math.max(1, deadline - Date.now())) });
      } catch (err) {
        const name = (err as Error).name;
        if (name === 'TimeoutError') throw new LeaseOpsHookError('hook_timeout', `lease-ops at ${origin} did not answer the exec before the hook's deadline`);
        throw new LeaseOpsHookError('unreachable', `lease-ops at ${origin} did not answer (${(err as { cause?: { code?: string } }).cause?.code ?? name})`);
      }
      const text = await res.text();
      let parsed: Record<string, unknown> = {};
      try {
        parsed = text ? (JSON.parse(text) as Record<string, unknown>) : {};
      } catch {
        // not JSON (a proxy's page): the status says what there is to say
      }
      if (res.status !== 200) throw failure({ status: res.status, body: parsed });
      return parsed as unknown as ExecResult;
    },
    async provider(name, probe, deadline) {
      const res = await request('GET', `/v1/providers/${encodeURIComponent(name)}${probe ? '?probe=true' : ''}`, deadline, { answerMs: probe ? 15_000 : 0 });
      if (res.status === 404) return null;
      if (res.status !== 200) throw failure(res);
      return res.body as unknown as AnnouncedProvider & { probe?: ProviderProbe };
    },
  };
}

export const ended = (view: OperationView | null | undefined): view is OperationView => view?.state === 'completed' || view?.state === 'failed';
