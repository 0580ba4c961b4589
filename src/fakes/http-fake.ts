import { EventEmitter } from 'node:events';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';

/** One request the fake served, on the shared monotonic clock (process.hrtime, ns). */
export interface FakeCall {
  sandboxId: string | null;
  method: string;
  path: string;
  query: string;
  status: number;
  start: bigint;
  end: bigint;
  /** The caller's X-Lease-Ops-Attempt header (`<jobId>:<fencing token>`), if it sent one. */
  attempt?: string;
  /** Set when the fake answered with an injected fault instead of doing the work. */
  injected?: boolean;
  /** The request's JSON body, when it had one. */
  body?: unknown;
}

export interface FakeReply {
  status: number;
  /** Sent as JSON. */
  body?: unknown;
  /** Sent as it is instead of `body` (a reply that is not JSON, or not the JSON it should be). */
  raw?: string;
  headers?: Record<string, string>;
  /** Wait this long before answering (a call slower than the client's timeout). */
  delayMs?: number;
  /** Answer only once this settles (a test holds the reply while it kills the caller). */
  hold?: Promise<unknown>;
  /** Send the status line and this many bytes of the body, then cut the connection. */
  cutAfterBytes?: number;
}

export interface FakeRequest {
  method: string;
  path: string;
  query: URLSearchParams;
  body: unknown;
  headers: IncomingMessage['headers'];
  /** The caller's address: rate limits that count per caller IP key on it. */
  remoteAddress: string;
}

export type FakeRoute = (req: FakeRequest) => Promise<RouteResult> | RouteResult;

export interface RouteResult {
  reply: FakeReply;
  sandboxId: string | null;
  injected?: boolean;
}

/**
 * The HTTP plumbing shared by the provider fakes: a real server on loopback, JSON in and
 * out, and a log of every call with its start and end, so tests can check from the
 * provider's side that calls for one sandbox never overlapped. Emits `request` (method,
 * path) as each request arrives, before it is answered, so a test can act at that moment.
 */
export class HttpFake extends EventEmitter {
  readonly calls: FakeCall[] = [];
  private server: Server | null = null;
  private baseUrl = '';

  constructor(private readonly route: FakeRoute) {
    super();
  }

  /** The listening server (for a websocket gateway beside the routes). */
  get nodeServer(): Server {
    if (!this.server) throw new Error('fake is not listening');
    return this.server;
  }

  get url(): string {
    if (!this.server) throw new Error('fake is not listening');
    return this.baseUrl;
  }

  async listen(port = 0, host = '127.0.0.1'): Promise<string> {
    this.server = createServer((req, res) => void this.handle(req, res));
    await new Promise<void>((resolve) => this.server!.listen(port, host, resolve));
    this.baseUrl = `http://${host === '0.0.0.0' ? '127.0.0.1' : host}:${(this.server.address() as AddressInfo).port}`;
    return this.baseUrl;
  }

  async close(): Promise<void> {
    const server = this.server;
    this.server = null;
    if (!server) return;
    server.closeAllConnections();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  }

  /** Pairs of calls on one sandbox that were in flight at the same time. */
  overlaps(): string[] {
    const bySandbox = new Map<string, FakeCall[]>();
    for (const c of this.calls) {
      if (!c.sandboxId) continue;
      bySandbox.set(c.sandboxId, [...(bySandbox.get(c.sandboxId) ?? []), c]);
    }
    const found: string[] = [];
    for (const [id, calls] of bySandbox) {
      calls.sort((a, b) => (a.start < b.start ? -1 : 1));
      // Against the call that ends last so far, not just the one before: a long call can
      // overlap several short ones.
      let longest = calls[0]!;
      for (const call of calls.slice(1)) {
        if (call.start < longest.end) found.push(`${id}: ${call.method} ${call.path} overlapped ${longest.method} ${longest.path}`);
        if (call.end > longest.end) longest = call;
      }
    }
    return found;
  }

  /** Added to every reply's delay, as a congested API answers everything late; a request
   *  takes the value it finds when it arrives. */
  slowRepliesMs = 0;

  /** Requests being handled now (a delayed reply counts until it is sent): the call log is complete when 0. */
  get inFlight(): number {
    return this.handling;
  }
  private handling = 0;

  private async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    this.handling++;
    try {
      await this.handleOne(req, res);
    } finally {
      this.handling--;
    }
  }

  private async handleOne(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const start = process.hrtime.bigint();
    const slowBy = this.slowRepliesMs;
    const url = new URL(req.url ?? '/', 'http://fake');
    let raw = '';
    for await (const chunk of req) raw += chunk;
    this.emit('request', { method: req.method ?? 'GET', path: url.pathname });
    let body: unknown = undefined;
    let result: Awaited<ReturnType<FakeRoute>>;
    try {
      body = raw ? JSON.parse(raw) : undefined;
      result = await this.route({
        method: req.method ?? 'GET',
        path: url.pathname,
        query: url.searchParams,
        body,
        headers: req.headers,
        remoteAddress: req.socket.remoteAddress ?? '',
      });
    } catch (err) {
      result = { sandboxId: null, reply: { status: 400, body: { message: `bad request: ${(err as Error).message}` } } };
    }
    const { reply } = result;
    const delayMs = (reply.delayMs ?? 0) + slowBy;
    if (delayMs) await new Promise((r) => setTimeout(r, delayMs));
    if (reply.hold) await reply.hold.catch(() => undefined);
    const text = reply.raw ?? (reply.body === undefined ? '' : JSON.stringify(reply.body));
    if (!res.destroyed) {
      if (reply.cutAfterBytes !== undefined) {
        // Promise a whole body, send part of it, then drop the connection.
        res.writeHead(reply.status, { 'content-type': 'application/json', 'content-length': String(Buffer.byteLength(text)), ...reply.headers });
        res.write(text.slice(0, reply.cutAfterBytes), () => res.destroy());
      } else {
        res.writeHead(reply.status, { 'content-type': 'application/json', ...reply.headers });
        res.end(text);
      }
    }
    const attempt = req.headers['x-lease-ops-attempt'];
    this.calls.push({
      sandboxId: result.sandboxId,
      method: req.method ?? 'GET',
      path: url.pathname,
      query: url.search,
      status: reply.status,
      start,
      end: process.hrtime.bigint(),
      ...(typeof attempt === 'string' ? { attempt } : {}),
      ...(result.injected ? { injected: true } : {}),
      ...(body === undefined ? {} : { body }),
    });
  }
}

/** A sandbox whose state changes over time: `transition` ends in `to` at `at` (epoch ms). */
export interface Transitioning<S extends string> {
  state: S;
  transition: { to: S; at: number } | null;
}

/** A fault a test arms for the next create request: the sandbox is made, its reply goes wrong. */
export type CreateFault =
  | { kind: 'cut' }
  | { kind: 'invalid' }
  | { kind: 'status'; status: number }
  | { kind: 'slow'; delayMs: number }
  | { kind: 'hold'; until: Promise<unknown> }
  /** The reply is as usual, but the sandbox takes this long to come up. */
  | { kind: 'slow-boot'; bootMs: number };

/** How a create fault changes the reply of a create that did make its sandbox. */
export function applyCreateFault(fault: CreateFault | undefined, reply: FakeReply): FakeReply {
  switch (fault?.kind) {
    case undefined:
    case 'slow-boot':
      return reply;
    case 'cut':
      return { ...reply, cutAfterBytes: 12 };
    case 'invalid':
      return { status: reply.status, raw: '{"id": 42, "state": ["not", "a", "state"]' };
    case 'status':
      return { status: fault.status, body: { message: `injected ${fault.status} after the sandbox was made` } };
    case 'slow':
      return { ...reply, delayMs: fault.delayMs };
    case 'hold':
      return { ...reply, hold: fault.until };
  }
}

/** A fixed-window request counter: `limit` requests per `windowMs` per key. */
export class WindowLimit {
  private readonly windows = new Map<string, { start: number; count: number }>();
  constructor(readonly limit: number, readonly windowMs: number) {}

  /** Counts a request; returns the seconds until the window resets if it is over the limit, else null. */
  take(key: string, now = Date.now()): number | null {
    let w = this.windows.get(key);
    if (!w || now - w.start >= this.windowMs) {
      w = { start: now, count: 0 };
      this.windows.set(key, w);
    }
    w.count++;
    return w.count > this.limit ? Math.max(1, Math.ceil((w.start + this.windowMs - now) / 1000)) : null;
  }
}

/** What the provider fakes share: a real HTTP server, its call log, and timed transitions. */
export abstract class ApiFake {
  readonly http: HttpFake;
  private readonly createFaults: { fault: CreateFault; forCreate: ((body: unknown) => boolean) | undefined }[] = [];

  constructor(route: FakeRoute) {
    this.http = new HttpFake(route);
  }

  get calls(): FakeCall[] {
    return this.http.calls;
  }

  listen(port = 0, host?: string): Promise<string> {
    return this.http.listen(port, host);
  }

  close(): Promise<void> {
    return this.http.close();
  }

  /**
   * The next create makes its sandbox as usual, then answers with this fault; with `forCreate`,
   * the next create whose request body it accepts (one run's, say: tests that share a fake).
   */
  failNextCreate(fault: CreateFault, forCreate?: (body: unknown) => boolean): void {
    this.createFaults.push({ fault, forCreate });
  }

  /** Resolves when a request with this method whose path matches arrives (before it is answered). */
  nextRequest(method: string, path: RegExp): Promise<void> {
    return new Promise((resolve) => {
      const onRequest = (r: { method: string; path: string }) => {
        if (r.method !== method || !path.test(r.path)) return;
        this.http.off('request', onRequest);
        resolve();
      };
      this.http.on('request', onRequest);
    });
  }

  /**
   * A create with the fault meant for it: the first aimed at this create, else the first aimed
   * at none (a matcher that throws, on a body it did not expect, matches nothing). The fault is
   * used up only when `create` made a sandbox: a create refused before (a name taken, a bad
   * size) answers as usual and leaves it for the next.
   */
  protected createWithFault(body: unknown, create: (bootMs: number | undefined) => { reply: FakeReply; sandboxId: string | null }): { reply: FakeReply; sandboxId: string | null } {
    const aimedHere = (f: { forCreate: ((body: unknown) => boolean) | undefined }) => {
      try {
        return f.forCreate?.(body) === true;
      } catch {
        return false;
      }
    };
    let i = this.createFaults.findIndex(aimedHere);
    if (i === -1) i = this.createFaults.findIndex((f) => !f.forCreate);
    const fault = i === -1 ? undefined : this.createFaults[i]!.fault;
    const created = create(fault?.kind === 'slow-boot' ? fault.bootMs : undefined);
    if (created.sandboxId === null) return created;
    if (i !== -1) this.createFaults.splice(i, 1);
    return { reply: applyCreateFault(fault, created.reply), sandboxId: created.sandboxId };
  }

  /** Ends a transition that is due. Returns true when one ended. */
  protected settleTransition<S extends string>(sb: Transitioning<S>): boolean {
    if (!sb.transition || Date.now() < sb.transition.at) return false;
    sb.state = sb.transition.to;
    sb.transition = null;
    return true;
  }

  /** Enters `via` until `ms` have passed, then `to` (at once when ms <= 0). */
  protected beginTransition<S extends string>(sb: Transitioning<S>, via: S, to: S, ms: number): void {
    sb.state = ms > 0 ? via : to;
    sb.transition = ms > 0 ? { to, at: Date.now() + ms } : null;
  }
}
