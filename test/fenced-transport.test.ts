import { once } from 'node:events';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import axios, { isAxiosError } from 'axios';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { fencedTransport, FenceWindowError } from '../src/providers/fenced-transport.ts';

describe('fenced transport', () => {
  let server: http.Server;
  let url: string;
  const received: string[] = [];
  const keepAlive = new http.Agent({ keepAlive: true, maxSockets: 1 });

  beforeAll(async () => {
    server = http.createServer((req, res) => {
      received.push(req.url ?? '');
      res.end('{}');
    });
    server.listen(0, '127.0.0.1');
    await once(server, 'listening');
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });
  afterAll(() => {
    keepAlive.destroy();
    server.closeAllConnections();
    server.close();
  });

  const send = (path: string, fresh: () => boolean) =>
    axios.get(`${url}${path}`, { transport: fencedTransport(fresh), httpAgent: keepAlive }).then(
      () => 'sent',
      (err: unknown) => (isAxiosError(err) && err.cause instanceof FenceWindowError ? 'dropped' : `error: ${String(err)}`),
    );

  it('sends while the fence is fresh, on a new connection and on a reused one', async () => {
    expect(await send('/a', () => true)).toBe('sent');
    expect(await send('/b', () => true)).toBe('sent');
    expect(received).toEqual(['/a', '/b']);
  });

  it('drops a request whose fence went stale before it left the process: the server never sees it', async () => {
    // Reused keep-alive socket: checked when the socket is handed over.
    expect(await send('/stale-reused', () => false)).toBe('dropped');
    // New connection: checked on connect, before the buffered request is written.
    const fresh = new http.Agent({ keepAlive: false });
    const r = await axios
      .get(`${url}/stale-new`, { transport: fencedTransport(() => false), httpAgent: fresh })
      .then(() => 'sent', (err: unknown) => (isAxiosError(err) && err.cause instanceof FenceWindowError ? 'dropped' : String(err)));
    expect(r).toBe('dropped');
    // Freshness is asked at send time, not when the request was built.
    let freshNow = true;
    const pending = send('/turned-stale', () => freshNow);
    freshNow = false;
    expect(await pending).toBe('dropped');
    expect(received).not.toContain('/stale-reused');
    expect(received).not.toContain('/stale-new');
    expect(received).not.toContain('/turned-stale');
    expect(await send('/after', () => true)).toBe('sent');
    expect(received.at(-1)).toBe('/after');
  });

  it('checks at the write itself, not when the socket is handed over: staleness in between drops the request', async () => {
    // Node's hand-over and its cork, buffering and flush take tens of microseconds: a process
    // frozen there used to send late. Here the fence turns stale in that gap.
    for (const agent of [keepAlive, new http.Agent({ keepAlive: false })]) {
      let fresh = true;
      const r = await axios
        .get(`${url}/stale-at-hand-over`, {
          httpAgent: agent,
          transport: {
            request: (options: http.RequestOptions, cb?: (res: http.IncomingMessage) => void) => {
              const req = fencedTransport(() => fresh).request(options, cb);
              req.on('socket', () => (fresh = false));
              return req;
            },
          },
        })
        .then(() => 'sent', (err: unknown) => (isAxiosError(err) && err.cause instanceof FenceWindowError ? 'dropped' : String(err)));
      expect(r).toBe('dropped');
    }
    expect(received).not.toContain('/stale-at-hand-over');
    // The socket it would have used still works for fresh requests afterwards.
    expect(await send('/after-hand-over', () => true)).toBe('sent');
  });
});

describe('fencing at send for CreateOS (its SDK, with lease-ops\' fetch)', () => {
  it('a request whose attempt went stale after its fence check never reaches CreateOS; a fresh check lets it go once', async () => {
    const { CreateosFake } = await import('../src/fakes/createos-fake.ts');
    const { createCreateosProvider } = await import('../src/providers/createos/index.ts');
    const { providerContext, settled } = await import('./helpers/provider-context.ts');
    const fake = new CreateosFake({ apiKey: 'k' });
    const provider = createCreateosProvider({ apiUrl: await fake.listen(), apiKey: 'k', requestsPerMinute: 60_000 });
    try {
      const c = providerContext('fenced');
      const { providerLeaseId } = await settled(() => provider.acquire(c, { runId: 'r' }));
      // The fence check passes, but by the time the bytes would leave, the attempt is stale.
      const stale = providerContext('fenced', 'env-a', { attemptId: 'stale-attempt:1', fenceIsFresh: () => false });
      await expect(provider.stop(stale, { providerLeaseId })).rejects.toMatchObject({ kind: 'transient', code: 'fence_window_passed' });
      expect(fake.calls.filter((call) => call.attempt === 'stale-attempt:1')).toEqual([]);
      // Stale once (a pause between check and send), then confirmed again: sent exactly once.
      let checks = 0;
      const once = providerContext('fenced', 'env-a', { attemptId: 'late-attempt:1', fenceIsFresh: () => checks++ > 0 });
      expect(await provider.status(once, { providerLeaseId })).toEqual({ kind: 'running' });
      expect(fake.calls.filter((call) => call.attempt === 'late-attempt:1')).toHaveLength(1);
    } finally {
      await fake.close();
    }
  });
});
