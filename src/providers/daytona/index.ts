import { Configuration, SandboxApi } from '@daytona/api-client';
import { isAxiosError, type AxiosResponse } from 'axios';
import { z } from 'zod';
import type { OperationParams } from '../../operations.ts';
import { PermanentError, ProviderError, SettlingError } from '../errors.ts';
import { errorForStatus, networkError } from '../http-errors.ts';
import { fencedTransport, FenceWindowError } from '../fenced-transport.ts';
import { releaseByDisposition } from '../release.ts';
import type {
  ExpiredLease,
  Lease,
  LeaseProvider,
  OperationContext,
  ReleaseReceipt,
  SandboxState,
  TerminationReceipt,
} from '../types.ts';

export const DaytonaSettingsSchema = z.strictObject({
  name: z.string().min(1).default('daytona'),
  apiUrl: z.url(),
  apiKey: z.string().min(1, 'a Daytona API key is required'),
  organizationId: z.string().min(1).optional(),
  /** Per-request timeout. */
  timeoutMs: z.number().int().positive().default(30_000),
  /** Minutes of inactivity before Daytona stops a sandbox it created (reference: 15). */
  autoStopMinutes: z.number().int().min(0).default(15),
});
export type DaytonaSettings = z.input<typeof DaytonaSettingsSchema>;

// What lease-ops relies on in Daytona's Sandbox reply; checked like any other input.
const SandboxReplySchema = z.object({
  id: z.string().min(1),
  name: z.string(),
  state: z.string().optional(),
  desiredState: z.string().optional(),
  recoverable: z.boolean().optional(),
  errorReason: z.string().optional(),
  labels: z.record(z.string(), z.string()).default({}),
  autoDeleteInterval: z.number().optional(),
});
type SandboxReply = z.infer<typeof SandboxReplySchema>;

const LABEL_COMPANY = 'lease-ops/company';
const LABEL_ENVIRONMENT = 'lease-ops/environment';
const LABEL_RUN = 'lease-ops/run';

/** Daytona's states between two stable ones: the lane retries until they settle. */
const TRANSITIONAL = new Set(['creating', 'starting', 'stopping', 'destroying', 'archiving', 'restoring', 'resizing', 'pausing', 'resuming', 'pulling_snapshot', 'building_snapshot', 'snapshotting', 'forking', 'pending_build']);

/**
 * Daytona through its official OpenAPI client. Every operation reads the sandbox fresh and
 * returns, or raises SettlingError while a transition runs; it never sits polling. A
 * receipt is given only after a fresh read shows `stopped` (or the sandbox gone).
 */
export function createDaytonaProvider(input: DaytonaSettings): LeaseProvider {
  const settings = DaytonaSettingsSchema.parse(input);
  const api = new SandboxApi(new Configuration({ basePath: settings.apiUrl.replace(/\/+$/, ''), accessToken: settings.apiKey }));
  const org = settings.organizationId;
  const name = settings.name;

  /**
   * Per-request options: the attempt's signal and timeout, its id for tracing, and a
   * transport that drops the request at the last moment if the attempt's fence went stale.
   */
  const optionsFor = (ctx: OperationContext) => ({
    signal: ctx.signal,
    timeout: settings.timeoutMs,
    headers: { 'X-Lease-Ops-Attempt': ctx.attemptId },
    transport: fencedTransport(() => ctx.fenceIsFresh()),
  });
  /**
   * Sends a request once the fence holds. A request dropped by the transport (the process
   * stalled between check and send) is sent again only after a fresh check says so.
   */
  const fenced = async <T>(ctx: OperationContext, request: (options: ReturnType<typeof optionsFor>) => Promise<AxiosResponse<T>>): Promise<AxiosResponse<T>> => {
    for (let tries = 1; ; tries++) {
      await ctx.fence();
      try {
        return await request(optionsFor(ctx));
      } catch (err) {
        if (!(isAxiosError(err) && err.cause instanceof FenceWindowError) || tries >= 3) throw err;
      }
    }
  };
  const call = async <T>(ctx: OperationContext, request: (options: ReturnType<typeof optionsFor>) => Promise<AxiosResponse<T>>): Promise<T> => {
    try {
      return (await fenced(ctx, request)).data;
    } catch (err) {
      throw toProviderError(err);
    }
  };
  const toProviderError = (err: unknown): ProviderError => {
    if (err instanceof ProviderError) return err;
    if (isAxiosError(err) && err.response) {
      const data = err.response.data as { message?: unknown } | undefined;
      const message = typeof data?.message === 'string' ? data.message : err.message;
      return errorForStatus(name, err.response.status, message, err.response.headers['retry-after'] as string | undefined);
    }
    return networkError(name, err) ?? new PermanentError('provider_error', `${name}: ${(err as Error).message}`);
  };
  const isStatus = (err: unknown, status: number) => isAxiosError(err) && err.response?.status === status;

  /** A fresh read; null when the sandbox does not exist (404). */
  const read = async (ctx: OperationContext, idOrName: string): Promise<SandboxReply | null> => {
    try {
      const data = (await fenced(ctx, (o) => api.getSandbox(idOrName, org, undefined, o))).data;
      const sb = parseReply(data);
      ctx.observe(sb.id, normalise(sb));
      return sb;
    } catch (err) {
      if (isStatus(err, 404)) {
        ctx.observe(idOrName, { kind: 'gone' });
        return null;
      }
      throw toProviderError(err);
    }
  };
  const normalise = (sb: SandboxReply): SandboxState => {
    const state = sb.state ?? 'unknown';
    if (state === 'destroyed') return { kind: 'gone' };
    if (state === 'started') return { kind: 'running' };
    if (state === 'stopped' || state === 'archived' || state === 'paused') return { kind: 'stopped', providerState: state };
    if (state === 'error' || state === 'build_failed') return { kind: 'error', providerState: state, recoverable: Boolean(sb.recoverable) };
    return { kind: 'transitioning', providerState: state };
  };
  const parseReply = (data: unknown): SandboxReply => {
    const parsed = SandboxReplySchema.safeParse(data);
    if (!parsed.success) throw new PermanentError('invalid_provider_reply', `${name}: unexpected sandbox reply: ${z.prettifyError(parsed.error)}`);
    return parsed.data;
  };
  const belongs = (ctx: OperationContext, sb: SandboxReply) =>
    sb.labels[LABEL_COMPANY] === ctx.lease.companyId && sb.labels[LABEL_ENVIRONMENT] === ctx.lease.environmentId;
  const requireOwn = (ctx: OperationContext, sb: SandboxReply) => {
    if (!belongs(ctx, sb)) throw new PermanentError('lease_environment_mismatch', `${name}: sandbox ${sb.id} belongs to another environment`);
  };
  const settling = (sb: SandboxReply, doing: string) =>
    new SettlingError(`sandbox_${sb.state ?? 'unknown'}`, `${name}: sandbox ${sb.id} is ${sb.state}; ${doing} once it settles`);
  const lease = (sb: SandboxReply, extra: Record<string, unknown> = {}): Lease => ({
    providerLeaseId: sb.id,
    metadata: { provider: 'daytona', name: sb.name, ...extra },
    expiresAt: null,
  });

  /** Stops (or kills) a sandbox and gives a receipt only once a fresh read shows it stopped. */
  const stopConfirmed = async (ctx: OperationContext, id: string, force: boolean): Promise<TerminationReceipt> => {
    const before = await read(ctx, id);
    if (!before) return { providerLeaseId: id, state: 'destroyed' };
    requireOwn(ctx, before);
    if (before.state === 'stopped' || before.state === 'archived') return { providerLeaseId: id, state: 'stopped' };
    if (before.state === 'started' || before.state === 'paused' || (force && before.state === 'stopping')) {
      try {
        await call(ctx, (o) => api.stopSandbox(id, org, force, o));
      } catch (err) {
        // 400 "not in a stoppable state": it stopped meanwhile, or is in no state to stop;
        // the fresh read below tells which.
        if (!(err instanceof PermanentError && err.code === 'bad_request')) throw err;
      }
    } else if (before.state !== 'stopping') {
      if (TRANSITIONAL.has(before.state ?? '')) throw settling(before, 'stopping');
      throw new PermanentError('not_stoppable', `${name}: sandbox ${id} is ${before.state} and cannot be stopped`);
    }
    const after = await read(ctx, id);
    if (!after) return { providerLeaseId: id, state: 'destroyed' };
    if (after.state === 'stopped' || after.state === 'archived') return { providerLeaseId: id, state: 'stopped' };
    throw settling(after, force ? 'force-stop confirms' : 'stop confirms');
  };

  const destroyConfirmed = async (ctx: OperationContext, id: string): Promise<TerminationReceipt> => {
    const before = await read(ctx, id);
    if (!before) return { providerLeaseId: id, state: 'destroyed' };
    requireOwn(ctx, before);
    if (before.state !== 'destroying') {
      try {
        await call(ctx, (o) => api.deleteSandbox(id, org, o));
      } catch (err) {
        if (!(err instanceof PermanentError && err.code === 'not_found')) throw err; // 404: already gone
      }
    }
    const after = await read(ctx, id);
    if (!after || after.state === 'destroyed') return { providerLeaseId: id, state: 'destroyed' };
    throw settling(after, 'destroy confirms');
  };

  return {
    name,
    capabilities: { stop: true, pause: false, forceStop: true },

    async acquire(ctx, params: OperationParams['acquire']): Promise<Lease> {
      // The sandbox is named after the job, so a retry finds the one its first attempt made.
      const sandboxName = `lease-ops-${ctx.jobId.replace(/[^A-Za-z0-9-]/g, '-')}`;
      let sb = await read(ctx, sandboxName);
      if (!sb) {
        const created = await call(ctx, (o) =>
          api.createSandbox(
            {
              name: sandboxName,
              labels: { [LABEL_COMPANY]: ctx.lease.companyId, [LABEL_ENVIRONMENT]: ctx.lease.environmentId, [LABEL_RUN]: params.runId },
              autoStopInterval: settings.autoStopMinutes,
              ...(params.resources?.cpu ? { cpu: params.resources.cpu } : {}),
              ...(params.resources?.memoryGiB ? { memory: params.resources.memoryGiB } : {}),
              ...(params.resources?.diskGiB ? { disk: params.resources.diskGiB } : {}),
            },
            org,
            o,
          ),
        );
        sb = parseReply(created);
      }
      requireOwn(ctx, sb);
      if (sb.state === 'started') {
        // Daytona has no lease expiry to promise; say so instead of pretending.
        return lease(sb, params.requestedExpiresAt ? { requestedExpiresAt: params.requestedExpiresAt, expiryHonoured: false } : {});
      }
      if (sb.state === 'error' || sb.state === 'build_failed') {
        throw new PermanentError('sandbox_failed', `${name}: sandbox ${sb.id} failed to start: ${sb.errorReason ?? sb.state}`);
      }
      throw settling(sb, 'acquire completes');
    },

    async resume(ctx, params): Promise<Lease | ExpiredLease> {
      const expired: ExpiredLease = { providerLeaseId: null, metadata: { expired: true } };
      const sb = await read(ctx, params.providerLeaseId);
      if (!sb || sb.state === 'destroyed' || sb.state === 'destroying' || !belongs(ctx, sb)) return expired;
      switch (sb.state) {
        case 'started':
          return lease(sb, { resumed: true });
        case 'stopped':
        case 'archived':
          await call(ctx, (o) => api.startSandbox(sb.id, org, o));
          break;
        case 'error':
          if (!sb.recoverable) throw new PermanentError('sandbox_unrecoverable', `${name}: sandbox ${sb.id} is in error: ${sb.errorReason ?? 'unknown'}`);
          await call(ctx, (o) => api.recoverSandbox(sb.id, org, undefined, o));
          break;
        case 'build_failed':
          return expired;
        default:
          if (!TRANSITIONAL.has(sb.state ?? '')) throw new PermanentError('unexpected_state', `${name}: sandbox ${sb.id} is ${sb.state}`);
      }
      const after = await read(ctx, sb.id);
      if (!after) return expired;
      if (after.state === 'started') return lease(after, { resumed: true });
      throw settling(after, 'resume completes');
    },

    release(ctx, params): Promise<ReleaseReceipt> {
      const id = params.providerLeaseId;
      return releaseByDisposition(params, {
        destroy: () => destroyConfirmed(ctx, id),
        current: async () => {
          const sb = await read(ctx, id);
          if (!sb) return 'destroyed';
          requireOwn(ctx, sb);
          if (sb.state === 'started') return 'running';
          if (sb.state === 'stopped' || sb.state === 'archived') return 'stopped';
          throw settling(sb, 'release confirms');
        },
        // A retained sandbox must not be auto-deleted; confirm that before stopping.
        stopAndRetain: async () => {
          const sb = await read(ctx, id);
          if (!sb) return { providerLeaseId: id, state: 'destroyed' };
          requireOwn(ctx, sb);
          if (sb.autoDeleteInterval !== -1) {
            await call(ctx, (o) => api.setAutoDeleteInterval(id, -1, org, o));
            const confirmed = await read(ctx, id);
            if (!confirmed) return { providerLeaseId: id, state: 'destroyed' };
            if (confirmed.autoDeleteInterval !== -1) throw new SettlingError('auto_delete_pending', `${name}: auto-delete of ${id} not yet disabled`);
          }
          return stopConfirmed(ctx, id, false);
        },
      });
    },

    stop: (ctx, params) => stopConfirmed(ctx, params.providerLeaseId, false),
    forceStop: (ctx, params) => stopConfirmed(ctx, params.providerLeaseId, true),
    destroy: (ctx, params) => destroyConfirmed(ctx, params.providerLeaseId),

    async status(ctx, params): Promise<SandboxState> {
      const sb = await read(ctx, params.providerLeaseId);
      return sb ? normalise(sb) : { kind: 'gone' };
    },
  };
}
