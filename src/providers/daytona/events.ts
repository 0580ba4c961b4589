import type { Socket } from 'socket.io-client';
import { z } from 'zod';
import type { Logger } from '../../logger.ts';

/** What a state event must carry to be used; the rest of the sandbox passes unread. */
const StateUpdatedSchema = z.object({
  sandbox: z.object({ id: z.string().min(1) }),
  newState: z.string().min(1),
});

/** How many sandboxes' latest pushed states are kept (the oldest go first). */
const LATEST_KEPT = 10_000;
/** After the gateway refused or failed, or stayed silent through a wait, it is not asked again for this long. */
const RETRY_CONNECT_MS = 60_000;
const CONNECT_TIMEOUT_MS = 5_000;
/** A socket no wait used for this long is closed (a provider instance evicted from a worker's cache leaves none behind). */
const IDLE_CLOSE_MS = 30_000;

export interface DaytonaEventsSettings {
  apiUrl: string;
  apiKey: string;
  /** The gateway sends sandbox events to an organization's room only. */
  organizationId: string;
  /** A socket no wait used for this long is closed (default 30 s). */
  idleCloseMs?: number;
}

/**
 * Daytona's notification gateway (socket.io at `<origin>/api/socket.io/`, as Daytona's own
 * SDK subscribes to it): pushes `sandbox.state.updated` for every sandbox of the
 * organization. It lets an attempt waiting out a transition go on when the transition ends,
 * with no read while it waits. Connected on the first wait, one socket per provider.
 * When it cannot tell (not connected, no event in time), the attempt backs off in its lane
 * as without it.
 */
export class DaytonaStateEvents {
  private socket: Socket | null = null;
  private connecting: Promise<Socket | null> | null = null;
  /** No connect is tried before this time (epoch ms). */
  private quietUntil = 0;
  /** The last state pushed per sandbox, and when it came (performance.now()). */
  private readonly latest = new Map<string, { state: string; at: number }>();
  /** Called with each pushed state of their sandbox, and with null when the listener closes. */
  private readonly waiters = new Map<string, Set<(state: string | null) => void>>();
  /** Sandbox events of any kind heard on the current socket. */
  private heard = 0;
  private closed = false;
  private idleTimer: NodeJS.Timeout | null = null;
  /** When the current socket connected (performance.now()). */
  private connectedAt = 0;

  /** Where this provider's warnings go: the log of the attempt that last waited. */
  private log: (() => Logger) | undefined;

  constructor(private readonly settings: DaytonaEventsSettings) {}

  /** See LeaseProvider.waitForChange. */
  async waitForChange(sandboxId: string, seenState: string, since: number, timeoutMs: number, signal: AbortSignal, log?: () => Logger): Promise<'changed' | 'unchanged' | 'cannot_push'> {
    if (timeoutMs <= 0 || signal.aborted) return 'unchanged';
    if (log) this.log = log;
    try {
      return await this.waitOnSocket(sandboxId, seenState, since, timeoutMs, signal);
    } finally {
      if (this.waiters.size === 0 && this.socket) this.closeWhenIdle();
    }
  }

  private async waitOnSocket(sandboxId: string, seenState: string, since: number, timeoutMs: number, signal: AbortSignal): Promise<'changed' | 'unchanged' | 'cannot_push'> {
    const socket = await this.connected();
    if (!socket) return 'cannot_push';
    if (signal.aborted) return 'unchanged';
    // Connected after the read: its event may have come before the socket did. One more read says.
    if (this.connectedAt > since) return 'changed';
    const known = this.latest.get(sandboxId);
    if (known && known.at >= since && known.state !== seenState) return 'changed';
    const changed = await new Promise<boolean>((resolve) => {
      const handlers = this.waiters.get(sandboxId) ?? new Set<(state: string | null) => void>();
      this.waiters.set(sandboxId, handlers);
      const end = (value: boolean) => {
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
      const timer = setTimeout(() => end(false), timeoutMs);
      handlers.add(onState);
      signal.addEventListener('abort', onAbort, { once: true });
    });
    if (!changed && !signal.aborted && this.heard === 0 && this.socket === socket) {
      // Connected, yet nothing was pushed through a whole wait: the gateway sends this
      // organization nothing (a token it takes for another one, say). Waiting on it would only delay.
      this.log?.().warn({ waitedMs: timeoutMs }, 'Daytona\'s notification gateway pushed nothing through a settle wait: transitions are waited out by backing off for a while');
      this.drop();
    }
    return changed ? 'changed' : 'unchanged';
  }

  /** Whether a socket is connected now (for tests and the status of a provider). */
  get isConnected(): boolean {
    return this.socket?.connected === true;
  }

  close(): void {
    this.closed = true;
    this.drop();
    for (const handlers of [...this.waiters.values()]) for (const h of [...handlers]) h(null);
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

  /** Drops the socket and does not connect again for a while (it failed, or pushed nothing). */
  private drop(): void {
    this.quietUntil = Date.now() + RETRY_CONNECT_MS;
    this.disconnect();
  }

  private disconnect(): void {
    if (this.idleTimer) clearTimeout(this.idleTimer);
    this.idleTimer = null;
    const socket = this.socket;
    this.socket = null;
    this.heard = 0;
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
    const origin = this.settings.apiUrl.replace(/\/+$/, '').replace(/\/api$/, '');
    const socket = io(origin, {
      path: '/api/socket.io/',
      transports: ['websocket'],
      auth: { token: this.settings.apiKey },
      query: { organizationId: this.settings.organizationId },
      // Reconnects are this class's: a lost socket is dropped, and the next wait connects again.
      reconnection: false,
      timeout: CONNECT_TIMEOUT_MS,
    });
    const up = await new Promise<boolean>((resolve) => {
      const timer = setTimeout(() => resolve(false), CONNECT_TIMEOUT_MS);
      socket.once('connect', () => {
        clearTimeout(timer);
        resolve(true);
      });
      socket.once('connect_error', (err) => {
        clearTimeout(timer);
        // The message names no credential: socket.io's own, or the gateway's refusal.
        this.log?.().warn({ reason: err.message }, 'Daytona\'s notification gateway is not reachable: transitions are waited out by backing off for a while');
        resolve(false);
      });
    });
    if (!up || this.closed) {
      socket.removeAllListeners();
      socket.disconnect();
      this.quietUntil = Date.now() + RETRY_CONNECT_MS;
      return null;
    }
    // The socket must not keep a process alive that is done otherwise.
    (socket.io.engine?.transport as unknown as { ws?: { _socket?: { unref?: () => void } } } | undefined)?.ws?._socket?.unref?.();
    socket.on('disconnect', () => {
      if (this.socket === socket) {
        this.socket = null;
        this.heard = 0;
      }
    });
    socket.on('sandbox.state.updated', (payload: unknown) => this.onState(payload));
    // Any of the organization's sandbox events shows the gateway sends it events at all.
    for (const event of ['sandbox.created', 'sandbox.desired-state.updated']) socket.on(event, () => void this.heard++);
    this.socket = socket;
    this.connectedAt = performance.now();
    this.heard = 0;
    return socket;
  }

  private onState(payload: unknown): void {
    const parsed = StateUpdatedSchema.safeParse(payload);
    if (!parsed.success) return;
    this.heard++;
    const id = parsed.data.sandbox.id;
    this.latest.delete(id);
    this.latest.set(id, { state: parsed.data.newState, at: performance.now() });
    if (this.latest.size > LATEST_KEPT) this.latest.delete(this.latest.keys().next().value!);
    const handlers = this.waiters.get(id);
    if (handlers) for (const handler of [...handlers]) handler(parsed.data.newState);
  }
}
