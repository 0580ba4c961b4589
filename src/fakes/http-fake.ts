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
}

export interface FakeReply {
  status: number;
  body?: unknown;
  headers?: Record<string, string>;
}

export type FakeRoute = (req: {
  method: string;
  path: string;
  query: URLSearchParams;
  body: unknown;
  headers: IncomingMessage['headers'];
}) => Promise<RouteResult> | RouteResult;

export interface RouteResult {
  reply: FakeReply;
  sandboxId: string | null;
  injected?: boolean;
}

/**
 * The HTTP plumbing shared by the provider fakes: a real server on loopback, JSON in and
 * out, and a log of every call with its start and end, so tests can check from the
 * provider's side that calls for one sandbox never overlapped.
 */
export class HttpFake {
  readonly calls: FakeCall[] = [];
  private server: Server | null = null;
  private baseUrl = '';

  constructor(private readonly route: FakeRoute) {}

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
      for (let i = 1; i < calls.length; i++) {
        if (calls[i]!.start < calls[i - 1]!.end) found.push(`${id}: ${calls[i]!.method} ${calls[i]!.path} overlapped ${calls[i - 1]!.method} ${calls[i - 1]!.path}`);
      }
    }
    return found;
  }

  private async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const start = process.hrtime.bigint();
    const url = new URL(req.url ?? '/', 'http://fake');
    let raw = '';
    for await (const chunk of req) raw += chunk;
    let body: unknown = undefined;
    let result: Awaited<ReturnType<FakeRoute>>;
    try {
      body = raw ? JSON.parse(raw) : undefined;
      result = await this.route({ method: req.method ?? 'GET', path: url.pathname, query: url.searchParams, body, headers: req.headers });
    } catch (err) {
      result = { sandboxId: null, reply: { status: 400, body: { message: `bad request: ${(err as Error).message}` } } };
    }
    const { reply } = result;
    res.writeHead(reply.status, { 'content-type': 'application/json', ...reply.headers });
    res.end(reply.body === undefined ? '' : JSON.stringify(reply.body));
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
    });
  }
}

/** A sandbox whose state changes over time: `transition` ends in `to` at `at` (epoch ms). */
export interface Transitioning<S extends string> {
  state: S;
  transition: { to: S; at: number } | null;
}

/** What the provider fakes share: a real HTTP server, its call log, and timed transitions. */
export abstract class ApiFake {
  readonly http: HttpFake;

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
