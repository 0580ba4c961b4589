import { randomUUID } from 'node:crypto';
import { seededRandom } from './seeded-random.ts';
import { ApiFake, type FakeReply, type Transitioning } from './http-fake.ts';

type DaytonaState =
  | 'creating'
  | 'starting'
  | 'started'
  | 'stopping'
  | 'stopped'
  | 'destroying'
  | 'destroyed'
  | 'error'
  | 'archived';

/** How long transitions take, in ms. */
export interface DaytonaTimings {
  create: number;
  start: number;
  stop: number;
  forceStop: number;
  destroy: number;
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
}

interface FakeSandbox extends Transitioning<DaytonaState> {
  id: string;
  name: string;
  organizationId: string;
  labels: Record<string, string>;
  desiredState: 'started' | 'stopped' | 'destroyed';
  autoStopInterval: number;
  autoDeleteInterval: number;
  recoverable: boolean;
  errorReason: string | undefined;
  controls: SandboxControls;
  createdAt: string;
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

const DEFAULT_TIMINGS: DaytonaTimings = { create: 20, start: 20, stop: 20, forceStop: 0, destroy: 10 };

/**
 * A faithful local Daytona API over real HTTP: the paths, status codes, error bodies and
 * state machine the official client meets (see ../shared/BRIEF.md, "Provider facts").
 * Transitions take time; 409 answers while state != desiredState; stopping a sandbox that
 * is not started answers 400 "Sandbox is not in a stoppable state".
 */
export class DaytonaFake extends ApiFake {
  readonly sandboxes = new Map<string, FakeSandbox>();
  private readonly timings: DaytonaTimings;

  private readonly random: (() => number) | null;

  constructor(private readonly opts: { apiKey?: string; organizationId?: string; timings?: Partial<DaytonaTimings>; faults?: DaytonaFaults } = {}) {
    super((req) => this.route(req.method, req.path, req.query, req.body, req.headers.authorization));
    this.timings = { ...DEFAULT_TIMINGS, ...opts.timings };
    this.random = opts.faults ? seededRandom(opts.faults.seed) : null;
  }

  /** Every sandbox created so far and not destroyed. */
  ids(): string[] {
    return [...this.sandboxes.keys()];
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
  }

  /** The sandbox's state now (after any transition that is due). */
  stateOf(idOrName: string): DaytonaState | 'gone' {
    const sb = this.find(idOrName);
    if (!sb || sb.controls.lost) return 'gone';
    this.settle(sb);
    return sb.state;
  }

  private find(idOrName: string): FakeSandbox | undefined {
    const byId = this.sandboxes.get(idOrName);
    if (byId) return byId;
    for (const sb of this.sandboxes.values()) if (sb.name === idOrName) return sb;
    return undefined;
  }

  private settle(sb: FakeSandbox): void {
    if (this.settleTransition(sb) && sb.state === 'destroyed') this.sandboxes.delete(sb.id);
  }

  private begin(sb: FakeSandbox, via: DaytonaState, to: DaytonaState, ms: number): void {
    this.beginTransition(sb, via, to, ms);
    if (sb.state === 'destroyed') this.sandboxes.delete(sb.id);
  }

  private error(path: string, status: number, message: string, headers?: Record<string, string>): FakeReply {
    const names: Record<number, string> = { 400: 'Bad Request', 401: 'Unauthorized', 404: 'Not Found', 409: 'Conflict', 429: 'Too Many Requests', 500: 'Internal Server Error', 503: 'Service Unavailable' };
    return { status, headers, body: { path, timestamp: new Date().toISOString(), statusCode: status, error: names[status] ?? 'Error', message } };
  }

  private view(sb: FakeSandbox) {
    return {
      id: sb.id,
      organizationId: sb.organizationId,
      name: sb.name,
      user: 'daytona',
      env: {},
      labels: sb.labels,
      public: false,
      networkBlockAll: false,
      target: 'us',
      cpu: 1,
      gpu: 0,
      memory: 1,
      disk: 3,
      state: sb.state,
      desiredState: sb.desiredState,
      errorReason: sb.errorReason,
      recoverable: sb.recoverable,
      autoStopInterval: sb.autoStopInterval,
      autoArchiveInterval: 60,
      autoDeleteInterval: sb.autoDeleteInterval,
      createdAt: sb.createdAt,
      updatedAt: new Date().toISOString(),
      toolboxProxyUrl: 'http://127.0.0.1/toolbox',
    };
  }

  private route(method: string, path: string, query: URLSearchParams, body: unknown, auth: string | undefined) {
    const none = (reply: FakeReply) => ({ reply, sandboxId: null });
    if (this.opts.apiKey && auth !== `Bearer ${this.opts.apiKey}`) return none(this.error(path, 401, 'Unauthorized'));

    if (method === 'POST' && path === '/sandbox') return none(this.create(path, body));
    const m = /^\/sandbox\/([^/]+)(?:\/(start|stop|recover|autodelete)(?:\/(-?\d+))?)?$/.exec(path);
    if (!m) return none(this.error(path, 404, `Cannot ${method} ${path}`));
    const [, idOrName, action, arg] = m;
    const sb = this.find(decodeURIComponent(idOrName!));
    if (!sb || sb.controls.lost) return none(this.error(path, 404, `Sandbox with ID or name ${idOrName} not found`));
    const reply = (r: FakeReply) => ({ reply: r, sandboxId: sb.id });

    const failure = sb.controls.failNext?.shift();
    if (failure) {
      const headers = failure.retryAfterS !== undefined ? { 'retry-after': String(failure.retryAfterS) } : undefined;
      return reply(this.error(path, failure.status, `injected ${failure.status}`, headers));
    }
    const faults = this.opts.faults;
    if (faults && this.random) {
      const roll = this.random();
      if (roll < faults.transient) {
        const status = roll < faults.transient / 2 ? 503 : 429;
        return { ...reply(this.error(path, status, `injected ${status}`, { 'retry-after': '0' })), injected: true };
      }
      if (roll < faults.transient + faults.settling && (method === 'DELETE' || action === 'start' || action === 'stop')) {
        return { ...reply(this.error(path, 409, 'Sandbox state change in progress')), injected: true };
      }
    }
    this.settle(sb);
    if (!this.sandboxes.has(sb.id)) return none(this.error(path, 404, `Sandbox with ID or name ${idOrName} not found`));

    if (method === 'GET' && !action) return reply({ status: 200, body: this.view(sb) });
    if (method === 'DELETE' && !action) {
      sb.desiredState = 'destroyed';
      this.begin(sb, 'destroying', 'destroyed', this.timings.destroy);
      return reply({ status: 200, body: this.view(sb) });
    }
    if (method !== 'POST') return reply(this.error(path, 404, `Cannot ${method} ${path}`));

    const changing = sb.transition !== null;
    const conflict = sb.controls.conflictUntil;
    if (conflict && Date.now() < conflict.at && (action === 'start' || action === 'stop')) {
      return reply(this.error(path, 409, conflict.message));
    }
    switch (action) {
      case 'autodelete':
        sb.autoDeleteInterval = Number(arg);
        return reply({ status: 200, body: this.view(sb) });
      case 'start':
        if (changing) return reply(this.error(path, 409, 'Sandbox state change in progress'));
        if (sb.state === 'started') return reply({ status: 200, body: this.view(sb) });
        if (sb.state !== 'stopped' && sb.state !== 'archived') return reply(this.error(path, 400, 'Sandbox is not in a startable state'));
        sb.desiredState = 'started';
        this.begin(sb, 'starting', 'started', this.timings.start);
        return reply({ status: 200, body: this.view(sb) });
      case 'recover':
        if (sb.state !== 'error' || !sb.recoverable) return reply(this.error(path, 400, 'Sandbox is not recoverable'));
        sb.desiredState = 'started';
        sb.errorReason = undefined;
        this.begin(sb, 'starting', 'started', this.timings.start);
        return reply({ status: 200, body: this.view(sb) });
      case 'stop': {
        const force = query.get('force') === 'true';
        if (force && sb.state === 'stopping') {
          // SIGKILL for a stop that SIGTERM did not finish, unless told to refuse.
          if ((sb.controls.refuseForceStops ?? 0) > sb.forceStops++) {
            return reply(this.error(path, 409, 'Sandbox state change in progress'));
          }
          this.begin(sb, 'stopping', 'stopped', this.timings.forceStop);
          return reply({ status: 200, body: this.view(sb) });
        }
        if (changing) return reply(this.error(path, 409, 'Sandbox state change in progress'));
        if (sb.state !== 'started') return reply(this.error(path, 400, 'Sandbox is not in a stoppable state'));
        if (force && (sb.controls.refuseForceStops ?? 0) > sb.forceStops++) {
          return reply(this.error(path, 409, 'Sandbox state change in progress'));
        }
        sb.desiredState = 'stopped';
        const ms = force ? this.timings.forceStop : (sb.controls.stuckStoppingMs ?? this.timings.stop);
        this.begin(sb, 'stopping', 'stopped', ms);
        return reply({ status: 200, body: this.view(sb) });
      }
      default:
        return reply(this.error(path, 404, `Cannot ${method} ${path}`));
    }
  }

  private create(path: string, body: unknown): FakeReply {
    const req = (body ?? {}) as { name?: unknown; labels?: unknown; autoStopInterval?: unknown; autoDeleteInterval?: unknown };
    const name = typeof req.name === 'string' && req.name ? req.name : undefined;
    if (name && this.find(name)) return this.error(path, 409, `Sandbox with name ${name} already exists`);
    const labels = req.labels && typeof req.labels === 'object' ? (req.labels as Record<string, string>) : {};
    const id = randomUUID();
    const sb: FakeSandbox = {
      id,
      name: name ?? id,
      organizationId: this.opts.organizationId ?? 'org-fake',
      labels,
      state: 'creating',
      desiredState: 'started',
      transition: null,
      autoStopInterval: typeof req.autoStopInterval === 'number' ? req.autoStopInterval : 15,
      autoDeleteInterval: typeof req.autoDeleteInterval === 'number' ? req.autoDeleteInterval : 10_080,
      recoverable: false,
      errorReason: undefined,
      controls: {},
      createdAt: new Date().toISOString(),
      forceStops: 0,
    };
    this.sandboxes.set(id, sb);
    this.begin(sb, 'creating', 'started', this.timings.create);
    return { status: 200, body: this.view(sb) };
  }
}

