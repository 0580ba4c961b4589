import type { Socket } from 'socket.io-client';
import { z } from 'zod';
import type { Logger } from '../../logger.ts';

/**
 * What a state event must carry to be used; the rest of the sandbox passes unread. Bounded:
 * a state name or an id longer than these is no Daytona state or id, and is not kept.
 */
const StateUpdatedSchema = z.object({
  sandbox: z.object({ id: z.string().min(1).max(128) }),
  newState: z.string().min(1).max(64),
});

/** How many sandboxes' latest pushed states (and timed-out waits) are kept (the oldest go first). */
const KEPT = 10_000;
/** After the gateway refused, failed, dropped the socket or missed a change, it is not asked again for this long. */
const RETRY_CONNECT_MS = 60_000;
const CONNECT_TIMEOUT_MS = 5_000;
/** A socket no wait used for this long is closed (a provider instance evicted from a worker's cache leaves none behind). */
const IDLE_CLOSE_MS = 30_000;

/**
 * States a sandbox rests in (Daytona's SandboxState): only a push of one of these ends a
 * wait. A transition's intermediate steps (creating, pulling_snapshot, starting) would only
 * make the attempt read again to find it still moving.
 */
const RESTING = new Set(['started', 'stopped', 'archived', 'paused', 'error', 'build_failed', 'destroyed']);

export interface DaytonaEventsSettings {
  apiUrl: string;
  apiKey: string;
  /** The gateway sends sandbox events to an organization's room only. */
  organizationId: string;
  /** A socket no wait used for this long is closed (default 30 s). */
  idleCloseMs?: number;
}

type Outcome = 'changed' | 'unchanged' | 'cannot_push';

/**
 * Daytona's notification gateway (socket.io at `<api URL>/socket.io/`, e.g.
 * https://app.daytona.io/api/socket.io/, as Daytona's own SDK subscribes to it): pushes
 * `sandbox.state.updated` for every sandbox of the organization. It lets an attempt waiting
 * out a transition go on when the transition ends, with no read while it waits. Connected on
 * the first wait, one socket per provider, closed after 30 s without waits. When it cannot
 * tell (not connected, no event in time), the attempt backs off in its lane as without it.
 */
export class DaytonaStateEvents {
  private socket: Socket | null = null;
  private connecting: Promise<Socket | null> | null = null;
  /** No connect is tried before this time (epoch ms). */
  private quietUntil = 0;
  /** The last resting state pushed per sandbox, and when it came (performance.now()). */
  private readonly latest = new Map<string, { state: string; at: number }>();
  /** Waits that timed out: what they saw, and when they ended (performance.now()). */
  private readonly timedOut = new Map<string, { state: string; at: number }>();
  /** Called with each pushed resting state of their sandbox, and with null when they must end unchanged. */
  private readonly waiters = new Map<string, Set<(state: string | null) => void>>();
  private closed = false;
  private idleTimer: NodeJS.Timeout | null = null;
  /** When the current socket connected (performance.now()). */
  private connectedAt = 0;

  /** Where this provider's warnings go: the log of the attempt that last waited. */
  private log: (() => Logger) | undefined;

  constructor(private readonly settings: DaytonaEventsSettings) {}

  /** See LeaseProvider.waitForChange. */
  async waitForChange(sandboxId: string, seenState: string, since: number, timeoutMs: number, signal: AbortSignal, log?: () => Logger): Promise<Outcome> {
    if (timeoutMs <= 0 || signal.aborted) return 'unchanged';
    if (log) this.log = log;
    try {
      return await this.waitOnSocket(sandboxId, seenState, since, performance.now() + timeoutMs, signal);
    } finally {
      if (this.waiters.size === 0 && this.socket) this.closeWhenIdle();
    }
  }

  /**
   * What a read of the sandbox found (every read the provider makes). A wait that timed out
   * on `state` and a read that finds another, with no push for the sandbox between them:
   * the gateway missed a change (it sends this organization nothing, say), so waiting on it
   * would only delay. It is not used for a minute.
   */
  sawRead(sandboxId: string, state: string): void {
    const waited = this.timedOut.get(sandboxId);
    if (!waited) return;
    this.timedOut.delete(sandboxId);
    const pushed = this.latest.get(sandboxId);
    if (state === waited.state || (pushed && pushed.at >= waited.at) || !this.socket) return;
    this.log?.().warn({ sandboxId, waitedOn: waited.state, found: state }, 'Daytona\'s notification gateway did not push a change a read found (does it send this organization events?): transitions are waited out by backing off for a while');
    this.drop();
  }

  /** Whether a socket is connected now. */
  get isConnected(): boolean {
    return this.socket?.connected === true;
  }

  close(): void {
    this.closed = true;
    this.drop();
  }

  private async waitOnSocket(sandboxId: string, seenState: string, since: number, deadline: number, signal: AbortSignal): Promise<Outcome> {
    // The connect counts against the wait: never past its time, nor past an abort.
    const socket = await this.within(this.connected(), deadline, signal);
    if (socket === undefined) return 'unchanged';
    if (!socket) return 'cannot_push';
    // Connected after the read: its event may have come before the socket did. One more read says.
    if (this.connectedAt > since) return 'changed';
    const known = this.latest.get(sandboxId);
    if (known && known.at >= since && known.state !== seenState) return 'changed';
    const changed = await new Promise<boolean | null>((resolve) => {
      const handlers = this.waiters.get(sandboxId) ?? new Set<(state: string | null) => void>();
      this.waiters.set(sandboxId, handlers);
      const end = (value: boolean | null) => {
        clearTimeout(timer);
        signal.removeEventListener('abort', onAbort);
        handlers.delete(onState);
        if (handlers.size === 0) this.waiters.delete(sandboxId);
        resolve(value);
      };
      const onState = (state: string | null) => {
        if (state === null) end(false);
        else if (state !== seenState) end(true);
      };
      const onAbort = () => end(false);
      const timer = setTimeout(() => end(null), Math.max(0, deadline - performance.now()));
      handlers.add(onState);
      signal.addEventListener('abort', onAbort, { once: true });
    });
    if (changed === null) {
      // Timed out: a read that then finds another state shows whether a push was missed (sawRead).
      this.timedOut.delete(sandboxId);
      this.timedOut.set(sandboxId, { state: seenState, at: performance.now() });
      if (this.timedOut.size > KEPT) this.timedOut.delete(this.timedOut.keys().next().value!);
    }
    return changed ? 'changed' : 'unchanged';
  }

  /** `work`'s result, or undefined once `deadline` (performance.now()) passed or `signal` aborted first. */
  private within<T>(work: Promise<T>, deadline: number, signal: AbortSignal): Promise<T | undefined> {
    return new Promise((resolve) => {
      const timer = setTimeout(() => finish(undefined), Math.max(0, deadline - performance.now()));
      const onAbort = () => finish(undefined);
      const finish = (value: T | undefined) => {
        clearTimeout(timer);
        signal.removeEventListener('abort', onAbort);
        resolve(value);
      };
      signal.addEventListener('abort', onAbort, { once: true });
      work.then(finish, () => finish(undefined));
    });
  }

  private closeWhenIdle(): void {
    if (this.closed) return;
    if (this.idleTimer) clearTimeout(this.idleTimer);
    this.idleTimer = setTimeout(() => {
      this.idleTimer = null;
      if (this.waiters.size === 0) this.disconnect();
    }, this.settings.idleCloseMs ?? IDLE_CLOSE_MS);
    this.idleTimer.unref();
  }

  /** Drops the socket and does not connect again for a while. Every wait ends unchanged: its attempt backs off. */
  private drop(): void {
    this.quietUntil = Date.now() + RETRY_CONNECT_MS;
    this.disconnect();
    this.latest.clear();
    this.timedOut.clear();
    for (const handlers of [...this.waiters.values()]) for (const h of [...handlers]) h(null);
  }

  private disconnect(): void {
    if (this.idleTimer) clearTimeout(this.idleTimer);
    this.idleTimer = null;
    const socket = this.socket;
    this.socket = null;
    socket?.removeAllListeners();
    socket?.disconnect();
  }

  private async connected(): Promise<Socket | null> {
    if (this.socket?.connected) return this.socket;
    if (this.closed || Date.now() < this.quietUntil) return null;
    this.connecting ??= this.connect().finally(() => {
      this.connecting = null;
    });
    return this.connecting;
  }

  private async connect(): Promise<Socket | null> {
    // Loaded on the first wait: a worker that never waits on Daytona never loads it.
    const { io } = await import('socket.io-client');
    // The gateway lives under the API's own address (Daytona: /api/socket.io/), so the key
    // goes nowhere the API URL does not lead (an allowed URL prefix holds it too).
    const api = new URL(this.settings.apiUrl);
    const socket = io(api.origin, {
      path: `${api.pathname.replace(/\/+$/, '')}/socket.io/`,
      transports: ['websocket'],
      auth: { token: this.settings.apiKey },
      query: { organizationId: this.settings.organizationId },
      // Reconnects are this class's: a lost socket is dropped, and a later wait connects again.
      reconnection: false,
      timeout: CONNECT_TIMEOUT_MS,
      // The socket and its timers must not keep a process alive that is done otherwise.
      autoUnref: true,
    });
    const up = await new Promise<boolean>((resolve) => {
      const timer = setTimeout(() => resolve(false), CONNECT_TIMEOUT_MS);
      timer.unref();
      socket.once('connect', () => {
        clearTimeout(timer);
        resolve(true);
      });
      socket.once('connect_error', (err) => {
        clearTimeout(timer);
        // The gateway's own words may repeat what it was sent: the key is masked out of them.
        const reason = err.message.split(this.settings.apiKey).join('***').slice(0, 200);
        this.log?.().warn({ reason }, 'Daytona\'s notification gateway is not reachable: transitions are waited out by backing off for a while');
        resolve(false);
      });
    });
    if (!up || this.closed) {
      socket.removeAllListeners();
      socket.disconnect();
      this.quietUntil = Date.now() + RETRY_CONNECT_MS;
      return null;
    }
    socket.on('disconnect', () => {
      // Events sent while it was away are lost: waits end and back off, and the gateway rests a minute.
      if (this.socket === socket) this.drop();
    });
    socket.on('sandbox.state.updated', (payload: unknown) => this.onState(payload));
    this.socket = socket;
    this.connectedAt = performance.now();
    return socket;
  }

  private onState(payload: unknown): void {
    const parsed = StateUpdatedSchema.safeParse(payload);
    if (!parsed.success || !RESTING.has(parsed.data.newState)) return;
    const id = parsed.data.sandbox.id;
    this.latest.delete(id);
    this.latest.set(id, { state: parsed.data.newState, at: performance.now() });
    if (this.latest.size > KEPT) this.latest.delete(this.latest.keys().next().value!);
    const handlers = this.waiters.get(id);
    if (handlers) for (const handler of [...handlers]) handler(parsed.data.newState);
  }
}
