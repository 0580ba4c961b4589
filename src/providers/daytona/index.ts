import { createHash } from 'node:crypto';
import type { SandboxApi } from '@daytona/api-client';
import type { AxiosError, AxiosResponse } from 'axios';
import { z } from 'zod';
import type { OperationParams } from '../../operations.ts';
import { PermanentError, ProviderError, SettlingError, TransientError } from '../errors.ts';
import { errorForStatus, networkError, retryAfterMs } from '../http-errors.ts';
import { fencedTransport, FenceWindowError } from '../fenced-transport.ts';
import { localRateLimiters, type RateLimit, type RateLimiterFactory } from '../pacing.ts';
import { releaseByDisposition } from '../release.ts';
import { probeFailure } from '../types.ts';
import { DaytonaStateEvents } from './events.ts';
import type {
  ExpiredLease,
  Lease,
  LeaseProvider,
  OperationContext,
  ReleaseResult,
  SandboxState,
  TerminationReceipt,
} from '../types.ts';

/** Daytona's named throttlers, counted per organization: lease-ops paces each as its own bucket. */
/** How long a force-stop waits for a force it sent to take effect before it sends another. */
const FORCE_RESEND_MS = 30_000;

export const DAYTONA_THROTTLERS = ['sandbox-create', 'sandbox-lifecycle', 'authenticated'] as const;
type Throttler = (typeof DAYTONA_THROTTLERS)[number];

// Bounded: a pace of less than one request a minute (or an absurd burst) is a mistake, or an attack on a shared budget.
const RateLimitSchema = z.strictObject({ perMinute: z.number().min(1).max(1_000_000), burst: z.number().int().positive().max(100_000).optional() });

/**
 * Daytona's documented tier-1 limits per minute are create 300, lifecycle 10,000, other
 * requests 10,000 (per organization). Paced at 80 % with a burst of the other 20 %, so a
 * fixed one-minute window never sees more than the limit.
 */
export const DAYTONA_DEFAULT_RATE_LIMITS: Record<Throttler, RateLimit> = {
  'sandbox-create': { perMinute: 240, burst: 60 },
  'sandbox-lifecycle': { perMinute: 8_000, burst: 2_000 },
  authenticated: { perMinute: 8_000, burst: 2_000 },
};

export const DaytonaSettingsSchema = z.strictObject({
  name: z.string().min(1).default('daytona'),
  apiUrl: z.url(),
  apiKey: z.string().min(1, 'a Daytona API key is required'),
  organizationId: z.string().min(1).optional(),
  /** Per-request timeout. */
  timeoutMs: z.number().int().positive().default(30_000),
  /** Create's timeout: Daytona's create may wait up to 30 s for the sandbox to start before it answers. */
  createTimeoutMs: z.number().int().positive().default(60_000),
  /** Minutes of inactivity before Daytona stops a sandbox it created (reference: 15; 0 = never; at most 30 days). */
  autoStopMinutes: z.number().int().min(0).max(43_200).default(15),
  /** The snapshot sandboxes start from (Daytona's default when unset). */
  snapshot: z.string().min(1).optional(),
  /** A snapshot per adapter type (the host's `adapterType` of an acquire), over `snapshot`. */
  snapshotsByAdapter: z.record(z.string().min(1), z.string().min(1)).default({}),
  /**
   * Listens to Daytona's notification gateway (with `organizationId` only: the gateway sends
   * sandbox events to an organization's room), so an attempt waiting out a transition goes
   * on when it ends instead of backing off. Off: every transition is waited out by backoff.
   */
  notifications: z.boolean().default(true),
  /** Per-throttler pacing, shared by every worker replica; null turns a bucket's pacing off. */
  rateLimits: z.partialRecord(z.enum(DAYTONA_THROTTLERS), RateLimitSchema.nullable()).default({}),
});
export type DaytonaSettings = z.input<typeof DaytonaSettingsSchema>;

// The sandbox reply as Daytona sends it: its DTO copies nullable columns as null, adds
// fields over time and may report states newer than this client. Only what a decision
// reads is checked; the rest passes.
const SandboxReplySchema = z.object({
  id: z.string().min(1),
  name: z.string().nullish(),
  state: z.string().nullish(),
  desiredState: z.string().nullish(),
  recoverable: z.boolean().nullish(),
  errorReason: z.string().nullish(),
  labels: z.record(z.string(), z.string().nullish()).nullish(),
  autoDeleteInterval: z.number().nullish(),
  /** When Daytona destroys the sandbox whatever its state (set only with a TTL). */
  autoDestroyAt: z.string().nullish(),
});
type SandboxReply = z.infer<typeof SandboxReplySchema>;

const LABEL_COMPANY = 'lease-ops/company';
const LABEL_ENVIRONMENT = 'lease-ops/environment';
const LABEL_RUN = 'lease-ops/run';
/** The host's fields of an acquire, as labels (paperclip's agent, adapter, issue and workspace). */
const HOST_LABELS = {
  agentId: 'lease-ops/agent',
  adapterType: 'lease-ops/adapter',
  issueId: 'lease-ops/issue',
  executionWorkspaceId: 'lease-ops/execution-workspace',
} as const;

/** The host's fields an acquire carries, as Daytona labels (values bounded as its labels are). */
function hostLabels(params: OperationParams['acquire']): Record<string, string> {
  const labels: Record<string, string> = {};
  for (const [field, label] of Object.entries(HOST_LABELS)) {
    const value = params[field as keyof typeof HOST_LABELS];
    if (typeof value === 'string' && value !== '') labels[label] = value.slice(0, 255);
  }
  return labels;
}

/**
 * Whole minutes from `now` to `until`, rounded down so the sandbox is gone at or before it;
 * null when less than a minute is left (Daytona counts TTLs in minutes: no bound is possible).
 */
export function ttlMinutesUntil(until: number, now: number): number | null {
  const minutes = Math.floor((until - now) / 60_000);
  return minutes >= 1 ? minutes : null;
}

/** Where each of Daytona's transitional states is headed (its SandboxState enum, 0.218.0). */
const TRANSITIONS: Record<string, 'running' | 'stopped' | 'gone' | undefined> = {
  creating: 'running',
  starting: 'running',
  restoring: 'running',
  resuming: 'running',
  pending_build: 'running',
  building_snapshot: 'running',
  pulling_snapshot: 'running',
  unknown: 'running',
  stopping: 'stopped',
  pausing: 'stopped',
  // Archiving moves a stopped sandbox's files away: not a stop, nothing for the watchdog to force.
  archiving: undefined,
  destroying: 'gone',
  resizing: undefined,
  snapshotting: undefined,
  forking: undefined,
};
const STABLE = new Set(['started', 'stopped', 'archived', 'paused']);

/**
 * What a Daytona reply means. A stable state whose desired state differs is on its way
 * there (a start of an archived sandbox reads `archived` until the runner moves it), and a
 * state this client does not know is a transition to wait out, never one to act on.
 */
export function daytonaState(sb: Pick<SandboxReply, 'state' | 'desiredState' | 'recoverable'>): SandboxState {
  const state = sb.state ?? 'unknown';
  const desired = sb.desiredState ?? undefined;
  if (state === 'destroyed') return { kind: 'gone' };
  if (state === 'error' || state === 'build_failed') return { kind: 'error', providerState: state, recoverable: state === 'error' && sb.recoverable === true };
  if (STABLE.has(state) && desired && desired !== state && desired !== 'resized') {
    const toward = desired === 'started' ? 'running' : desired === 'destroyed' ? 'gone' : 'stopped';
    return { kind: 'transitioning', providerState: state, toward };
  }
  if (state === 'started') return { kind: 'running' };
  if (state === 'stopped' || state === 'archived' || state === 'paused') return { kind: 'stopped', providerState: state };
  const toward = TRANSITIONS[state];
  return toward ? { kind: 'transitioning', providerState: state, toward } : { kind: 'transitioning', providerState: state };
}

/** The state name Daytona reports for a normalised state (what a pushed state is compared with). */
function daytonaStateName(state: SandboxState): string {
  if ('providerState' in state) return state.providerState;
  return state.kind === 'running' ? 'started' : 'destroyed';
}

/**
 * Whether a string can be a Daytona sandbox id (a UUID: lowercase, no separators but `-`).
 * Daytona also finds a sandbox by its name, or by its id in capitals: either would make one
 * sandbox two leases, whose calls could overlap. lease-ops' own names are never ids.
 */
export function looksLikeDaytonaId(id: string): boolean {
  return /^[0-9a-z][0-9a-z-]*$/.test(id) && !id.startsWith('lease-ops-');
}

/** The sandbox an acquire makes is named after its job: every attempt of the job finds the same one. */
export function daytonaSandboxName(jobId: string): string {
  return `lease-ops-${jobId.replace(/[^A-Za-z0-9-]/g, '-')}`;
}

/** Retry-After in ms, from the plain header or Daytona's per-throttler `Retry-After-<name>` ones (the longest). */
function retryAfterOf(headers: Record<string, unknown>): { ms: number | undefined; throttlers: Throttler[] } {
  let ms: number | undefined;
  const throttlers: Throttler[] = [];
  for (const [name, value] of Object.entries(headers)) {
    const m = /^retry-after(?:-(.+))?$/i.exec(name);
    if (!m || typeof value !== 'string') continue;
    const v = retryAfterMs(value);
    if (v !== undefined) ms = Math.max(ms ?? 0, v);
    const throttler = m[1]?.toLowerCase();
    if (throttler && (DAYTONA_THROTTLERS as readonly string[]).includes(throttler)) throttlers.push(throttler as Throttler);
  }
  return { ms, throttlers };
}

/** The attempt's own fence refused the call: not the provider's error, and not to be retried here. */
const isStale = (err: unknown) => (err as { code?: unknown } | null)?.code === 'stale_attempt';
const isMismatch = (err: unknown) => err instanceof PermanentError && err.code === 'lease_environment_mismatch';

type Request<T> = (api: SandboxApi, options: ReturnType<typeof requestOptions>) => Promise<AxiosResponse<T>>;

/** axios' own test (an error it made carries `isAxiosError`), without loading axios to make it. */
const isAxiosError = (err: unknown): err is AxiosError => (err as { isAxiosError?: unknown } | null)?.isAxiosError === true;

/**
 * Per-request options: the attempt's signal and timeout, its id for tracing, and a
 * transport that drops the request at the last moment if the attempt's fence went stale.
 */
function requestOptions(ctx: OperationContext, timeoutMs: number) {
  return {
    signal: ctx.signal,
    timeout: timeoutMs,
    headers: { 'X-Lease-Ops-Attempt': ctx.attemptId },
    transport: fencedTransport(() => ctx.fenceIsFresh()),
  };
}

/**
 * Daytona through its official OpenAPI client (@daytona/api-client, axios underneath, whose
 * `transport` option carries lease-ops' fence check to the moment a request leaves the
 * process). Every operation reads the sandbox fresh and returns, or raises SettlingError
 * while a transition runs; it never sits polling. A receipt is given only after a fresh
 * read shows `stopped` (or the sandbox gone).
 */
export function createDaytonaProvider(input: DaytonaSettings, rateLimiters: RateLimiterFactory = localRateLimiters): LeaseProvider {
  const settings = DaytonaSettingsSchema.parse(input);
  // No redirects: the address is checked before it is used (instances), and a redirect would go anywhere.
  // The client (and axios under it) is loaded with the first request: a process that never
  // calls Daytona (a CLI command, a worker serving other providers) does not pay for it.
  let api: Promise<SandboxApi> | null = null;
  const loadApi = () =>
    (api ??= import('@daytona/api-client').then(
      ({ Configuration, SandboxApi }) =>
        new SandboxApi(new Configuration({ basePath: settings.apiUrl.replace(/\/+$/, ''), accessToken: settings.apiKey, baseOptions: { maxRedirects: 0 } })),
    ));
  const org = settings.organizationId;
  const name = settings.name;
  const limits: Record<string, RateLimit | null> = { ...DAYTONA_DEFAULT_RATE_LIMITS, ...settings.rateLimits };
  // Daytona counts per organization: every instance and replica using this organization (or,
  // without one named, this API key) shares one budget.
  const account = settings.organizationId ?? createHash('sha256').update(settings.apiKey).digest('hex').slice(0, 16);
  const limiter = rateLimiters(`daytona:${new URL(settings.apiUrl).host}:${account}`, limits);
  // The gateway sends sandbox events to an organization's room: without one named, none would come.
  const events = settings.notifications && org ? new DaytonaStateEvents({ apiUrl: settings.apiUrl, apiKey: settings.apiKey, organizationId: org }) : null;

  /**
   * Sends a request in its throttler's turn, once the fence holds. A 429 holds the
   * throttler back for every replica. A request dropped by the transport (the process
   * stalled between check and send) is sent again only after a fresh check says so.
   * `beforeSend` runs once the turn came, before the fence and the deadline are checked for
   * each send: what it notes may be for a request then not sent, never the other way round.
   */
  const send = async <T>(ctx: OperationContext, throttler: Throttler, request: Request<T>, beforeSend?: () => Promise<void>): Promise<AxiosResponse<T>> => {
    const client = await loadApi();
    for (let tries = 1; ; tries++) {
      await limiter.take(throttler, { signal: ctx.signal, deadlineAt: ctx.deadlineAt });
      // Before the checks below, so that a slow one is checked too (helper-48).
      await beforeSend?.();
      await ctx.fence();
      // No request starts after the operation's deadline, and none outlives it.
      const left = ctx.deadlineAt - Date.now();
      if (left <= 0) throw new TransientError('deadline_passed', `${name}: the operation's deadline passed before this request could be sent`);
      const timeoutMs = Math.min(throttler === 'sandbox-create' ? settings.createTimeoutMs : settings.timeoutMs, left);
      try {
        return await request(client, requestOptions(ctx, timeoutMs));
      } catch (err) {
        if (isAxiosError(err) && err.response?.status === 429) {
          const { ms, throttlers } = retryAfterOf(err.response.headers as Record<string, unknown>);
          for (const t of throttlers.length ? throttlers : [throttler]) await limiter.holdOff(t, ms ?? 1_000);
        }
        if (!(isAxiosError(err) && err.cause instanceof FenceWindowError) || tries >= 3) throw err;
      }
    }
  };
  const call = async <T>(ctx: OperationContext, throttler: Throttler, request: Request<T>, beforeSend?: () => Promise<void>): Promise<T> => {
    try {
      return (await send(ctx, throttler, request, beforeSend)).data;
    } catch (err) {
      throw isStale(err) ? err : toProviderError(err);
    }
  };
  const toProviderError = (err: unknown): ProviderError => {
    if (err instanceof ProviderError) return err;
    if (isAxiosError(err) && err.response) {
      const data = err.response.data as { message?: unknown } | undefined;
      const message = typeof data?.message === 'string' ? data.message : err.message;
      const { ms } = retryAfterOf(err.response.headers as Record<string, unknown>);
      if (err.response.status === 404 && !isSandboxNotFound(err)) {
        return new PermanentError('unexpected_not_found', `${name}: ${message} (HTTP 404 that does not name a sandbox: check DAYTONA_API_URL)`);
      }
      return errorForStatus(name, err.response.status, message, ms === undefined ? undefined : String(ms / 1000));
    }
    return networkError(name, err) ?? new TransientError('provider_error', `${name}: ${(err as Error).message}`);
  };
  /**
   * Daytona says a sandbox does not exist with a 404 naming it ("Sandbox with ID or name x
   * not found"). Any other 404 (a wrong API URL, a gateway's own page) says nothing about the
   * sandbox, and reading it as "gone" would hand out false receipts.
   */
  const isSandboxNotFound = (err: unknown) => {
    if (!isAxiosError(err) || err.response?.status !== 404) return false;
    const data = err.response.data as { message?: unknown; code?: unknown } | undefined;
    return data?.code === 'SANDBOX_NOT_FOUND' || (typeof data?.message === 'string' && /^Sandbox with ID (or name )?.+ not found$/i.test(data.message));
  };

  const parseReply = (data: unknown): SandboxReply => {
    const parsed = SandboxReplySchema.safeParse(data);
    // Transient: a reply this client cannot read says nothing certain; read again later.
    if (!parsed.success) throw new TransientError('invalid_provider_reply', `${name}: unexpected sandbox reply: ${z.prettifyError(parsed.error)}`);
    return parsed.data;
  };
  /**
   * A fresh read by id or name; null when the sandbox does not exist (404). A sandbox that is
   * not the lease's company and environment's (or that lease-ops did not make: no labels) is
   * refused with lease_environment_mismatch and nothing of it is recorded or returned: a stop
   * or destroy of it must not end with a receipt while it runs on. A lookup by name before a
   * create records nothing and takes a foreign sandbox for none.
   */
  const read = async (ctx: OperationContext, idOrName: string, lookup = false): Promise<SandboxReply | null> => {
    // Refused before any request: another lease's calls must not meet this one's at the cloud.
    if (!lookup && idOrName !== daytonaSandboxName(ctx.jobId) && !looksLikeDaytonaId(idOrName)) {
      throw new PermanentError('not_a_sandbox_id', `${name}: ${idOrName} is not a sandbox id: name the sandbox by its id`);
    }
    try {
      const sb = parseReply((await send(ctx, 'authenticated', (api, o) => api.getSandbox(idOrName, org, undefined, o))).data);
      // Daytona finds a sandbox by its name too: a lease names its sandbox by id only, or the
      // same sandbox could be two leases (two lanes, their calls overlapping).
      // (An acquire reads its own sandbox by the name it gave it.)
      if (!lookup && sb.id !== idOrName && idOrName !== daytonaSandboxName(ctx.jobId)) {
        throw new PermanentError('not_a_sandbox_id', `${name}: ${idOrName} is not a sandbox id: name the sandbox by its id`);
      }
      if (!belongs(ctx, sb)) {
        if (lookup) return null;
        throw notThisEnvironments(idOrName);
      }
      ctx.observe(sb.id, daytonaState(sb));
      events?.sawRead(sb.id, sb.state ?? 'unknown');
      return sb;
    } catch (err) {
      if (isSandboxNotFound(err)) {
        if (!lookup) ctx.observe(idOrName, { kind: 'gone' });
        return null;
      }
      throw isStale(err) || err instanceof PermanentError ? err : toProviderError(err);
    }
  };
  const notThisEnvironments = (id: string) =>
    new PermanentError('lease_environment_mismatch', `${name}: sandbox ${id} is not one lease-ops made for this company and environment`);
  /** A resume reads a sandbox it cannot use as expired, whoever's it is. */
  const readForResume = (ctx: OperationContext, id: string) => read(ctx, id).catch((err: unknown) => (isMismatch(err) ? null : Promise.reject(err)));
  const belongs = (ctx: OperationContext, sb: SandboxReply) =>
    sb.labels?.[LABEL_COMPANY] === ctx.lease.companyId && sb.labels?.[LABEL_ENVIRONMENT] === ctx.lease.environmentId;
  const requireOwn = (ctx: OperationContext, sb: SandboxReply) => {
    if (!belongs(ctx, sb)) throw new PermanentError('lease_environment_mismatch', `${name}: sandbox ${sb.id} belongs to another environment`);
  };
  const settling = (sb: SandboxReply, doing: string) =>
    new SettlingError(`sandbox_${sb.state ?? 'unknown'}`, `${name}: sandbox ${sb.id} is ${sb.state ?? 'unknown'}; ${doing} once it settles`);
  // The lease's expiry is Daytona's own: when it destroys the sandbox whatever its state.
  const lease = (sb: SandboxReply, extra: Record<string, unknown> = {}): Lease => ({
    providerLeaseId: sb.id,
    metadata: { provider: 'daytona', name: sb.name ?? sb.id, ...extra },
    expiresAt: sb.autoDestroyAt && Number.isFinite(Date.parse(sb.autoDestroyAt)) ? new Date(sb.autoDestroyAt).toISOString() : null,
  });
  /**
   * Bounds a sandbox at `requestedExpiresAt` with Daytona's TTL (wall-clock, whatever the
   * state): the sandbox as read afterwards, whose autoDestroyAt is the lease's expiry. One
   * created with a TTL already is left as it is when that falls by the time asked for; a TTL
   * is counted from now, in whole minutes rounded down. With less than a minute left, or a
   * bound the service did not take, the lease has no expiry (the host then releases it).
   */
  const bounded = async (ctx: OperationContext, sb: SandboxReply, requestedExpiresAt: string | null | undefined): Promise<SandboxReply> => {
    if (!requestedExpiresAt) return sb;
    const until = Date.parse(requestedExpiresAt);
    const at = sb.autoDestroyAt ? Date.parse(sb.autoDestroyAt) : NaN;
    if (at <= until) return sb;
    const minutes = ttlMinutesUntil(until, Date.now());
    if (minutes === null) return { ...sb, autoDestroyAt: null };
    await call(ctx, 'authenticated', (api, o) => api.setTtl(sb.id, minutes, org, o));
    const after = await read(ctx, sb.id);
    if (!after) throw new SettlingError('sandbox_not_visible', `${name}: sandbox ${sb.id} is not readable after its TTL was set`);
    return after;
  };
  // Archiving moves a stopped sandbox's files away: nothing runs in it, as in stopped and archived.
  const isStopped = (sb: SandboxReply) => (daytonaState(sb).kind === 'stopped' && sb.state !== 'paused') || sb.state === 'archiving';

  /** Stops (or kills) a sandbox and gives a receipt only once a fresh read shows it stopped. */
  const stopConfirmed = async (ctx: OperationContext, id: string, force: boolean): Promise<TerminationReceipt> => {
    const before = await read(ctx, id);
    if (!before) return { providerLeaseId: id, state: 'destroyed' };
    requireOwn(ctx, before);
    if (isStopped(before)) return { providerLeaseId: id, state: 'stopped' };
    const state = daytonaState(before);
    const stoppable = state.kind === 'running' || before.state === 'paused';
    const stuckStopping = state.kind === 'transitioning' && state.toward === 'stopped';
    // A force this operation sent is left to take effect: sending it again while the sandbox
    // stops would only start its stop over (until FORCE_RESEND_MS passed without effect).
    const forcedAt = force && stuckStopping ? Number((await ctx.checkpoint.read()).forceSentAt) : NaN;
    const forcedRecently = Date.now() - forcedAt < FORCE_RESEND_MS;
    if (stoppable || (force && stuckStopping && !forcedRecently)) {
      try {
        await call(ctx, 'sandbox-lifecycle', (api, o) => api.stopSandbox(id, org, force, o));
        if (force) await ctx.checkpoint.write({ forceSentAt: String(Date.now()) });
      } catch (err) {
        // 400 "not in a stoppable state": it stopped meanwhile, or is in no state to stop;
        // the fresh read below tells which.
        if (!(err instanceof PermanentError && err.code === 'bad_request')) throw err;
      }
    } else if (!stuckStopping) {
      if (state.kind === 'transitioning') throw settling(before, 'stopping');
      if (state.kind === 'gone') return { providerLeaseId: id, state: 'destroyed' };
      throw new PermanentError('not_stoppable', `${name}: sandbox ${id} is ${before.state} and cannot be stopped`);
    }
    const after = await read(ctx, id);
    if (!after || daytonaState(after).kind === 'gone') return { providerLeaseId: id, state: 'destroyed' };
    if (isStopped(after)) return { providerLeaseId: id, state: 'stopped' };
    throw settling(after, force ? 'force-stop confirms' : 'stop confirms');
  };

  /** A retained sandbox must not be auto-deleted: that is confirmed before it is stopped (or killed). */
  const retainConfirmed = async (ctx: OperationContext, id: string, force: boolean): Promise<TerminationReceipt> => {
    const sb = await read(ctx, id);
    if (!sb) return { providerLeaseId: id, state: 'destroyed' };
    if (sb.autoDeleteInterval !== -1) {
      await call(ctx, 'authenticated', (api, o) => api.setAutoDeleteInterval(id, -1, org, o));
      const confirmed = await read(ctx, id);
      if (!confirmed) return { providerLeaseId: id, state: 'destroyed' };
      if (confirmed.autoDeleteInterval !== -1) throw new SettlingError('auto_delete_pending', `${name}: auto-delete of ${id} not yet disabled`);
    }
    return stopConfirmed(ctx, id, force);
  };

  /**
   * Stopped and retained, then archived (its files moved to cheaper storage; a start restores
   * it): the receipt (stopped) only once a fresh read shows `archived`.
   */
  const archiveConfirmed = async (ctx: OperationContext, id: string, force: boolean): Promise<TerminationReceipt> => {
    const before = await read(ctx, id);
    if (!before) return { providerLeaseId: id, state: 'destroyed' };
    if (before.state === 'archived' && before.desiredState !== 'started') return { providerLeaseId: id, state: 'stopped' };
    if (before.state === 'archiving' || before.desiredState === 'archived') throw settling(before, 'archive confirms');
    const stopped = await retainConfirmed(ctx, id, force);
    if (stopped.state === 'destroyed') return stopped;
    await call(ctx, 'sandbox-lifecycle', (api, o) => api.archiveSandbox(id, org, o));
    const after = await read(ctx, id);
    if (!after) return { providerLeaseId: id, state: 'destroyed' };
    if (after.state === 'archived') return { providerLeaseId: id, state: 'stopped' };
    throw settling(after, 'archive confirms');
  };

  const destroyConfirmed = async (ctx: OperationContext, id: string): Promise<TerminationReceipt> => {
    const before = await read(ctx, id);
    if (!before) return { providerLeaseId: id, state: 'destroyed' };
    requireOwn(ctx, before);
    if (before.desiredState !== 'destroyed') {
      try {
        await call(ctx, 'sandbox-lifecycle', (api, o) => api.deleteSandbox(id, org, o));
      } catch (err) {
        if (!(err instanceof PermanentError && err.code === 'not_found')) throw err; // 404: already gone
      }
    }
    const after = await read(ctx, id);
    if (!after || daytonaState(after).kind === 'gone') return { providerLeaseId: id, state: 'destroyed' };
    throw settling(after, 'destroy confirms');
  };

  /**
   * Sends the create. Whatever goes wrong once it may have left the process (a timeout, a
   * cut or unreadable reply, a 5xx), a read by the sandbox's name says whether it was made;
   * if that read fails too, the attempt is retried and its successor reads again. Nothing
   * in the create's reply is trusted: the fresh read is what counts.
   */
  const create = async (ctx: OperationContext, sandboxName: string, params: OperationParams['acquire']): Promise<SandboxReply | null> => {
    const ttl = params.requestedExpiresAt ? ttlMinutesUntil(Date.parse(params.requestedExpiresAt), Date.now()) : null;
    // When a create was sent (written as it goes, after its turn: one refused while it waited
    // was never sent): its clean-up, if it comes to that, waits out one that may still be on its way.
    const sending = () => ctx.checkpoint.write({ createSentAt: String(Date.now()) });
    try {
      await call(
        ctx,
        'sandbox-create',
        (api, o) =>
          api.createSandbox(
            {
              name: sandboxName,
              labels: { [LABEL_COMPANY]: ctx.lease.companyId, [LABEL_ENVIRONMENT]: ctx.lease.environmentId, [LABEL_RUN]: params.runId, ...hostLabels(params) },
              autoStopInterval: settings.autoStopMinutes,
              ...(snapshotFor(params) ? { snapshot: snapshotFor(params) } : {}),
              // Bound from the start; the acquire checks the expiry the service reports (bounded).
              ...(ttl === null ? {} : { ttlMinutes: ttl }),
            },
            org,
            o,
          ),
        sending,
      );
    } catch (err) {
      // Refused before anything was made: credentials, or the rate limit; or never sent (the
      // deadline passed while it waited for its turn: pacing.ts and send above).
      if (err instanceof ProviderError && (err.code === 'unauthorized' || err.code === 'rate_limited' || err.code === 'cancelled' || err.code === 'deadline_passed')) throw err;
      if (isStale(err)) throw err;
      const made = await read(ctx, sandboxName, true).catch(() => undefined);
      if (made) return made;
      if (made === undefined || !(err instanceof PermanentError)) {
        throw new TransientError('create_outcome_unknown', `${name}: create of ${sandboxName} may or may not have made a sandbox (${(err as Error).message}); its next attempt looks for it by name`);
      }
      throw err;
    }
    return read(ctx, sandboxName);
  };

  /** The snapshot of an acquire: its adapter type's, else the configured one, else Daytona's default. */
  const snapshotFor = (params: OperationParams['acquire']) =>
    // An own entry only: an adapter type like `constructor` must not reach Object.prototype.
    (params.adapterType && Object.hasOwn(settings.snapshotsByAdapter, params.adapterType) ? settings.snapshotsByAdapter[params.adapterType] : undefined) ?? settings.snapshot;

  return {
    name,
    // Daytona sizes a sandbox by its snapshot and refuses cpu, memory and disk with one; it
    // destroys a sandbox at its TTL whatever its state (expiry), and archives stopped ones.
    capabilities: { stop: true, pause: false, forceStop: true, expiry: true, resources: false, archive: true, exec: true },

    async acquire(ctx, params: OperationParams['acquire']): Promise<Lease> {
      if (params.requireExpiry && params.requestedExpiresAt && ttlMinutesUntil(Date.parse(params.requestedExpiresAt), Date.now()) === null) {
        // Refused before anything is made: Daytona counts a TTL in whole minutes from now.
        throw new PermanentError('expiry_unsupported', `${name}: ${params.requestedExpiresAt} is less than a minute away: Daytona cannot bound a sandbox that soon`);
      }
      const sandboxName = daytonaSandboxName(ctx.jobId);
      const sb = (await read(ctx, sandboxName, true)) ?? (await create(ctx, sandboxName, params));
      if (!sb) throw new SettlingError('sandbox_not_visible', `${name}: sandbox ${sandboxName} was created but is not readable yet`);
      requireOwn(ctx, sb);
      const state = daytonaState(sb);
      if (state.kind === 'running') {
        const final = await bounded(ctx, sb, params.requestedExpiresAt);
        return lease(final, params.adapterType ? { adapterType: params.adapterType, snapshot: snapshotFor(params) ?? null } : {});
      }
      if (state.kind === 'error' && state.recoverable) {
        await call(ctx, 'sandbox-lifecycle', (api, o) => api.recoverSandbox(sb.id, org, undefined, o));
        throw settling(sb, 'acquire completes after recovery');
      }
      if (state.kind === 'error') {
        // It will never run; failing for good queues its destroy (findAcquired).
        throw new PermanentError('sandbox_failed', `${name}: sandbox ${sb.id} failed to start: ${sb.errorReason ?? sb.state}`);
      }
      if (state.kind === 'stopped' && sb.state !== 'paused') {
        // It stopped by itself (auto-stop) before its acquire could hand it out.
        await call(ctx, 'sandbox-lifecycle', (api, o) => api.startSandbox(sb.id, org, o));
      }
      throw settling(sb, 'acquire completes');
    },

    async findAcquired(ctx, acquire) {
      const sb = await read(ctx, daytonaSandboxName(acquire.jobId), true);
      if (sb && belongs(ctx, sb) && daytonaState(sb).kind !== 'gone' && sb.desiredState !== 'destroyed') return sb.id;
      // A create sent less than a timeout ago may not have reached Daytona yet: look again later.
      const sentAt = Number(acquire.checkpoint?.createSentAt);
      if (Number.isFinite(sentAt) && Date.now() - sentAt < settings.createTimeoutMs * 1.5) {
        throw new SettlingError('create_may_be_in_flight', `${name}: a create sent ${Date.now() - sentAt} ms ago may still arrive; looking again later`);
      }
      return null;
    },

    async resume(ctx, params): Promise<Lease | ExpiredLease> {
      const expired: ExpiredLease = { providerLeaseId: null, metadata: { expired: true } };
      const sb = await readForResume(ctx, params.providerLeaseId);
      if (!sb) return expired;
      const state = daytonaState(sb);
      switch (state.kind) {
        case 'running':
          return lease(sb, { resumed: true });
        case 'gone':
          return expired;
        case 'stopped':
          await call(ctx, 'sandbox-lifecycle', (api, o) => api.startSandbox(sb.id, org, o));
          break;
        case 'error':
          if (sb.state === 'build_failed') return expired;
          if (!state.recoverable) throw new PermanentError('sandbox_unrecoverable', `${name}: sandbox ${sb.id} is in error: ${sb.errorReason ?? 'unknown'}`);
          await call(ctx, 'sandbox-lifecycle', (api, o) => api.recoverSandbox(sb.id, org, undefined, o));
          break;
        case 'transitioning':
          if (state.toward === 'gone') return expired;
          throw settling(sb, 'resume');
      }
      const after = await read(ctx, sb.id);
      if (!after) return expired;
      if (daytonaState(after).kind === 'running') return lease(after, { resumed: true });
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
            if (!sb) return { providerLeaseId: id, state: 'destroyed' };
            const kind = daytonaState(sb).kind;
            if (kind === 'running') return null;
            if (kind === 'gone') return { providerLeaseId: id, state: 'destroyed' };
            if (isStopped(sb)) return { providerLeaseId: id, state: 'stopped' };
            throw settling(sb, 'release confirms');
          },
          stopAndRetain: () => retainConfirmed(ctx, id, false),
          forceStopAndRetain: () => retainConfirmed(ctx, id, true),
          archive: () => archiveConfirmed(ctx, id, params.cancelActiveWork),
        },
        name,
      );
    },

    stop: (ctx, params) => stopConfirmed(ctx, params.providerLeaseId, false),
    forceStop: (ctx, params) => stopConfirmed(ctx, params.providerLeaseId, true),
    destroy: (ctx, params) => destroyConfirmed(ctx, params.providerLeaseId),

    async status(ctx, params): Promise<SandboxState> {
      const sb = await read(ctx, params.providerLeaseId);
      return sb ? daytonaState(sb) : { kind: 'gone' };
    },

    // A command inside the sandbox: the lease's own running sandbox only (its labels are read first).
    async exec(ctx, sandboxId, request, { graceMs }) {
      const sb = await read(ctx, sandboxId);
      if (!sb) throw new PermanentError('sandbox_gone', `${name}: sandbox ${sandboxId} does not exist`);
      if (daytonaState(sb).kind !== 'running') throw new PermanentError('sandbox_not_running', `${name}: sandbox ${sandboxId} is not running (${sb.state ?? 'unknown'}): resume it first`);
      const { daytonaExec } = await import('./exec.ts');
      return daytonaExec(
        {
          name,
          apiKey: settings.apiKey,
          organizationId: org,
          timeoutMs: settings.timeoutMs,
          proxyUrl: async (c, id) => (await call(c, 'authenticated', (api, o) => api.getToolboxProxyUrl(id, org, o))).url,
          pace: (c) => limiter.take('authenticated', { deadlineAt: c.deadlineAt }),
        },
        ctx,
        sb.id,
        request,
        graceMs,
      );
    },

    ...(events
      ? {
          waitForChange: (ctx: OperationContext, id: string, seen: SandboxState, opts: { since: number; timeoutMs: number; signal: AbortSignal }) =>
            events.waitForChange(id, daytonaStateName(seen), opts.since, opts.timeoutMs, opts.signal, () => ctx.log),
          close: async () => events.close(),
        }
      : {}),

    // One page of one sandbox: the cheapest read that needs the key (and the organization).
    async probe(ctx) {
      try {
        // listSandboxes takes 30 filters before its options, all left out here but the page size.
        await call(ctx, 'authenticated', (api, o) => {
          const list = api.listSandboxes.bind(api) as (...args: unknown[]) => ReturnType<typeof api.listSandboxes>;
          return list(org, undefined, 1, ...new Array<undefined>(27).fill(undefined), o);
        });
        return { ok: true, code: 'ok', message: `${name}: the service takes the API key${org ? ' for the organization' : ''}` };
      } catch (err) {
        return probeFailure(err);
      }
    },
  };
}
