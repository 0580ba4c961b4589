import { randomUUID } from 'node:crypto';
import { ApiFake, type FakeReply, type Transitioning } from './http-fake.ts';

type CreateosStatus = 'creating' | 'running' | 'pausing' | 'paused' | 'resuming' | 'forking' | 'error' | 'destroying' | 'destroyed' | 'failed';

export interface CreateosTimings {
  create: number;
  pause: number;
  resume: number;
  destroy: number;
}

export interface CreateosControls {
  /** Pausing takes this long instead of the default (a sandbox slow to freeze). */
  pauseMs?: number;
  failNext?: { status: number; retryAfterS?: number }[];
  lost?: boolean;
}

interface FakeSandbox extends Transitioning<CreateosStatus> {
  id: string;
  shape: string;
  rootfs: string | null;
  region: string | null;
  autoPauseAfterSeconds: number | null;
  controls: CreateosControls;
  createdAt: string;
}

const DEFAULT_TIMINGS: CreateosTimings = { create: 20, pause: 20, resume: 20, destroy: 10 };

/**
 * A faithful local CreateOS API over real HTTP: `/v1/sandboxes`, the `X-Api-Key` header,
 * JSend envelopes (`success` with data, `fail` for 4xx with data, `error` with message and
 * code), asynchronous pause and resume (the reply says pausing/resuming, not done), 409
 * while a transition runs, and a per-key rate limit (default 300 requests a minute).
 */
export class CreateosFake extends ApiFake {
  readonly sandboxes = new Map<string, FakeSandbox>();
  private readonly timings: CreateosTimings;
  /** Request times per API key in the last minute, for the rate limit. */
  private readonly recent = new Map<string, number[]>();

  constructor(private readonly opts: { apiKey?: string; timings?: Partial<CreateosTimings>; ratePerMinute?: number } = {}) {
    super((req) => this.route(req.method, req.path, req.body, req.headers['x-api-key']));
    this.timings = { ...DEFAULT_TIMINGS, ...opts.timings };
  }

  control(id: string, controls: CreateosControls): void {
    const sb = this.sandboxes.get(id);
    if (!sb) throw new Error(`no sandbox ${id}`);
    Object.assign(sb.controls, controls);
  }

  statusOf(id: string): CreateosStatus | 'gone' {
    const sb = this.sandboxes.get(id);
    if (!sb || sb.controls.lost) return 'gone';
    this.settle(sb);
    return sb.state;
  }

  /** Requests answered 429 so far: proof that a client paced itself (or did not). */
  get rateLimited(): number {
    return this.calls.filter((c) => c.status === 429 && c.sandboxId === null).length;
  }

  private settle(sb: FakeSandbox): void {
    this.settleTransition(sb);
  }

  private begin(sb: FakeSandbox, via: CreateosStatus, to: CreateosStatus, ms: number): void {
    this.beginTransition(sb, via, to, ms);
  }

  private ok(status: number, data: unknown): FakeReply {
    return { status, body: { status: 'success', data } };
  }

  private fail(status: number, data: Record<string, unknown>): FakeReply {
    return { status, body: { status: 'fail', data } };
  }

  private err(status: number, message: string, headers?: Record<string, string>): FakeReply {
    return { status, headers, body: { status: 'error', message, code: status } };
  }

  private view(sb: FakeSandbox) {
    return { id: sb.id, status: sb.state, shape: sb.shape, rootfs: sb.rootfs, region: sb.region, auto_pause_after_seconds: sb.autoPauseAfterSeconds, created_at: sb.createdAt };
  }

  private overLimit(key: string): boolean {
    const limit = this.opts.ratePerMinute ?? 300;
    const now = Date.now();
    const times = (this.recent.get(key) ?? []).filter((t) => t > now - 60_000);
    times.push(now);
    this.recent.set(key, times);
    return times.length > limit;
  }

  private route(method: string, path: string, body: unknown, key: string | string[] | undefined) {
    const none = (reply: FakeReply) => ({ reply, sandboxId: null });
    const apiKey = Array.isArray(key) ? key[0] : key;
    if (this.opts.apiKey && apiKey !== this.opts.apiKey) return none(this.err(401, 'invalid API key'));
    if (this.overLimit(apiKey ?? '')) return none(this.err(429, 'rate limit exceeded', { 'retry-after': '1' }));

    if (method === 'POST' && path === '/v1/sandboxes') return none(this.create(body));
    const m = /^\/v1\/sandboxes\/([^/]+)(?:\/(pause|resume))?$/.exec(path);
    if (!m) return none(this.fail(404, { path: `no route ${method} ${path}` }));
    const sb = this.sandboxes.get(decodeURIComponent(m[1]!));
    if (!sb || sb.controls.lost) return none(this.fail(404, { id: `sandbox ${m[1]} not found` }));
    const reply = (r: FakeReply) => ({ reply: r, sandboxId: sb.id });
    const failure = sb.controls.failNext?.shift();
    if (failure) {
      const headers = failure.retryAfterS !== undefined ? { 'retry-after': String(failure.retryAfterS) } : undefined;
      return reply(failure.status >= 500 || failure.status === 429 ? this.err(failure.status, `injected ${failure.status}`, headers) : this.fail(failure.status, { injected: String(failure.status) }));
    }
    this.settle(sb);
    const action = m[2];
    if (!action && method === 'GET') return reply(this.ok(200, this.view(sb)));
    if (!action && method === 'DELETE') {
      if (sb.state === 'destroyed') return reply(this.fail(404, { id: `sandbox ${sb.id} not found` }));
      this.begin(sb, 'destroying', 'destroyed', this.timings.destroy);
      return reply(this.ok(200, this.view(sb)));
    }
    if (method !== 'POST' || !action) return reply(this.fail(404, { path: `no route ${method} ${path}` }));
    if (sb.transition) return reply(this.fail(409, { status: `sandbox is ${sb.state}; a transition is in progress` }));
    if (action === 'pause') {
      if (sb.state !== 'running') return reply(this.fail(409, { status: `cannot pause a ${sb.state} sandbox` }));
      this.begin(sb, 'pausing', 'paused', sb.controls.pauseMs ?? this.timings.pause);
      return reply(this.ok(202, this.view(sb)));
    }
    if (sb.state !== 'paused') return reply(this.fail(409, { status: `cannot resume a ${sb.state} sandbox` }));
    this.begin(sb, 'resuming', 'running', this.timings.resume);
    return reply(this.ok(202, this.view(sb)));
  }

  private create(body: unknown): FakeReply {
    const req = (body ?? {}) as Record<string, unknown>;
    if (typeof req.shape !== 'string' || !req.shape) return this.fail(400, { shape: 'shape is required' });
    const sb: FakeSandbox = {
      id: randomUUID(),
      shape: req.shape,
      rootfs: typeof req.rootfs === 'string' ? req.rootfs : null,
      region: typeof req.region === 'string' ? req.region : null,
      state: 'creating',
      transition: null,
      autoPauseAfterSeconds: typeof req.auto_pause_after_seconds === 'number' ? req.auto_pause_after_seconds : null,
      controls: {},
      createdAt: new Date().toISOString(),
    };
    this.sandboxes.set(sb.id, sb);
    this.begin(sb, 'creating', 'running', this.timings.create);
    return this.ok(201, this.view(sb));
  }
}
