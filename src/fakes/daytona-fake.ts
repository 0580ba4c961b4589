import { randomUUID } from 'node:crypto';
import type { Server as SocketServer } from 'socket.io';
import { DaytonaToolbox } from './daytona-toolbox.ts';
import { seededRandom } from './seeded-random.ts';
import { ApiFake, WindowLimit, type FakeReply, type FakeRequest, type Transitioning } from './http-fake.ts';

/**
 * Daytona's sandbox states (its OpenAPI `SandboxState`, @daytona/api-client 0.218.0). The
 * fake stores the server's *actual* state; what it reports is derived from it and the
 * desired state exactly as the server's SandboxDto.getSandboxState does.
 */
export const DAYTONA_STATES = [
  'creating', 'restoring', 'destroyed', 'destroying', 'started', 'stopped', 'starting', 'stopping', 'error', 'build_failed',
  'pending_build', 'building_snapshot', 'unknown', 'pulling_snapshot', 'archived', 'archiving', 'resizing', 'snapshotting',
  'forking', 'pausing', 'paused', 'resuming',
] as const;
export type DaytonaState = (typeof DAYTONA_STATES)[number];
type DesiredState = 'destroyed' | 'started' | 'stopped' | 'resized' | 'archived' | 'paused';

/** How long transitions take, in ms. */
export interface DaytonaTimings {
  create: number;
  start: number;
  stop: number;
  forceStop: number;
  destroy: number;
  archive: number;
}

/** What a test can tell the fake to do to one sandbox. */
export interface SandboxControls {
  /** A graceful stop stays `stopping` this long (a process that ignores SIGTERM). */
  stuckStoppingMs?: number;
  /** Answer this many force stops with 409, as Daytona may while a state change runs. */
  refuseForceStops?: number;
  /** Answer the next requests for this sandbox with these statuses, in order. */
  failNext?: { status: number; retryAfterS?: number }[];
  /** The sandbox is gone: every request answers 404 (as after an out-of-band delete). */
  lost?: boolean;
  /** Until this time (epoch ms), start and stop answer 409 with this message (cancelled
   *  work still settling, as the reference plugin reported it). */
  conflictUntil?: { at: number; message: string };
  /** Put the sandbox into `error`, recoverable or not. */
  error?: { recoverable: boolean; reason: string };
  /** Put the sandbox into this state as the server stores it (any of DAYTONA_STATES, or a
   *  state this client has never heard of), with no transition running. */
  state?: string;
  /** With `state`: the desired state to report beside it (by default a stable state is its own goal). */
  desiredState?: string;
  /** Answer every request for this sandbox this much later (a slow or congested API). */
  replyDelayMs?: number;
}

interface FakeSandbox extends Transitioning<string> {
  id: string;
  name: string;
  organizationId: string;
  labels: Record<string, string>;
  desiredState: DesiredState;
  cpu: number;
  memory: number;
  disk: number;
  autoStopInterval: number;
  autoArchiveInterval: number;
  autoDeleteInterval: number;
  /** When the TTL destroys it whatever its state (epoch ms), or null without a TTL. */
  autoDestroyAt: number | null;
  recoverable: boolean;
  errorReason: string | null;
  /** Null until a runner first reported the sandbox started. */
  daemonVersion: string | null;
  controls: SandboxControls;
  createdAt: string;
  updatedAt: string;
  forceStops: number;
}

/**
 * Faults injected at random (seeded) into requests on existing sandboxes, as a busy cloud
 * answers: `settling` a 409 "state change in progress" to a start, stop or delete;
 * `transient` a 503 or 429 with Retry-After to any request.
 */
export interface DaytonaFaults {
  seed: number;
  settling: number;
  transient: number;
}

/** Daytona's throttlers, counted per organization (per API key here) across all routes. */
export type DaytonaThrottler = 'authenticated' | 'sandbox-create' | 'sandbox-lifecycle';

export interface DaytonaFakeOptions {
  apiKey?: string;
  /**
   * Runs toolbox commands (exec) as real processes on this machine. Off by default: whoever
   * can call the fake could run anything here.
   */
  execOnThisMachine?: boolean;
  organizationId?: string;
  timings?: Partial<DaytonaTimings>;
  /** How long each transition to `to` takes, drawn per transition (the bench's seeded 1-5 s); the timings otherwise. */
  transitionMs?: (to: string, ms: number) => number;
  faults?: DaytonaFaults;
  /** Per-throttler limits; none by default. */
  rateLimits?: Partial<Record<DaytonaThrottler, { limit: number; windowMs: number }>>;
  /** Fields newer servers send that this client does not know; merged into every sandbox reply. */
  extraFields?: Record<string, unknown>;
  /**
   * Serves Daytona's notification gateway (socket.io at <url>/socket.io/, as Daytona's at
   * /api/socket.io/ beside its /api routes; websocket only),
   * which pushes `sandbox.state.updated` to the sockets of the sandbox's organization. Off
   * by default: the simulated cloud, the bench and the push tests turn it on.
   */
  notifications?: boolean;
}

const DEFAULT_TIMINGS: DaytonaTimings = { create: 20, start: 20, stop: 20, forceStop: 0, destroy: 10, archive: 20 };
/** Documented in the 0.218.0 spec, unknown to lease-ops' reply schema: a reply carries more than a client expects. */
const DEFAULT_EXTRA_FIELDS = { autoPauseInterval: 0, kvm: false };
const ERRORED = new Set(['error', 'build_failed']);
const HTTP_NAMES: Record<number, string> = {
  400: 'Bad Request', 401: 'Unauthorized', 403: 'Forbidden', 404: 'Not Found', 409: 'Conflict', 429: 'Too Many Requests',
  500: 'Internal Server Error', 502: 'Bad Gateway', 503: 'Service Unavailable', 504: 'Gateway Timeout',
};
const API_CODES: Record<number, string> = {
  400: 'BAD_REQUEST', 401: 'UNAUTHORIZED', 403: 'FORBIDDEN', 404: 'NOT_FOUND', 409: 'CONFLICT', 429: 'RATE_LIMIT_EXCEEDED', 500: 'INTERNAL_SERVER_ERROR',
};

/**
 * A local Daytona API over real HTTP, built from Daytona's server code and OpenAPI document
 * (apps/api: SandboxDto.fromSandbox, sandbox.entity.ts, sandbox.service.ts, the global
 * exception filter and the named throttlers; see docs/providers.md for the sources):
 *
 * - Replies are the full sandbox DTO in the server's field order. Nullable columns come back
 *   as `null` (errorReason, networkAllowList, domainAllowList, daemonVersion, runnerId while
 *   archived), columns the DTO maps with `?? undefined` are left out, and fields newer than
 *   this client (`extraFields`) are present.
 * - The reported state is derived from the stored one and the desired state (started and
 *   desired stopped reads `stopping`; unknown and desired started reads `creating`).
 * - Create answers 200 at once with `creating`; names are unique per organization (409);
 *   GET and every action take an id or a name; delete answers the sandbox as `destroying`
 *   and renames it `DESTROYED_<name>_<ms>`; a destroyed sandbox answers 404.
 * - 409 "Sandbox state change in progress" while the state differs from the desired one; 400
 *   "Sandbox is not in a stoppable state" / "not in valid state" / "in an errored state".
 * - Error bodies `{statusCode, source, code, message, error, path, timestamp, method}`.
 * - 429 per throttler with `Retry-After-<throttler>` and `X-RateLimit-*-<throttler>` headers.
 *
 * One behaviour is assumed rather than read from server code (the public server predates
 * it): `stop?force=true` on a sandbox still `stopping` kills it (SIGKILL) instead of 409.
 */
export class DaytonaFake extends ApiFake {
  readonly sandboxes = new Map<string, FakeSandbox>();
  private timings: DaytonaTimings;
  private readonly random: (() => number) | null;
  private readonly limits = new Map<DaytonaThrottler, WindowLimit>();
  private readonly extraFields: Record<string, unknown>;
  /** The API keys this organization takes (none set: any); rotated by acceptKeys. */
  private apiKeys: Set<string> | null;
  /** Requests per API key presented (accepted or not). */
  readonly requestsByKey = new Map<string, number>();
  /** The sandboxes' process sessions (the toolbox behind GET /sandbox/{id}/toolbox-proxy-url). */
  readonly toolbox = new DaytonaToolbox();

  constructor(private readonly opts: DaytonaFakeOptions = {}) {
    super((req) => {
      const result = this.route(req);
      const sb = result.sandboxId === null ? undefined : this.sandboxes.get(result.sandboxId);
      if (sb) this.announce(sb);
      return result;
    });
    this.timings = { ...DEFAULT_TIMINGS, ...opts.timings };
    this.random = opts.faults ? seededRandom(opts.faults.seed) : null;
    for (const [name, l] of Object.entries(opts.rateLimits ?? {})) this.limits.set(name as DaytonaThrottler, new WindowLimit(l.limit, l.windowMs));
    this.extraFields = opts.extraFields ?? DEFAULT_EXTRA_FIELDS;
    this.apiKeys = opts.apiKey ? new Set([opts.apiKey]) : null;
  }

  override async listen(port = 0, host?: string): Promise<string> {
    const url = await super.listen(port, host);
    if (this.opts.notifications) await this.openGateway();
    return url;
  }

  override async close(): Promise<void> {
    this.toolbox.close();
    for (const timer of this.transitionTimers) clearTimeout(timer);
    this.transitionTimers.clear();
    const gateway = this.gateway;
    this.gateway = null;
    if (gateway) {
      gateway.disconnectSockets(true);
      // socket.io's close also closes the HTTP server it is attached to: the fake closes that itself.
      gateway.engine.close();
    }
    return super.close();
  }

  private gateway: SocketServer | null = null;
  private readonly transitionTimers = new Set<NodeJS.Timeout>();
  /** The state each sandbox was last announced in, by id. */
  private readonly announced = new Map<string, string>();
  /** Sockets refused at the gateway's handshake (wrong or missing token). */
  gatewayRefusals = 0;

  /**
   * NotificationGateway, as apps/api has it: the handshake's `auth.token` is checked, the
   * socket joins its `organizationId` query's room, and sandbox events go to the sandbox's
   * organization's room only (a socket that names no organization hears none of them).
   */
  private async openGateway(): Promise<void> {
    const { Server } = await import('socket.io');
    // Under the API's own address, as Daytona's /api/socket.io/ (the fake's routes are its /api).
    const gateway = new Server(this.http.nodeServer, { path: '/socket.io/', transports: ['websocket'], serveClient: false });
    gateway.use((socket, next) => {
      const token: unknown = socket.handshake.auth.token;
      if (typeof token !== 'string' || token === '' || (this.apiKeys && !this.apiKeys.has(token))) {
        this.gatewayRefusals++;
        next(new Error('Unauthorized'));
        return;
      }
      const organizationId = socket.handshake.query.organizationId;
      if (typeof organizationId === 'string' && organizationId !== '') void socket.join(organizationId);
      next();
    });
    this.gateway = gateway;
  }

  /** Sockets connected to the gateway now. */
  gatewaySockets(): number {
    return this.gateway?.engine.clientsCount ?? 0;
  }

  /** Pushes `sandbox.state.updated` if the state a client would read changed since it was last pushed. */
  private announce(sb: FakeSandbox): void {
    if (!this.gateway) return;
    this.settle(sb);
    const state = sb.state === 'destroyed' ? 'destroyed' : reportedState(sb);
    const before = this.announced.get(sb.id);
    if (before === state) return;
    this.announced.set(sb.id, state);
    if (before === undefined) this.gateway.to(sb.organizationId).emit('sandbox.created', this.view(sb, { withRelations: false }));
    else this.gateway.to(sb.organizationId).emit('sandbox.state.updated', { sandbox: this.view(sb, { withRelations: false }), oldState: before, newState: state });
  }

  /** Announces a transition's end when it is due (the runner reporting its new state). */
  private announceAt(sb: FakeSandbox, at: number): void {
    if (!this.gateway) return;
    const timer = setTimeout(() => {
      this.transitionTimers.delete(timer);
      // A timer may fire a millisecond before Date.now() reaches `at`: the transition would not end yet.
      if (Date.now() < at) this.announceAt(sb, at);
      else this.announce(sb);
    }, Math.max(0, at - Date.now()));
    timer.unref();
    this.transitionTimers.add(timer);
  }

  /** Changes how long transitions take from now on. */
  setTimings(timings: Partial<DaytonaTimings>): void {
    this.timings = { ...this.timings, ...timings };
  }

  /** From now on only these API keys are accepted (a key revoked or added in Daytona's dashboard). */
  acceptKeys(...keys: string[]): void {
    this.apiKeys = new Set(keys);
  }

  /** Every sandbox created so far and not destroyed. */
  ids(): string[] {
    return [...this.sandboxes.values()].filter((sb) => (this.settle(sb), sb.state !== 'destroyed')).map((sb) => sb.id);
  }

  /** Changes how one sandbox behaves from now on. */
  control(idOrName: string, controls: SandboxControls): void {
    const sb = this.find(idOrName);
    if (!sb) throw new Error(`no sandbox ${idOrName}`);
    Object.assign(sb.controls, controls);
    if (controls.error) {
      sb.state = 'error';
      sb.transition = null;
      sb.recoverable = controls.error.recoverable;
      sb.errorReason = controls.error.reason;
    }
    if (controls.state !== undefined) {
      sb.state = controls.state;
      sb.transition = null;
      // A stable state is where the sandbox was headed; a transitional one keeps its goal.
      if (['started', 'stopped', 'archived', 'paused'].includes(controls.state)) sb.desiredState = controls.state as DesiredState;
      if (controls.desiredState !== undefined) sb.desiredState = controls.desiredState as DesiredState;
    }
    this.announce(sb);
  }

  /** The sandbox's state now, as the API reports it (after any transition that is due). */
  stateOf(idOrName: string): string {
    const sb = this.find(idOrName);
    if (!sb || sb.controls.lost) return 'gone';
    this.settle(sb);
    if (sb.state === 'destroyed') return 'gone';
    return reportedState(sb);
  }

  private find(idOrName: string): FakeSandbox | undefined {
    const byId = this.sandboxes.get(idOrName);
    if (byId) return byId;
    for (const sb of this.sandboxes.values()) if (sb.name === idOrName) return sb;
    return undefined;
  }

  /** The sandbox as GET finds it: destroyed ones, and errored ones marked for deletion, are not found. */
  private visible(idOrName: string): FakeSandbox | undefined {
    const sb = this.find(idOrName);
    if (!sb || sb.controls.lost) return undefined;
    this.settle(sb);
    if (sb.state === 'destroyed' || (ERRORED.has(sb.state) && sb.desiredState === 'destroyed')) return undefined;
    return sb;
  }

  private settle(sb: FakeSandbox): void {
    // The TTL ends it whatever its state (OpenAPI: `ttlMinutes`, `autoDestroyAt`).
    if (sb.autoDestroyAt !== null && Date.now() >= sb.autoDestroyAt && sb.state !== 'destroyed') {
      sb.state = 'destroyed';
      sb.desiredState = 'destroyed';
      sb.transition = null;
      sb.name = `DESTROYED_${sb.name}_${Date.now()}`;
    }
    if (!this.settleTransition(sb)) return;
    sb.updatedAt = new Date().toISOString();
    if (sb.state === 'started') sb.daemonVersion ??= 'v0.5.0';
  }

  /** When each sandbox's latest transition ends (epoch ms), by id: when it reaches the state it was sent to. */
  readonly transitionEnds = new Map<string, number>();

  private begin(sb: FakeSandbox, to: string, ms: number): void {
    // The stored state stays until the runner reports the new one; the reply derives the
    // transitional state from it and the desired state.
    const at = Date.now() + Math.max(0, this.opts.transitionMs ? this.opts.transitionMs(to, ms) : ms);
    sb.transition = { to, at };
    this.transitionEnds.set(sb.id, at);
    sb.updatedAt = new Date().toISOString();
    this.settle(sb);
    this.announceAt(sb, at);
  }

  private error(req: FakeRequest, status: number, message: string, headers?: Record<string, string>): FakeReply {
    return {
      status,
      headers,
      body: {
        statusCode: status,
        source: 'DAYTONA_API',
        code: API_CODES[status] ?? (status >= 500 ? 'INTERNAL_SERVER_ERROR' : 'BAD_REQUEST'),
        message,
        error: HTTP_NAMES[status] ?? 'Error',
        path: `/api${req.path}`,
        timestamp: new Date().toISOString(),
        method: req.method,
      },
    };
  }

  /** SandboxDto.fromSandbox, field for field and in its order. */
  private view(sb: FakeSandbox, opts: { withRelations: boolean }) {
    const state = reportedState(sb);
    return {
      id: sb.id,
      organizationId: sb.organizationId,
      name: sb.name,
      target: 'us',
      snapshot: 'daytonaio/sandbox:0.5.0',
      user: 'daytona',
      env: {},
      cpu: sb.cpu,
      gpu: 0,
      memory: sb.memory,
      disk: sb.disk,
      public: false,
      networkBlockAll: false,
      networkAllowList: null,
      domainAllowList: null,
      labels: sb.labels,
      volumes: [],
      state,
      desiredState: sb.desiredState,
      errorReason: sb.errorReason,
      recoverable: sb.recoverable,
      backupState: 'None',
      autoStopInterval: sb.autoStopInterval,
      autoArchiveInterval: sb.autoArchiveInterval,
      autoDeleteInterval: sb.autoDeleteInterval,
      // Mapped with `?? undefined`: left out without a TTL.
      ...(sb.autoDestroyAt === null ? {} : { autoDestroyAt: new Date(sb.autoDestroyAt).toISOString() }),
      sandboxClass: 'container',
      createdAt: sb.createdAt,
      updatedAt: sb.updatedAt,
      // Only GET loads the lastActivityAt relation; create and the actions reply without it.
      ...(opts.withRelations ? { lastActivityAt: sb.updatedAt } : {}),
      daemonVersion: sb.daemonVersion,
      runnerId: sb.state === 'archived' || sb.state === 'destroyed' ? null : '0a9b8c7d-6e5f-4a3b-2c1d-0e9f8a7b6c5d',
      toolboxProxyUrl: 'https://proxy.app.daytona.io/toolbox',
      ...this.extraFields,
    };
  }

  /** Which throttler a request counts against, as the API's controller scopes them. */
  private throttlerOf(method: string, path: string): DaytonaThrottler {
    if (method === 'POST' && path === '/sandbox') return 'sandbox-create';
    if (method === 'DELETE' || /\/(start|stop|archive)$/.test(path)) return 'sandbox-lifecycle';
    return 'authenticated';
  }

  private throttled(req: FakeRequest, key: string): FakeReply | null {
    const name = this.throttlerOf(req.method, req.path);
    const limit = this.limits.get(name);
    if (!limit) return null;
    const retryAfterS = limit.take(key);
    if (retryAfterS === null) return null;
    return this.error(req, 429, 'ThrottlerException: Too Many Requests', {
      [`retry-after-${name}`]: String(retryAfterS),
      [`x-ratelimit-limit-${name}`]: String(limit.limit),
      [`x-ratelimit-remaining-${name}`]: '0',
      [`x-ratelimit-reset-${name}`]: String(retryAfterS),
    });
  }

  private route(req: FakeRequest) {
    const { method, path, query, body } = req;
    const none = (reply: FakeReply) => ({ reply, sandboxId: null });
    const auth = req.headers.authorization;
    const presented = auth?.startsWith('Bearer ') ? auth.slice('Bearer '.length) : '';
    this.requestsByKey.set(presented, (this.requestsByKey.get(presented) ?? 0) + 1);
    if (this.apiKeys && !this.apiKeys.has(presented)) return none(this.error(req, 401, 'Unauthorized'));
    const limited = this.throttled(req, auth ?? '');
    if (limited) return none(limited);

    if (method === 'POST' && path === '/sandbox') {
      return this.createWithFault(body, (bootMs) => this.create(req, body, bootMs ?? this.timings.create));
    }
    if (method === 'GET' && path === '/sandbox') return none(this.list(query));
    // The toolbox: its address per sandbox, then the daemon's routes under it. Its calls are
    // not lifecycle calls (an exec runs beside them), so they name no sandbox in the call log.
    const proxy = /^\/sandbox\/([^/]+)\/toolbox-proxy-url$/.exec(path);
    if (proxy && method === 'GET') {
      const sb = this.visible(decodeURIComponent(proxy[1]!));
      if (!sb) return none(this.error(req, 404, `Sandbox with ID or name ${decodeURIComponent(proxy[1]!)} not found`));
      return none({ status: 200, body: { url: `${this.http.url}/toolbox` } });
    }
    const toolbox = /^\/toolbox\/([^/]+)(\/.*)$/.exec(path);
    if (toolbox) {
      const sb = this.visible(decodeURIComponent(toolbox[1]!));
      if (!sb) return none(this.error(req, 404, `Sandbox with ID or name ${decodeURIComponent(toolbox[1]!)} not found`));
      if (!this.opts.execOnThisMachine) return none(this.error(req, 403, 'this simulated cloud runs no commands (LEASE_OPS_SIMULATED_EXEC is off)'));
      if (sb.state !== 'started' || sb.desiredState !== 'started') return none(this.error(req, 400, 'Sandbox is not started'));
      return none(this.toolbox.route(method, sb.id, toolbox[2]!, body));
    }
    const m = /^\/sandbox\/([^/]+)(?:\/(start|stop|recover|autodelete|ttl|archive)(?:\/(-?\d+))?)?$/.exec(path);
    if (!m) return none(this.error(req, 404, `Cannot ${method} /api${path}`));
    const [, idOrName, action, arg] = m;
    const sb = this.visible(decodeURIComponent(idOrName!));
    if (!sb) return none(this.error(req, 404, `Sandbox with ID or name ${decodeURIComponent(idOrName!)} not found`));
    const reply = (r: FakeReply) => ({ reply: sb.controls.replyDelayMs ? { ...r, delayMs: sb.controls.replyDelayMs } : r, sandboxId: sb.id });

    const failure = sb.controls.failNext?.shift();
    if (failure) {
      const headers = failure.retryAfterS !== undefined ? { 'retry-after': String(failure.retryAfterS) } : undefined;
      return reply(this.error(req, failure.status, `injected ${failure.status}`, headers));
    }
    const faults = this.opts.faults;
    if (faults && this.random) {
      const roll = this.random();
      if (roll < faults.transient) {
        const status = roll < faults.transient / 2 ? 503 : 429;
        return { ...reply(this.error(req, status, `injected ${status}`, { 'retry-after': '0' })), injected: true };
      }
      if (roll < faults.transient + faults.settling && (method === 'DELETE' || action === 'start' || action === 'stop')) {
        return { ...reply(this.error(req, 409, 'Sandbox state change in progress')), injected: true };
      }
    }

    if (method === 'GET' && !action) return reply({ status: 200, body: this.view(sb, { withRelations: true }) });
    if (method === 'DELETE' && !action) return reply(this.destroy(req, sb));
    if (method !== 'POST') return reply(this.error(req, 404, `Cannot ${method} /api${path}`));

    const conflict = sb.controls.conflictUntil;
    if (conflict && Date.now() < conflict.at && (action === 'start' || action === 'stop')) {
      return reply(this.error(req, 409, conflict.message));
    }
    switch (action) {
      case 'autodelete':
        sb.autoDeleteInterval = Number(arg);
        return reply({ status: 200, body: this.view(sb, { withRelations: false }) });
      case 'ttl': {
        // "Maximum time to live in minutes, re-anchored from the current time (0 to disable)".
        const minutes = Number(arg);
        if (!Number.isInteger(minutes) || minutes < 0) return reply(this.error(req, 400, 'TTL must be a non-negative number of minutes'));
        sb.autoDestroyAt = minutes === 0 ? null : Date.now() + minutes * 60_000;
        return reply({ status: 200, body: this.view(sb, { withRelations: false }) });
      }
      case 'archive':
        return reply(this.archive(req, sb));
      case 'start':
        return reply(this.start(req, sb));
      case 'recover':
        if (!sb.recoverable) return reply(this.error(req, 400, 'Sandbox is not in a recoverable state'));
        if (!ERRORED.has(sb.state)) return reply(this.error(req, 400, 'Sandbox must be in error state to recover'));
        sb.errorReason = null;
        sb.recoverable = false;
        sb.state = 'stopped';
        sb.desiredState = 'started';
        this.begin(sb, 'started', this.timings.start);
        return reply({ status: 200, body: this.view(sb, { withRelations: false }) });
      case 'stop':
        return reply(this.stop(req, sb, query.get('force') === 'true'));
      default:
        return reply(this.error(req, 404, `Cannot ${method} /api${path}`));
    }
  }

  /** SandboxService.start: idempotent on a started sandbox, 400 errored, 409 pending. */
  private start(req: FakeRequest, sb: FakeSandbox): FakeReply {
    if (sb.state === 'started' && sb.desiredState === 'started') return { status: 200, body: this.view(sb, { withRelations: false }) };
    // A command the stop cancelled that has not exited yet (seed 000).
    if (this.toolbox.alive(sb.id) > 0) return this.error(req, 409, 'The stopped Daytona sandbox is still settling cancelled work. Retry shortly.');
    if (ERRORED.has(sb.state)) return this.error(req, 400, 'Sandbox is in an errored state');
    if (sb.state !== sb.desiredState || sb.transition) return this.error(req, 409, 'Sandbox state change in progress');
    if (!['stopped', 'archived', 'archiving', 'paused'].includes(sb.state)) return this.error(req, 400, 'Sandbox is not in valid state');
    sb.desiredState = 'started';
    this.begin(sb, 'started', this.timings.start);
    return { status: 200, body: this.view(sb, { withRelations: false }) };
  }

  /** SandboxService.stop, plus SIGKILL for a stop that SIGTERM did not finish (assumed; see the class comment). */
  private stop(req: FakeRequest, sb: FakeSandbox, force: boolean): FakeReply {
    if (ERRORED.has(sb.state)) return this.error(req, 400, 'Sandbox is in an errored state');
    if (force && sb.state === 'started' && sb.desiredState === 'stopped') {
      if ((sb.controls.refuseForceStops ?? 0) > sb.forceStops++) return this.error(req, 409, 'Sandbox state change in progress');
      this.begin(sb, 'stopped', this.timings.forceStop);
      return { status: 200, body: this.view(sb, { withRelations: false }) };
    }
    if (sb.state !== sb.desiredState || sb.transition) return this.error(req, 409, 'Sandbox state change in progress');
    if (sb.state !== 'started' && sb.state !== 'paused') return this.error(req, 400, 'Sandbox is not in a stoppable state');
    if (force && (sb.controls.refuseForceStops ?? 0) > sb.forceStops++) return this.error(req, 409, 'Sandbox state change in progress');
    if (sb.autoDeleteInterval === 0) return this.destroy(req, sb); // an ephemeral sandbox is deleted on stop
    sb.desiredState = 'stopped';
    this.begin(sb, 'stopped', force ? this.timings.forceStop : (sb.controls.stuckStoppingMs ?? this.timings.stop));
    // Its processes are told to end; one that ignores it runs on until the sandbox has
    // stopped, which kills what is left (a stopped sandbox runs nothing).
    const stopMs = force ? this.timings.forceStop : (sb.controls.stuckStoppingMs ?? this.timings.stop);
    this.toolbox.signal(sb.id, force ? 'SIGKILL' : 'SIGTERM');
    setTimeout(() => this.toolbox.signal(sb.id, 'SIGKILL'), stopMs).unref();
    return { status: 200, body: this.view(sb, { withRelations: false }) };
  }

  /** Archive: a stopped sandbox's files move to cheaper storage (archiving, then archived); start restores it. */
  private archive(req: FakeRequest, sb: FakeSandbox): FakeReply {
    if (sb.state !== sb.desiredState || sb.transition) return this.error(req, 409, 'Sandbox state change in progress');
    if (sb.state === 'archived') return { status: 200, body: this.view(sb, { withRelations: false }) };
    if (sb.state !== 'stopped') return this.error(req, 400, 'Sandbox is not in a valid state to be archived');
    sb.desiredState = 'archived';
    this.begin(sb, 'archived', this.timings.archive);
    return { status: 200, body: this.view(sb, { withRelations: false }) };
  }

  /** SandboxService.destroy: a soft delete that frees the name at once. */
  private destroy(req: FakeRequest, sb: FakeSandbox): FakeReply {
    const pending = !ERRORED.has(sb.state) && (sb.state !== sb.desiredState || sb.transition !== null);
    if (pending) return this.error(req, 409, 'Sandbox state change in progress');
    sb.desiredState = 'destroyed';
    sb.name = `DESTROYED_${sb.name}_${Date.now()}`;
    this.toolbox.signal(sb.id, 'SIGKILL');
    this.begin(sb, 'destroyed', this.timings.destroy);
    if (sb.state === 'destroyed') return { status: 200, body: { ...this.view(sb, { withRelations: false }), state: 'destroyed' } };
    return { status: 200, body: this.view(sb, { withRelations: false }) };
  }

  /** GET /sandbox (0.218.0): `{items, nextCursor}`, labels as JSON containment, destroyed left out. */
  private list(query: URLSearchParams): FakeReply {
    let labels: Record<string, string> = {};
    const raw = query.get('labels');
    if (raw) {
      try {
        labels = JSON.parse(raw) as Record<string, string>;
      } catch {
        return { status: 400, body: { statusCode: 400, message: 'Invalid labels JSON format', error: 'Bad Request' } };
      }
    }
    const name = query.get('name')?.toLowerCase();
    const limit = Math.min(200, Math.max(1, Number(query.get('limit') ?? 100)));
    const offset = Number(query.get('cursor') ?? 0);
    const matching = [...this.sandboxes.values()].filter((sb) => {
      this.settle(sb);
      if (sb.state === 'destroyed' || sb.controls.lost) return false;
      if (ERRORED.has(sb.state) && sb.desiredState === 'destroyed') return false;
      if (name && !sb.name.toLowerCase().startsWith(name)) return false;
      return Object.entries(labels).every(([k, v]) => sb.labels[k] === v);
    });
    const page = matching.slice(offset, offset + limit);
    const items = page.map((sb) => {
      const { env: _env, volumes: _volumes, ...item } = this.view(sb, { withRelations: false });
      return { ...item, state: sb.state === 'archived' && sb.desiredState === 'started' ? 'restoring' : item.state };
    });
    return { status: 200, body: { items, nextCursor: offset + limit < matching.length ? String(offset + limit) : null } };
  }

  private create(req: FakeRequest, body: unknown, bootMs: number): { reply: FakeReply; sandboxId: string | null } {
    const input = (body ?? {}) as { name?: unknown; labels?: unknown; autoStopInterval?: unknown; autoDeleteInterval?: unknown; ttlMinutes?: unknown; cpu?: unknown; memory?: unknown; disk?: unknown };
    const name = typeof input.name === 'string' && input.name ? input.name : undefined;
    if (name && this.find(name)) return { reply: this.error(req, 409, `Sandbox with name ${name} already exists`), sandboxId: null };
    // Sizes come with the snapshot; the controller refuses them on a snapshot create.
    if ((input.cpu !== undefined || input.memory !== undefined || input.disk !== undefined) && !(input as { buildInfo?: unknown }).buildInfo) {
      return { reply: this.error(req, 400, 'Cannot specify Sandbox resources when using a snapshot'), sandboxId: null };
    }
    if (typeof input.autoStopInterval === 'number' && input.autoStopInterval < 0) {
      return { reply: this.error(req, 400, 'Auto-stop interval must be non-negative'), sandboxId: null };
    }
    if (input.ttlMinutes !== undefined && (typeof input.ttlMinutes !== 'number' || !Number.isInteger(input.ttlMinutes) || input.ttlMinutes < 0)) {
      return { reply: this.error(req, 400, 'TTL must be a non-negative number of minutes'), sandboxId: null };
    }
    const labels = input.labels && typeof input.labels === 'object' ? (input.labels as Record<string, string>) : {};
    const id = randomUUID();
    const now = new Date().toISOString();
    const sb: FakeSandbox = {
      id,
      name: name ?? id,
      organizationId: this.opts.organizationId ?? '1f2e3d4c-5b6a-4798-8877-665544332211',
      labels,
      state: 'unknown',
      desiredState: 'started',
      transition: null,
      cpu: typeof input.cpu === 'number' ? input.cpu : 1,
      memory: typeof input.memory === 'number' ? input.memory : 1,
      disk: typeof input.disk === 'number' ? input.disk : 3,
      autoStopInterval: typeof input.autoStopInterval === 'number' ? input.autoStopInterval : 15,
      autoArchiveInterval: 10_080,
      autoDeleteInterval: typeof input.autoDeleteInterval === 'number' ? input.autoDeleteInterval : -1,
      // "counted as wall-clock time since creation regardless of sandbox state (0 means disabled)".
      autoDestroyAt: typeof input.ttlMinutes === 'number' && input.ttlMinutes > 0 ? Date.now() + input.ttlMinutes * 60_000 : null,
      recoverable: false,
      errorReason: null,
      daemonVersion: null,
      controls: {},
      createdAt: now,
      updatedAt: now,
      forceStops: 0,
    };
    this.sandboxes.set(id, sb);
    this.begin(sb, 'started', bootMs);
    return { reply: { status: 200, body: this.view(sb, { withRelations: false }) }, sandboxId: id };
  }
}

/** SandboxDto.getSandboxState: the transitional state a client sees. */
function reportedState(sb: FakeSandbox): string {
  switch (sb.state) {
    case 'started':
      if (sb.desiredState === 'stopped') return 'stopping';
      if (sb.desiredState === 'destroyed') return 'destroying';
      break;
    case 'stopped':
      if (sb.desiredState === 'started') return 'starting';
      if (sb.desiredState === 'destroyed') return 'destroying';
      if (sb.desiredState === 'archived') return 'archiving';
      break;
    case 'unknown':
      if (sb.desiredState === 'started') return 'creating';
      break;
  }
  return sb.state;
}
