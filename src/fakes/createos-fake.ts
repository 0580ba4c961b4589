import { randomBytes } from 'node:crypto';
import { seededRandom } from './seeded-random.ts';
import { ApiFake, WindowLimit, type FakeReply, type FakeRequest, type Transitioning } from './http-fake.ts';

/** CreateOS' statuses (SDK 0.7.1 `SandboxStatus`); `destroyed` and `failed` are terminal. */
export const CREATEOS_STATUSES = ['creating', 'running', 'pausing', 'paused', 'resuming', 'forking', 'error', 'destroying', 'destroyed', 'failed'] as const;

export interface CreateosTimings {
  /** Create answers only once the VM runs: this long after the request. */
  create: number;
  pause: number;
  resume: number;
  destroy: number;
}

export interface CreateosControls {
  /** Pausing takes this long instead of the default (a sandbox slow to freeze, or stuck). */
  pauseMs?: number;
  failNext?: { status: number; retryAfterS?: number }[];
  lost?: boolean;
  /** Put the sandbox into this status (any of CREATEOS_STATUSES, or one this client does not know). */
  status?: string;
}

interface FakeSandbox extends Transitioning<string> {
  id: string;
  name: string;
  shape: string;
  rootfs: string;
  autoPauseAfterSeconds: number | null;
  controls: CreateosControls;
  createdAt: string;
  runningAt: string | null;
  pausedAt: string | null;
  destroyedAt: string | null;
}

/** Seeded faults, as a busy control plane answers: 409 to pause/resume/delete, 503 or 429 to anything on a sandbox. */
export interface CreateosFaults {
  seed: number;
  settling: number;
  transient: number;
}

export interface CreateosFakeOptions {
  apiKey?: string;
  timings?: Partial<CreateosTimings>;
  /** Requests per caller IP per window (CreateOS: about 300 a minute); none by default. */
  rateLimit?: { limit: number; windowMs: number };
  faults?: CreateosFaults;
  /** Newer Go/Python SDKs expect `status` in the create reply; the TS SDK, the CLI and the brief say it has none (default). */
  createReplyHasStatus?: boolean;
}

const DEFAULT_TIMINGS: CreateosTimings = { create: 20, pause: 20, resume: 20, destroy: 10 };
const SHAPES: Record<string, { vcpu: number; mem_mib: number }> = {
  's-1vcpu-256mb': { vcpu: 1, mem_mib: 256 },
  's-0.25vcpu-512mb': { vcpu: 1, mem_mib: 512 },
  's-0.5vcpu-1gb': { vcpu: 1, mem_mib: 1024 },
  's-1vcpu-1gb': { vcpu: 1, mem_mib: 1024 },
  's-1vcpu-2gb': { vcpu: 1, mem_mib: 2048 },
  's-2vcpu-2gb': { vcpu: 2, mem_mib: 2048 },
  's-2vcpu-4gb': { vcpu: 2, mem_mib: 4096 },
  's-4vcpu-4gb': { vcpu: 4, mem_mib: 4096 },
  's-4vcpu-8gb': { vcpu: 4, mem_mib: 8192 },
  's-8vcpu-8gb': { vcpu: 8, mem_mib: 8192 },
  's-8vcpu-16gb': { vcpu: 8, mem_mib: 16384 },
};
const REGION = 'us';
const TERMINAL = new Set(['destroyed', 'failed']);
const ULID_ALPHABET = '0123456789ABCDEFGHJKMNPQRSTVWXYZ';

/**
 * A local CreateOS API over real HTTP, built from CreateOS' TypeScript SDK (0.7.1), its CLI,
 * its REST docs and the CreateOS plugin (see docs/providers.md):
 *
 * - `/v1/sandboxes`, the `X-Api-Key` header, JSend envelopes (`success` with data, `fail` for
 *   4xx with an object or a plain string, `error` with message and code).
 * - Create is synchronous: it answers 200 only once the VM runs, and its reply has no
 *   `status` and no `region` (id, name, ip, shape, rootfs, vcpu, mem_mib, disk_mib,
 *   spawn_ms, egress, bandwidth_quota_bytes, auto_pause_after_seconds). `shape` must be in the
 *   catalog, `region` must be the server's, `auto_pause_after_seconds` within 60..86400, and
 *   `name` unique among the account's live sandboxes (the code of a duplicate is not
 *   documented; this fake answers 409).
 * - GET answers the full view with optional fields left out, never null; a destroyed
 *   sandbox stays readable as `destroyed`; unknown ids answer 404 "sandbox not found".
 * - GET /v1/sandboxes lists, paginated (`{data, pagination}`), with no filter by name.
 * - Pause and resume are asynchronous (202 pausing/resuming with X-Poll-After), 200 when
 *   already there, 409 otherwise; resume also works from `error`. Delete answers
 *   destroying, or destroyed for a paused/errored/terminal one, and 200 again after.
 * - A rate limit per caller IP, answered 429 with Retry-After.
 */
export class CreateosFake extends ApiFake {
  readonly sandboxes = new Map<string, FakeSandbox>();
  private readonly timings: CreateosTimings;
  private readonly limit: WindowLimit | null;
  private readonly random: (() => number) | null;

  constructor(private readonly opts: CreateosFakeOptions = {}) {
    super((req) => this.route(req));
    this.timings = { ...DEFAULT_TIMINGS, ...opts.timings };
    this.limit = opts.rateLimit ? new WindowLimit(opts.rateLimit.limit, opts.rateLimit.windowMs) : null;
    this.random = opts.faults ? seededRandom(opts.faults.seed) : null;
  }

  control(id: string, controls: CreateosControls): void {
    const sb = this.sandboxes.get(id);
    if (!sb) throw new Error(`no sandbox ${id}`);
    Object.assign(sb.controls, controls);
    if (controls.status !== undefined) {
      sb.state = controls.status;
      sb.transition = null;
    }
  }

  statusOf(id: string): string {
    const sb = this.sandboxes.get(id);
    if (!sb || sb.controls.lost) return 'gone';
    this.settleTransition(sb);
    return sb.state;
  }

  /** Sandboxes that are not terminal: what the account is paying for. */
  live(): string[] {
    return [...this.sandboxes.values()].filter((sb) => (this.settleTransition(sb), !TERMINAL.has(sb.state) && !sb.controls.lost)).map((sb) => sb.id);
  }

  /** Requests answered 429 by the rate limit so far: proof that clients paced themselves (or did not). */
  get rateLimited(): number {
    return this.calls.filter((c) => c.status === 429 && c.sandboxId === null).length;
  }

  private ok(status: number, data: unknown, headers?: Record<string, string>): FakeReply {
    return { status, headers, body: { status: 'success', data } };
  }

  private fail(status: number, data: unknown): FakeReply {
    return { status, body: { status: 'fail', data } };
  }

  private err(status: number, message: string, headers?: Record<string, string>): FakeReply {
    return { status, headers, body: { status: 'error', message, code: status } };
  }

  /** The SandboxView: always id, status, vcpu, mem_mib, disk_mib, created_at, ingress_enabled; the rest only when set. */
  private view(sb: FakeSandbox) {
    const shape = SHAPES[sb.shape]!;
    return {
      id: sb.id,
      status: sb.state,
      ...(sb.state === 'creating' || TERMINAL.has(sb.state) ? {} : { ip: '10.0.3.17' }),
      vcpu: shape.vcpu,
      mem_mib: shape.mem_mib,
      disk_mib: 10_240,
      created_at: sb.createdAt,
      ingress_enabled: false,
      name: sb.name,
      ...(sb.runningAt ? { running_at: sb.runningAt } : {}),
      ...(sb.pausedAt ? { paused_at: sb.pausedAt } : {}),
      ...(sb.destroyedAt ? { destroyed_at: sb.destroyedAt } : {}),
      spawn_ms: 63.4,
      shape: sb.shape,
      rootfs: sb.rootfs,
      region: REGION,
      created_by: 'usr_01K9W2B7C4D5E6F7G8H9J0K1M2',
      ...(sb.autoPauseAfterSeconds ? { auto_pause_after_seconds: sb.autoPauseAfterSeconds } : {}),
    };
  }

  private settle(sb: FakeSandbox): void {
    if (!this.settleTransition(sb)) return;
    const now = new Date().toISOString();
    if (sb.state === 'running') sb.runningAt = now;
    if (sb.state === 'paused') sb.pausedAt = now;
    if (sb.state === 'destroyed') sb.destroyedAt = now;
  }

  private route(req: FakeRequest) {
    const { method, path, body } = req;
    const none = (reply: FakeReply) => ({ reply, sandboxId: null });
    const key = req.headers['x-api-key'];
    const apiKey = Array.isArray(key) ? key[0] : key;
    if (this.opts.apiKey && apiKey !== this.opts.apiKey) return none(this.fail(401, { auth: 'invalid api key' }));
    const retryAfter = this.limit?.take(req.remoteAddress);
    if (retryAfter) return none(this.err(429, 'rate limit exceeded', { 'retry-after': String(retryAfter) }));

    if (method === 'POST' && path === '/v1/sandboxes') {
      return this.createWithFault(body, (bootMs) => this.create(body, bootMs ?? this.timings.create));
    }
    if (method === 'GET' && path === '/v1/sandboxes') return none(this.list(req.query));
    const m = /^\/v1\/sandboxes\/([^/]+)(?:\/(pause|resume))?$/.exec(path);
    if (!m) return none(this.fail(404, { path: `no route ${method} ${path}` }));
    const sb = this.sandboxes.get(decodeURIComponent(m[1]!));
    if (!sb || sb.controls.lost) return none(this.fail(404, 'sandbox not found'));
    const reply = (r: FakeReply) => ({ reply: r, sandboxId: sb.id });
    const failure = sb.controls.failNext?.shift();
    if (failure) {
      const headers = failure.retryAfterS !== undefined ? { 'retry-after': String(failure.retryAfterS) } : undefined;
      return reply(failure.status >= 500 || failure.status === 429 ? this.err(failure.status, `injected ${failure.status}`, headers) : this.fail(failure.status, { injected: String(failure.status) }));
    }
    const action = m[2];
    if (this.random && this.opts.faults) {
      const roll = this.random();
      const { settling, transient } = this.opts.faults;
      if (roll < transient) {
        const status = roll < transient / 2 ? 503 : 429;
        return { ...reply(this.err(status, status === 503 ? 'no host with capacity' : 'rate limit exceeded', { 'retry-after': '0' })), injected: true };
      }
      if (roll < transient + settling && (action || method === 'DELETE')) {
        return { ...reply(this.fail(409, { status: 'a transition is in progress' })), injected: true };
      }
    }
    this.settle(sb);
    if (!action && method === 'GET') return reply(this.ok(200, this.view(sb)));
    if (!action && method === 'DELETE') return reply(this.destroy(sb));
    if (method !== 'POST' || !action) return reply(this.fail(404, { path: `no route ${method} ${path}` }));
    const pollAfter = { 'x-poll-after': '1' };
    if (action === 'pause') {
      if (sb.state === 'paused') return reply(this.ok(200, this.view(sb)));
      if (sb.state !== 'running' || sb.transition) return reply(this.fail(409, 'sandbox is not running'));
      this.beginTransition(sb, 'pausing', 'paused', sb.controls.pauseMs ?? this.timings.pause);
      this.settle(sb);
      return reply(this.ok(202, this.view(sb), pollAfter));
    }
    if (sb.state === 'running') return reply(this.ok(200, this.view(sb)));
    if ((sb.state !== 'paused' && sb.state !== 'error') || sb.transition) return reply(this.fail(409, `cannot resume a ${sb.state} sandbox`));
    this.beginTransition(sb, 'resuming', 'running', this.timings.resume);
    this.settle(sb);
    return reply(this.ok(202, this.view(sb), pollAfter));
  }

  private destroy(sb: FakeSandbox): FakeReply {
    if (TERMINAL.has(sb.state)) return this.ok(200, { id: sb.id, status: 'destroyed' });
    if (sb.state === 'destroying') return this.ok(200, { id: sb.id, status: 'destroying' });
    // A paused or errored sandbox has no VM to stop: it is reclaimed inline.
    const inline = sb.state === 'paused' || sb.state === 'error';
    this.beginTransition(sb, 'destroying', 'destroyed', inline ? 0 : this.timings.destroy);
    this.settle(sb);
    return this.ok(200, { id: sb.id, status: sb.state });
  }

  private list(query: URLSearchParams): FakeReply {
    const limit = Math.min(500, Math.max(1, Number(query.get('limit') ?? 50)));
    const offset = Math.max(0, Number(query.get('offset') ?? 0));
    const status = query.get('status');
    const all = [...this.sandboxes.values()].filter((sb) => (this.settle(sb), !sb.controls.lost && (!status || sb.state === status)));
    const page = all.slice(offset, offset + limit).map((sb) => this.view(sb));
    return this.ok(200, { data: page, pagination: { total: all.length, limit, offset, count: page.length } });
  }

  private create(body: unknown, bootMs: number): { reply: FakeReply; sandboxId: string | null } {
    const input = (body ?? {}) as Record<string, unknown>;
    const refuse = (data: Record<string, string>, status = 400) => ({ reply: this.fail(status, data), sandboxId: null });
    if (typeof input.shape !== 'string' || !input.shape) return refuse({ shape: 'shape is required' });
    if (!SHAPES[input.shape]) return refuse({ shape: `unknown shape: ${input.shape}` });
    if (input.region !== undefined && input.region !== REGION) return refuse({ region: `region must be ${REGION}` });
    const autoPause = input.auto_pause_after_seconds;
    if (autoPause !== undefined && (typeof autoPause !== 'number' || autoPause < 60 || autoPause > 86_400)) {
      return refuse({ auto_pause_after_seconds: 'must be between 60 and 86400' });
    }
    const name = typeof input.name === 'string' && input.name ? input.name : `brave-otter-${randomBytes(3).toString('hex')}`;
    for (const other of this.sandboxes.values()) {
      this.settle(other);
      if (other.name === name && !TERMINAL.has(other.state)) return refuse({ name: `name ${name} is already in use` }, 409);
    }
    const sb: FakeSandbox = {
      id: `sb-${Array.from(randomBytes(26), (b) => ULID_ALPHABET[b % 32]).join('')}`,
      name,
      shape: input.shape,
      rootfs: typeof input.rootfs === 'string' ? input.rootfs : 'devbox:1',
      state: 'creating',
      transition: null,
      autoPauseAfterSeconds: typeof autoPause === 'number' ? autoPause : null,
      controls: {},
      createdAt: new Date().toISOString(),
      runningAt: null,
      pausedAt: null,
      destroyedAt: null,
    };
    this.sandboxes.set(sb.id, sb);
    this.beginTransition(sb, 'creating', 'running', bootMs);
    const shape = SHAPES[sb.shape]!;
    // The reply comes once the VM runs, and carries no status and no region.
    const reply = {
      id: sb.id,
      name: sb.name,
      ip: '10.0.3.17',
      shape: sb.shape,
      rootfs: sb.rootfs,
      vcpu: shape.vcpu,
      mem_mib: shape.mem_mib,
      disk_mib: 10_240,
      spawn_ms: 63.4,
      egress: ['*'],
      bandwidth_quota_bytes: 5_368_709_120,
      ...(sb.autoPauseAfterSeconds ? { auto_pause_after_seconds: sb.autoPauseAfterSeconds } : {}),
      ...(this.opts.createReplyHasStatus ? { status: 'running' } : {}),
    };
    return { reply: { ...this.ok(200, reply), delayMs: bootMs }, sandboxId: sb.id };
  }
}
