import pThrottle from 'p-throttle';
import { z } from 'zod';
import type { OperationParams } from '../../operations.ts';
import { PermanentError, SettlingError } from '../errors.ts';
import { errorForStatus, networkError } from '../http-errors.ts';
import { releaseByDisposition } from '../release.ts';
import type { ExpiredLease, Lease, LeaseProvider, OperationContext, ReleaseReceipt, SandboxState, TerminationReceipt } from '../types.ts';

export const CreateosSettingsSchema = z.strictObject({
  name: z.string().min(1).default('createos'),
  apiUrl: z.url(),
  apiKey: z.string().min(1, 'a CreateOS API key is required'),
  shape: z.string().min(1).default('small'),
  rootfs: z.string().optional(),
  region: z.string().optional(),
  timeoutMs: z.number().int().positive().default(30_000),
  /** Client-side pacing: CreateOS allows about 300 requests a minute per client. */
  requestsPerMinute: z.number().int().positive().default(300),
  /** Idle seconds before CreateOS pauses a sandbox by itself (reference auto-stop: 15 min). */
  autoPauseAfterSeconds: z.number().int().positive().default(900),
});
export type CreateosSettings = z.input<typeof CreateosSettingsSchema>;

const SandboxSchema = z.object({
  id: z.string().min(1),
  status: z.enum(['creating', 'running', 'pausing', 'paused', 'resuming', 'forking', 'error', 'destroying', 'destroyed', 'failed']),
  shape: z.string().optional(),
  rootfs: z.string().nullable().optional(),
  region: z.string().nullable().optional(),
});
type CreateosSandbox = z.infer<typeof SandboxSchema>;

// JSend: success carries data; fail (4xx) carries data about what was wrong; error carries a message.
const EnvelopeSchema = z.discriminatedUnion('status', [
  z.object({ status: z.literal('success'), data: z.unknown() }),
  z.object({ status: z.literal('fail'), data: z.unknown() }),
  z.object({ status: z.literal('error'), message: z.string(), code: z.union([z.number(), z.string()]).optional() }),
]);

const TRANSITIONAL = new Set(['creating', 'pausing', 'resuming', 'forking', 'destroying']);

/**
 * CreateOS over HTTP (fetch), paced under its rate limit. CreateOS has pause instead of
 * stop and no force-stop; pause and resume are asynchronous, so a reply that says
 * pausing/resuming raises SettlingError and the lane's retry reads the outcome fresh.
 */
export function createCreateosProvider(input: CreateosSettings): LeaseProvider {
  const settings = CreateosSettingsSchema.parse(input);
  const name = settings.name;
  const base = settings.apiUrl.replace(/\/+$/, '');
  // One pacing window per provider instance (per worker process).
  const rpm = settings.requestsPerMinute;
  const throttle = pThrottle(rpm >= 60 ? { limit: Math.floor(rpm / 60), interval: 1_000 } : { limit: 1, interval: Math.ceil(60_000 / rpm) });
  // The fence is checked once the request has its slot, not before it waited for one: a
  // throttled request can wait seconds, and its attempt may be superseded meanwhile.
  const paced = throttle(async (ctx: OperationContext, url: string, init: RequestInit) => {
    await ctx.fence();
    return fetch(url, init);
  });

  /** One request; returns the success data, or null for a 404 when `missingOk`. */
  const request = async (ctx: OperationContext, method: string, path: string, body?: unknown, missingOk = false): Promise<unknown> => {
    let res: Response;
    try {
      res = await paced(ctx, `${base}/v1${path}`, {
        method,
        headers: {
          'x-api-key': settings.apiKey,
          'x-lease-ops-attempt': ctx.attemptId,
          ...(body === undefined ? {} : { 'content-type': 'application/json' }),
        },
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.any([ctx.signal, AbortSignal.timeout(settings.timeoutMs)]),
      });
    } catch (err) {
      // A refused fence is the attempt's business, not the network's.
      if ((err as { code?: unknown }).code === 'stale_attempt') throw err;
      throw networkError(name, err) ?? new PermanentError('provider_error', `${name}: ${(err as Error).message}`);
    }
    const text = await res.text();
    let envelope: z.infer<typeof EnvelopeSchema>;
    try {
      envelope = EnvelopeSchema.parse(JSON.parse(text));
    } catch {
      if (res.status >= 500 || res.status === 429) throw errorForStatus(name, res.status, text.slice(0, 200), res.headers.get('retry-after'));
      throw new PermanentError('invalid_provider_reply', `${name}: ${method} ${path} answered ${res.status} without a JSend body`);
    }
    if (res.ok && envelope.status === 'success') return envelope.data;
    if (res.status === 404 && missingOk) return null;
    const message = envelope.status === 'error' ? envelope.message : JSON.stringify(envelope.data);
    throw errorForStatus(name, res.status, message, res.headers.get('retry-after'));
  };
  const sandbox = (data: unknown): CreateosSandbox => {
    const parsed = SandboxSchema.safeParse(data);
    if (!parsed.success) throw new PermanentError('invalid_provider_reply', `${name}: unexpected sandbox reply: ${z.prettifyError(parsed.error)}`);
    return parsed.data;
  };
  /** A fresh read; null when the sandbox is gone. */
  const read = async (ctx: OperationContext, id: string): Promise<CreateosSandbox | null> => {
    const data = await request(ctx, 'GET', `/sandboxes/${encodeURIComponent(id)}`, undefined, true);
    const sb = data === null ? null : sandbox(data);
    const live = sb && sb.status !== 'destroyed' ? sb : null;
    ctx.observe(id, live ? normalise(live) : { kind: 'gone' });
    return live;
  };
  const normalise = (sb: CreateosSandbox): SandboxState => {
    if (sb.status === 'running') return { kind: 'running' };
    if (sb.status === 'paused') return { kind: 'stopped', providerState: 'paused' };
    if (sb.status === 'error' || sb.status === 'failed') return { kind: 'error', providerState: sb.status, recoverable: false };
    return { kind: 'transitioning', providerState: sb.status };
  };
  const settling = (sb: CreateosSandbox, doing: string) =>
    new SettlingError(`sandbox_${sb.status}`, `${name}: sandbox ${sb.id} is ${sb.status}; ${doing} once it settles`);
  // CreateOS keeps no labels, so the lease metadata carries whose sandbox it is.
  const lease = (ctx: OperationContext, sb: CreateosSandbox, extra: Record<string, unknown> = {}): Lease => ({
    providerLeaseId: sb.id,
    metadata: {
      provider: 'createos',
      companyId: ctx.lease.companyId,
      environmentId: ctx.lease.environmentId,
      shape: sb.shape,
      rootfs: sb.rootfs ?? null,
      region: sb.region ?? null,
      ...extra,
    },
    expiresAt: null,
  });

  const pauseConfirmed = async (ctx: OperationContext, id: string): Promise<TerminationReceipt> => {
    const sb = await read(ctx, id);
    if (!sb) return { providerLeaseId: id, state: 'destroyed' };
    if (sb.status === 'paused') return { providerLeaseId: id, state: 'stopped' };
    if (sb.status === 'running') await request(ctx, 'POST', `/sandboxes/${encodeURIComponent(id)}/pause`);
    else if (!TRANSITIONAL.has(sb.status)) throw new PermanentError('not_stoppable', `${name}: sandbox ${id} is ${sb.status} and cannot be paused`);
    const after = await read(ctx, id);
    if (!after) return { providerLeaseId: id, state: 'destroyed' };
    if (after.status === 'paused') return { providerLeaseId: id, state: 'stopped' };
    throw settling(after, 'pause confirms');
  };

  const destroyConfirmed = async (ctx: OperationContext, id: string): Promise<TerminationReceipt> => {
    const sb = await read(ctx, id);
    if (!sb) return { providerLeaseId: id, state: 'destroyed' };
    if (sb.status !== 'destroying') await request(ctx, 'DELETE', `/sandboxes/${encodeURIComponent(id)}`, undefined, true);
    const after = await read(ctx, id);
    if (!after) return { providerLeaseId: id, state: 'destroyed' };
    throw settling(after, 'destroy confirms');
  };

  return {
    name,
    capabilities: { stop: true, pause: true, forceStop: false },

    async acquire(ctx, _params: OperationParams['acquire']): Promise<Lease> {
      // CreateOS names no sandbox by a key of ours, so a retry finds the one its first
      // attempt created through the job's checkpoint.
      const saved = await ctx.checkpoint.read();
      let sb: CreateosSandbox | null = typeof saved.createosSandboxId === 'string' ? await read(ctx, saved.createosSandboxId) : null;
      if (!sb) {
        sb = sandbox(
          await request(ctx, 'POST', '/sandboxes', {
            shape: settings.shape,
            ...(settings.rootfs ? { rootfs: settings.rootfs } : {}),
            ...(settings.region ? { region: settings.region } : {}),
            auto_pause_after_seconds: settings.autoPauseAfterSeconds,
          }),
        );
        await ctx.checkpoint.write({ createosSandboxId: sb.id });
      }
      if (sb.status === 'running') return lease(ctx, sb);
      if (sb.status === 'failed' || sb.status === 'error') throw new PermanentError('sandbox_failed', `${name}: sandbox ${sb.id} is ${sb.status}`);
      throw settling(sb, 'acquire completes');
    },

    async resume(ctx, params): Promise<Lease | ExpiredLease> {
      const expired: ExpiredLease = { providerLeaseId: null, metadata: { expired: true } };
      const meta = params.leaseMetadata;
      if ((meta.companyId !== undefined && meta.companyId !== ctx.lease.companyId) || (meta.environmentId !== undefined && meta.environmentId !== ctx.lease.environmentId)) {
        throw new PermanentError('lease_environment_mismatch', `${name}: lease ${params.providerLeaseId} does not belong to this environment`);
      }
      const sb = await read(ctx, params.providerLeaseId);
      if (!sb || sb.status === 'failed' || sb.status === 'destroying') return expired;
      // A sandbox of another shape, image or region is not the one this lease was given.
      if ((meta.shape !== undefined && meta.shape !== sb.shape) || (meta.rootfs !== undefined && (meta.rootfs ?? null) !== (sb.rootfs ?? null)) || (meta.region !== undefined && (meta.region ?? null) !== (sb.region ?? null))) {
        return expired;
      }
      if (sb.status === 'running') return lease(ctx, sb, { resumed: true });
      if (sb.status === 'error') throw new PermanentError('sandbox_unrecoverable', `${name}: sandbox ${sb.id} is in error`);
      if (sb.status === 'paused') {
        await request(ctx, 'POST', `/sandboxes/${encodeURIComponent(sb.id)}/resume`);
        const after = await read(ctx, sb.id);
        if (!after) return expired;
        if (after.status === 'running') return lease(ctx, after, { resumed: true });
        throw settling(after, 'resume completes');
      }
      throw settling(sb, 'resume');
    },

    release(ctx, params): Promise<ReleaseReceipt> {
      const id = params.providerLeaseId;
      return releaseByDisposition(params, {
        destroy: () => destroyConfirmed(ctx, id),
        current: async () => {
          const sb = await read(ctx, id);
          if (!sb) return 'destroyed';
          if (sb.status === 'running') return 'running';
          if (sb.status === 'paused') return 'stopped';
          throw settling(sb, 'release confirms');
        },
        stopAndRetain: () => pauseConfirmed(ctx, id),
      });
    },

    stop: (ctx, params) => pauseConfirmed(ctx, params.providerLeaseId),
    forceStop: async () => {
      throw new PermanentError('force_stop_unsupported', `${name}: CreateOS cannot force a stop`);
    },
    destroy: (ctx, params) => destroyConfirmed(ctx, params.providerLeaseId),

    async status(ctx, params): Promise<SandboxState> {
      const sb = await read(ctx, params.providerLeaseId);
      return sb ? normalise(sb) : { kind: 'gone' };
    },
  };
}

