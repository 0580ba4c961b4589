import { createHash } from 'node:crypto';
import {
  createClient,
  CreateosSandboxApiError,
  CreateosSandboxAuthError,
  CreateosSandboxConnectionError,
  CreateosSandboxError,
  CreateosSandboxNotFoundError,
  CreateosSandboxPaymentRequiredError,
  CreateosSandboxPermissionError,
  CreateosSandboxRateLimitError,
  CreateosSandboxServerError,
  CreateosSandboxTimeoutError,
  CreateosSandboxValidationError,
  type CreateosSandboxClient,
  type Sandbox,
} from '@nodeops-createos/sandbox';
import { z } from 'zod';
import type { OperationParams } from '../../operations.ts';
import { PermanentError, ProviderError, SettlingError, TransientError } from '../errors.ts';
import { fencedFetch } from '../fenced-fetch.ts';
import { FenceWindowError } from '../fenced-transport.ts';
import { errorForStatus, retryAfterMs } from '../http-errors.ts';
import { localRateLimiters, type RateLimiterFactory } from '../pacing.ts';
import { releaseByDisposition } from '../release.ts';
import { probeFailure, type ExpiredLease, type Lease, type LeaseProvider, type OperationContext, type ReleaseResult, type SandboxState, type TerminationReceipt } from '../types.ts';

/** CreateOS' shape catalog (GET /v1/shapes, as the CreateOS plugin lists it). */
export const CREATEOS_SHAPES = [
  's-1vcpu-256mb', 's-0.25vcpu-512mb', 's-0.5vcpu-1gb', 's-1vcpu-1gb', 's-1vcpu-2gb', 's-2vcpu-2gb',
  's-2vcpu-4gb', 's-4vcpu-4gb', 's-4vcpu-8gb', 's-8vcpu-8gb', 's-8vcpu-16gb',
] as const;

export const CreateosSettingsSchema = z.strictObject({
  name: z.string().min(1).default('createos'),
  /** The API's origin; a trailing `/v1` is accepted and dropped (the SDK adds it). */
  apiUrl: z.url().transform((url) => url.replace(/\/+$/, '').replace(/\/v1$/, '')),
  apiKey: z.string().min(1, 'a CreateOS API key is required'),
  /** A catalog shape; new catalog entries follow the same pattern and are accepted. */
  shape: z
    .string()
    .regex(/^s-[0-9.]+vcpu-[0-9]+(mb|gb)$/, `must be a CreateOS shape such as ${CREATEOS_SHAPES.join(', ')}`)
    .default('s-1vcpu-1gb'),
  rootfs: z.string().min(1).optional(),
  region: z.string().min(1).optional(),
  /** Per-request timeout. Create answers only once the VM runs, so give it room. */
  timeoutMs: z.number().int().positive().default(60_000),
  /**
   * Requests per minute, shared by every worker replica (CreateOS allows about 300 a minute
   * per caller IP). Paced at 240 with a burst of 20, so no minute sees more than 260.
   */
  requestsPerMinute: z.number().min(1).max(1_000_000).default(240),
  burst: z.number().int().positive().max(100_000).default(20),
  /** Idle seconds before CreateOS pauses a sandbox by itself (60..86400; reference auto-stop: 15 min). */
  autoPauseAfterSeconds: z.number().int().min(60).max(86_400).default(900),
});
export type CreateosSettings = z.input<typeof CreateosSettingsSchema>;

// The sandbox view as CreateOS sends it: optional fields left out, statuses that may grow.
// Only what a decision reads is checked.
const ViewSchema = z.object({
  id: z.string().min(1),
  status: z.string().nullish(),
  name: z.string().nullish(),
  shape: z.string().nullish(),
  rootfs: z.string().nullish(),
  region: z.string().nullish(),
});
type View = z.infer<typeof ViewSchema>;

/** CreateOS' statuses (SDK 0.7.1): `error` may recover (resume it), `failed` and `destroyed` are terminal. */
export function createosState(status: string | null | undefined): SandboxState {
  switch (status) {
    case 'running':
      return { kind: 'running' };
    case 'paused':
      return { kind: 'stopped', providerState: 'paused' };
    case 'creating':
    case 'resuming':
      return { kind: 'transitioning', providerState: status, toward: 'running' };
    case 'pausing':
      return { kind: 'transitioning', providerState: status, toward: 'stopped' };
    case 'destroying':
      return { kind: 'transitioning', providerState: status, toward: 'gone' };
    case 'destroyed':
      return { kind: 'gone' };
    case 'error':
      return { kind: 'error', providerState: status, recoverable: true };
    case 'failed':
      return { kind: 'error', providerState: status, recoverable: false };
    default:
      // `forking` (a child being made from this one) and statuses newer than this client.
      return { kind: 'transitioning', providerState: status ?? 'unknown' };
  }
}
const TERMINAL = new Set(['destroyed', 'failed']);

const digest = (text: string, length: number) => createHash('sha256').update(text).digest('hex').slice(0, length);

/** The part of a sandbox name that says whose it is: CreateOS keeps no labels, so the name carries the company and environment. */
export function createosOwnerTag(lease: { companyId: string; environmentId: string }): string {
  return `lo-${digest(JSON.stringify([lease.companyId, lease.environmentId]), 12)}-`;
}

/**
 * The name an acquire gives its sandbox: its owner's tag and a digest of the job, so every
 * attempt of the job looks for the same one; a DNS label (CreateOS uses names as hostnames).
 */
export function createosSandboxName(lease: { companyId: string; environmentId: string }, jobId: string): string {
  return `${createosOwnerTag(lease)}${digest(jobId, 32)}`;
}

/**
 * CreateOS through its official SDK (@nodeops-createos/sandbox), with the SDK's own retries
 * off (the lane retries, within the operation's deadline) and a fetch of lease-ops' own:
 * each request waits for its turn in the pacing shared by every replica, checks the
 * attempt's fence, and is sent over the fenced transport, which drops it at the moment it
 * would leave the process if the fence went stale. CreateOS has pause instead of stop and no
 * force-stop; pause and resume are asynchronous, so a reply that says pausing or resuming
 * raises SettlingError and the lane's retry reads the outcome fresh.
 */
export function createCreateosProvider(input: CreateosSettings, rateLimiters: RateLimiterFactory = localRateLimiters): LeaseProvider {
  const settings = CreateosSettingsSchema.parse(input);
  const name = settings.name;
  // CreateOS counts per caller IP: every instance and replica calling this API from here shares one budget.
  const limiter = rateLimiters(`createos:${new URL(settings.apiUrl).host}`, { requests: { perMinute: settings.requestsPerMinute, burst: settings.burst } });
  const clients = new WeakMap<OperationContext, CreateosSandboxClient>();
  /** What an attempt's next request does once its turn came, before its fence and deadline are checked (see create). */
  const beforeNextSend = new WeakMap<OperationContext, () => Promise<void>>();

  /** Every request of this attempt: paced, fenced, and fenced again at send. */
  const attemptFetch = (ctx: OperationContext): typeof fetch => {
    const send = fencedFetch(() => ctx.fenceIsFresh());
    return async (input, init) => {
      for (let tries = 1; ; tries++) {
        await limiter.take('requests', { signal: ctx.signal, deadlineAt: ctx.deadlineAt });
        // Before the checks below, so that a slow one is checked too: what it notes may be for
        // a request then not sent, never the other way round (helper-48).
        const before = beforeNextSend.get(ctx);
        if (before) {
          beforeNextSend.delete(ctx);
          await before();
        }
        await ctx.fence();
        // No request starts after the operation's deadline (the SDK's timeout keeps it from outliving it).
        if (Date.now() >= ctx.deadlineAt) throw new TransientError('deadline_passed', `${name}: the operation's deadline passed before this request could be sent`);
        try {
          const res = await send(input, init);
          if (res.status === 429) await limiter.holdOff('requests', retryAfterMs(res.headers.get('retry-after')) ?? 1_000);
          return res;
        } catch (err) {
          if (!(err instanceof FenceWindowError) || tries >= 3) throw err;
        }
      }
    };
  };
  const clientFor = (ctx: OperationContext): CreateosSandboxClient => {
    let client = clients.get(ctx);
    if (!client) {
      client = createClient({
        apiKey: settings.apiKey,
        baseUrl: settings.apiUrl,
        fetch: attemptFetch(ctx),
        retry: false,
        timeoutMs: settings.timeoutMs,
        headers: { 'X-Lease-Ops-Attempt': ctx.attemptId },
      });
      clients.set(ctx, client);
    }
    return client;
  };
  const options = (ctx: OperationContext) => ({ signal: ctx.signal, timeoutMs: Math.max(1, Math.min(settings.timeoutMs, ctx.deadlineAt - Date.now())) });

  /** The SDK's typed errors in lease-ops' taxonomy. The SDK's error (it holds the reply) is not kept as a cause. */
  const toProviderError = (err: unknown): Error => {
    if (err instanceof ProviderError) return err;
    const cause = (err as { cause?: unknown } | null)?.cause;
    if (err instanceof CreateosSandboxConnectionError && (cause as { code?: unknown } | null)?.code === 'stale_attempt') return cause as Error;
    if ((err as { code?: unknown } | null)?.code === 'stale_attempt') return err as Error;
    // Refused in lease-ops' own fetch (the deadline, the pacing): that error, not a network one,
    // nor a timeout (the SDK's timer, which runs while the request waits for its turn, may
    // have fired meanwhile: the request was never sent).
    if ((err instanceof CreateosSandboxConnectionError || err instanceof CreateosSandboxTimeoutError) && cause instanceof ProviderError) return cause;
    const message = `${name}: ${(err as Error).message}`;
    if (err instanceof CreateosSandboxRateLimitError || err instanceof CreateosSandboxServerError) {
      const retryAfter = err.response.headers.get('retry-after');
      return err instanceof CreateosSandboxRateLimitError
        ? new TransientError('rate_limited', message, { retryAfterMs: retryAfterMs(retryAfter) })
        : new TransientError('provider_unavailable', message, { retryAfterMs: retryAfterMs(retryAfter) });
    }
    if (err instanceof CreateosSandboxTimeoutError) return new TransientError('timeout', message, { requestMayBeInFlight: true });
    if (cause instanceof FenceWindowError) return new TransientError(cause.code, `${name}: request dropped at send: ${cause.message}`);
    if (err instanceof CreateosSandboxConnectionError) {
      const code = (cause as { code?: unknown } | null)?.code;
      const neverSent = code === 'ECONNREFUSED' || code === 'ENOTFOUND' || code === 'EAI_AGAIN';
      return new TransientError('network', `${name}: ${typeof code === 'string' ? `${code}: ` : ''}${(err as Error).message}`, { requestMayBeInFlight: !neverSent });
    }
    if (err instanceof CreateosSandboxAuthError) return new PermanentError('unauthorized', message);
    if (err instanceof CreateosSandboxPermissionError) return new PermanentError('forbidden', message);
    if (err instanceof CreateosSandboxPaymentRequiredError) return new PermanentError('payment_required', message);
    if (err instanceof CreateosSandboxNotFoundError && !isSandboxNotFound(err)) {
      return new PermanentError('unexpected_not_found', `${message} (a 404 that does not say the sandbox is unknown: check CREATEOS_API_URL)`);
    }
    if (err instanceof CreateosSandboxNotFoundError) return new PermanentError('not_found', message);
    if (err instanceof CreateosSandboxValidationError && err.statusCode === 409) return new SettlingError('state_change_in_progress', message);
    if (err instanceof CreateosSandboxValidationError) return new PermanentError('bad_request', message);
    if (err instanceof CreateosSandboxApiError) return errorForStatus(name, err.statusCode, (err as Error).message);
    // A 2xx whose body is not a JSend success, or not JSON: nothing certain was learnt.
    if (err instanceof CreateosSandboxError) return new TransientError('invalid_provider_reply', message);
    return new TransientError('provider_error', message);
  };
  const sdk = async <T>(run: () => Promise<T>): Promise<T> => {
    try {
      return await run();
    } catch (err) {
      throw toProviderError(err);
    }
  };
  /**
   * CreateOS says a sandbox is unknown (or another account's) with a JSend `fail` 404 whose
   * data is "sandbox not found". Any other 404 (a wrong API URL, a gateway) says nothing about
   * the sandbox, and reading it as "gone" would hand out false receipts.
   */
  const isSandboxNotFound = (err: unknown) =>
    err instanceof CreateosSandboxNotFoundError &&
    (err.envelope as { status?: unknown } | undefined)?.status === 'fail' &&
    /sandbox[^"]* not found/i.test(JSON.stringify((err.envelope as { data?: unknown }).data ?? ''));
  const view = (data: unknown): View => {
    const parsed = ViewSchema.safeParse(data);
    if (!parsed.success) throw new TransientError('invalid_provider_reply', `${name}: unexpected sandbox reply: ${z.prettifyError(parsed.error)}`);
    return parsed.data;
  };

  /**
   * A fresh read; null when the sandbox is unknown to CreateOS (404). A sandbox that is not the
   * lease's company and environment's (its name does not carry their tag: another tenant's, or
   * one lease-ops did not make) is refused with lease_environment_mismatch, and nothing of it is
   * recorded or returned: a stop or destroy of it must not end with a receipt while it runs on.
   */
  const readHandle = async (ctx: OperationContext, id: string): Promise<{ handle: Sandbox; sb: View } | null> => {
    // Refused before any request: a path segment that is no id (a name, a path) names no sandbox of a lease.
    if (!/^[A-Za-z0-9][A-Za-z0-9_-]*$/.test(id) || id.startsWith('lo-')) throw new PermanentError('not_a_sandbox_id', `${name}: ${id} is not a sandbox id: name the sandbox by its id`);
    let handle: Sandbox;
    try {
      handle = await clientFor(ctx).getSandbox(id, options(ctx));
    } catch (err) {
      if (isSandboxNotFound(err)) {
        ctx.observe(id, { kind: 'gone' });
        return null;
      }
      throw toProviderError(err);
    }
    const sb = view(handle.data);
    if (sb.id !== id) throw new PermanentError('not_a_sandbox_id', `${name}: ${id} is not a sandbox id: name the sandbox by its id`);
    if (!belongs(ctx, sb)) throw new PermanentError('lease_environment_mismatch', `${name}: sandbox ${id} is not one lease-ops made for this company and environment`);
    ctx.observe(sb.id, createosState(sb.status));
    return { handle, sb };
  };
  const read = async (ctx: OperationContext, id: string) => (await readHandle(ctx, id))?.sb ?? null;
  /** The live sandbox an earlier attempt of this job created, by its name (CreateOS can only list). */
  const findByName = async (ctx: OperationContext, sandboxName: string): Promise<View | null> =>
    sdk(async () => {
      for await (const handle of clientFor(ctx).iterateSandboxes(options(ctx))) {
        const sb = view(handle.data);
        if (sb.name === sandboxName && !TERMINAL.has(sb.status ?? '')) return sb;
      }
      return null;
    });
  const belongs = (ctx: OperationContext, sb: View) => typeof sb.name === 'string' && sb.name.startsWith(createosOwnerTag(ctx.lease));
  const requireOwn = (ctx: OperationContext, sb: View) => {
    if (!belongs(ctx, sb)) throw new PermanentError('lease_environment_mismatch', `${name}: sandbox ${sb.id} belongs to another environment`);
  };
  const settling = (sb: View, doing: string) =>
    new SettlingError(`sandbox_${sb.status ?? 'unknown'}`, `${name}: sandbox ${sb.id} is ${sb.status ?? 'unknown'}; ${doing} once it settles`);
  // CreateOS keeps no labels, so the lease metadata carries whose sandbox it is. Built from
  // a fresh read: the create reply has no status and no region.
  const lease = (ctx: OperationContext, sb: View, extra: Record<string, unknown> = {}): Lease => ({
    providerLeaseId: sb.id,
    metadata: {
      provider: 'createos',
      companyId: ctx.lease.companyId,
      environmentId: ctx.lease.environmentId,
      name: sb.name ?? null,
      shape: sb.shape ?? null,
      rootfs: sb.rootfs ?? null,
      region: sb.region ?? null,
      ...extra,
    },
    expiresAt: null,
  });

  const pauseConfirmed = async (ctx: OperationContext, id: string): Promise<TerminationReceipt> => {
    const found = await readHandle(ctx, id);
    if (!found) return { providerLeaseId: id, state: 'destroyed' };
    const { handle, sb } = found;
    requireOwn(ctx, sb);
    if (TERMINAL.has(sb.status ?? '')) return { providerLeaseId: id, state: 'destroyed' };
    if (sb.status === 'paused') return { providerLeaseId: id, state: 'stopped' };
    // `error` is not final on CreateOS (it may recover), so it is waited out like a transition.
    if (sb.status === 'running') await sdk(() => handle.pause(options(ctx)));
    else throw settling(sb, 'pausing');
    const after = await read(ctx, id);
    if (!after || TERMINAL.has(after.status ?? '')) return { providerLeaseId: id, state: 'destroyed' };
    if (after.status === 'paused') return { providerLeaseId: id, state: 'stopped' };
    throw settling(after, 'pause confirms');
  };

  const destroyConfirmed = async (ctx: OperationContext, id: string): Promise<TerminationReceipt> => {
    const found = await readHandle(ctx, id);
    if (!found) return { providerLeaseId: id, state: 'destroyed' };
    requireOwn(ctx, found.sb);
    if (found.sb.status === 'destroyed') return { providerLeaseId: id, state: 'destroyed' };
    if (found.sb.status !== 'destroying') {
      try {
        await sdk(() => found.handle.destroy(options(ctx)));
      } catch (err) {
        if (!(err instanceof PermanentError && err.code === 'not_found')) throw err; // 404: already gone
      }
    }
    const after = await read(ctx, id);
    if (!after || TERMINAL.has(after.status ?? '')) return { providerLeaseId: id, state: 'destroyed' };
    throw settling(after, 'destroy confirms');
  };

  /**
   * Sends the create under the job's name. Whatever goes wrong once it may have left the
   * process (timeout, cut or unreadable reply, 5xx, a name already taken), a listing by that
   * name says whether it was made; if the listing fails too, the attempt is retried and its
   * successor looks again. Returns the new sandbox's id.
   */
  const create = async (ctx: OperationContext, sandboxName: string): Promise<string> => {
    // When a create was sent, and under which name: its clean-up, if it comes to that, looks
    // for this name, and waits out a create that may still be on its way (see findAcquired).
    // Written as it goes, after its turn: one refused while it waited was never sent.
    beforeNextSend.set(ctx, () => ctx.checkpoint.write({ createosName: sandboxName, createSentAt: String(Date.now()) }));
    try {
      const created = await sdk(() =>
        clientFor(ctx).createSandbox(
          {
            shape: settings.shape,
            name: sandboxName,
            ...(settings.rootfs ? { rootfs: settings.rootfs } : {}),
            ...(settings.region ? { region: settings.region } : {}),
            auto_pause_after_seconds: settings.autoPauseAfterSeconds,
          },
          options(ctx),
        ),
      );
      return view(created.data).id;
    } catch (err) {
      // Not sent (refused at its turn or before): the look-up below must not take its place.
      beforeNextSend.delete(ctx);
      if (!(err instanceof ProviderError)) throw err; // a stale attempt: its successor decides
      const refused = err instanceof PermanentError && ['unauthorized', 'forbidden', 'payment_required'].includes(err.code);
      // Never sent: the deadline passed while it waited for its turn (pacing.ts, attemptFetch above).
      if (refused || err.code === 'rate_limited' || err.code === 'cancelled' || err.code === 'deadline_passed') throw err;
      const made = await findByName(ctx, sandboxName).catch(() => undefined);
      if (made) return made.id;
      if (made === undefined || !(err instanceof PermanentError)) {
        throw new TransientError('create_outcome_unknown', `${name}: create of ${sandboxName} may or may not have made a sandbox (${err.message}); its next attempt looks for it by name`);
      }
      throw err;
    }
  };

  return {
    name,
    // A sandbox's size is its shape (CREATEOS_SHAPE); per-acquire resources are refused, not ignored.
    capabilities: { stop: true, pause: true, forceStop: false, expiry: false, resources: false },

    async acquire(ctx, _params: OperationParams['acquire']): Promise<Lease> {
      const sandboxName = createosSandboxName(ctx.lease, ctx.jobId);
      const saved = await ctx.checkpoint.read();
      let sb: View | null = null;
      if (typeof saved.createosSandboxId === 'string') sb = await read(ctx, saved.createosSandboxId);
      else if (saved.createosName === sandboxName) sb = await findByName(ctx, sandboxName);
      if (!sb || TERMINAL.has(sb.status ?? '')) {
        const id = await create(ctx, sandboxName);
        await ctx.checkpoint.write({ createosSandboxId: id });
        sb = await read(ctx, id);
        if (!sb) throw new SettlingError('sandbox_not_visible', `${name}: sandbox ${id} was created but is not readable yet`);
      }
      requireOwn(ctx, sb);
      if (sb.status === 'running') return lease(ctx, sb);
      if (sb.status === 'failed') throw new PermanentError('sandbox_failed', `${name}: sandbox ${sb.id} failed`);
      if (sb.status === 'paused' || sb.status === 'error') {
        // Paused by itself before its acquire handed it out, or a resume gave up: resume it.
        const found = await readHandle(ctx, sb.id);
        if (found) await sdk(() => found.handle.resume(options(ctx)));
      }
      throw settling(sb, 'acquire completes');
    },

    async findAcquired(ctx, acquire) {
      const sandboxName = createosSandboxName(ctx.lease, acquire.jobId);
      const saved = acquire.checkpoint ?? {};
      // The id it saved, if that one is still live; else the last create's name, which a
      // later create may have reused after the saved one failed (or, the checkpoint lost
      // with its job, the name it would have used).
      const byId = typeof saved.createosSandboxId === 'string' ? await read(ctx, saved.createosSandboxId) : null;
      const live = (sb: View | null) => (sb && belongs(ctx, sb) && !TERMINAL.has(sb.status ?? '') ? sb : null);
      const searchByName = acquire.checkpoint === null || saved.createosName === sandboxName;
      const found = live(byId) ?? (searchByName ? live(await findByName(ctx, sandboxName)) : null);
      if (found) return found.id;
      // A create sent less than a timeout ago may not have reached CreateOS yet: look again later.
      const sentAt = Number(saved.createSentAt);
      if (Number.isFinite(sentAt) && Date.now() - sentAt < settings.timeoutMs * 1.5) {
        throw new SettlingError('create_may_be_in_flight', `${name}: a create of ${sandboxName} sent ${Date.now() - sentAt} ms ago may still arrive; looking again later`);
      }
      return null;
    },

    async resume(ctx, params): Promise<Lease | ExpiredLease> {
      const expired: ExpiredLease = { providerLeaseId: null, metadata: { expired: true } };
      const meta = params.leaseMetadata;
      if ((meta.companyId != null && meta.companyId !== ctx.lease.companyId) || (meta.environmentId != null && meta.environmentId !== ctx.lease.environmentId)) {
        throw new PermanentError('lease_environment_mismatch', `${name}: lease ${params.providerLeaseId} does not belong to this environment`);
      }
      // A sandbox it cannot use is expired, whoever's it is.
      const found = await readHandle(ctx, params.providerLeaseId).catch((err: unknown) =>
        err instanceof PermanentError && err.code === 'lease_environment_mismatch' ? null : Promise.reject(err),
      );
      if (!found) return expired;
      const { handle, sb } = found;
      if (TERMINAL.has(sb.status ?? '') || sb.status === 'destroying') return expired;
      // A sandbox of another shape, image or region is not the one this lease was given;
      // a value the lease never recorded (null) says nothing either way.
      const differs = (key: 'shape' | 'rootfs' | 'region') => typeof meta[key] === 'string' && typeof sb[key] === 'string' && meta[key] !== sb[key];
      if (differs('shape') || differs('rootfs') || differs('region')) return expired;
      if (sb.status === 'running') return lease(ctx, sb, { resumed: true });
      if (sb.status !== 'paused' && sb.status !== 'error') throw settling(sb, 'resume');
      // `error` is not fatal on CreateOS: a resume tries again with a fresh budget.
      await sdk(() => handle.resume(options(ctx)));
      const after = await read(ctx, sb.id);
      if (!after || TERMINAL.has(after.status ?? '')) return expired;
      if (after.status === 'running') return lease(ctx, after, { resumed: true });
      throw settling(after, 'resume completes');
    },

    release(ctx, params): Promise<ReleaseResult> {
      const id = params.providerLeaseId;
      return releaseByDisposition(
        params,
        {
          destroy: () => destroyConfirmed(ctx, id),
          current: async () => {
            const sb = await read(ctx, id);
            if (!sb || TERMINAL.has(sb.status ?? '')) return { providerLeaseId: id, state: 'destroyed' };
            if (sb.status === 'running') return null;
            if (sb.status === 'paused') return { providerLeaseId: id, state: 'stopped' };
            throw settling(sb, 'release confirms');
          },
          // CreateOS can neither kill nor archive: a pause is its only stop.
          stopAndRetain: () => pauseConfirmed(ctx, id),
        },
        name,
      );
    },

    stop: (ctx, params) => pauseConfirmed(ctx, params.providerLeaseId),
    forceStop: async () => {
      throw new PermanentError('force_stop_unsupported', `${name}: CreateOS cannot force a stop`);
    },
    destroy: (ctx, params) => destroyConfirmed(ctx, params.providerLeaseId),

    async status(ctx, params): Promise<SandboxState> {
      const sb = await read(ctx, params.providerLeaseId);
      return sb ? createosState(sb.status) : { kind: 'gone' };
    },

    // The first sandbox of the account's list: one paced read that needs the key.
    async probe(ctx) {
      try {
        await sdk(async () => {
          for await (const handle of clientFor(ctx).iterateSandboxes(options(ctx))) {
            void handle;
            break;
          }
        });
        return { ok: true, code: 'ok', message: `${name}: the service takes the API key` };
      } catch (err) {
        return probeFailure(err);
      }
    },
  };
}
