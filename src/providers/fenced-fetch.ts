import http from 'node:http';
import https from 'node:https';
import { fencedTransport } from './fenced-transport.ts';

const agents = { http: new http.Agent({ keepAlive: true }), https: new https.Agent({ keepAlive: true }) };

/**
 * A `fetch` for SDKs that take one (CreateOS'), sent over node:http with the fenced
 * transport: `isFresh()` is checked synchronously at the moment the request's bytes would
 * leave the process, and a stale request is dropped with FenceWindowError. Bodies are the
 * strings and bytes a JSON API sends; the whole reply is read before it is handed back.
 */
export function fencedFetch(isFresh: () => boolean): typeof fetch {
  const transport = fencedTransport(isFresh);
  return (input, init = {}) =>
    new Promise<Response>((resolve, reject) => {
      const url = new URL(typeof input === 'string' ? input : input instanceof URL ? input.href : input.url);
      const headers: Record<string, string> = {};
      new Headers(init.headers).forEach((value, key) => (headers[key] = value));
      const body = init.body == null ? undefined : typeof init.body === 'string' ? init.body : Buffer.from(init.body as Uint8Array);
      if (body !== undefined) headers['content-length'] = String(Buffer.byteLength(body));
      const signal = init.signal ?? undefined;
      if (signal?.aborted) return reject(signal.reason as Error);
      const fail = (err: unknown) => {
        signal?.removeEventListener('abort', onAbort);
        reject(err as Error);
      };
      const req = transport.request(
        {
          protocol: url.protocol,
          hostname: url.hostname,
          port: url.port,
          path: `${url.pathname}${url.search}`,
          method: init.method ?? 'GET',
          headers,
          agent: url.protocol === 'https:' ? agents.https : agents.http,
        },
        (res) => {
          const chunks: Buffer[] = [];
          res.on('data', (chunk: Buffer) => chunks.push(chunk));
          res.on('error', fail);
          res.on('end', () => {
            signal?.removeEventListener('abort', onAbort);
            const status = res.statusCode ?? 502;
            const replyHeaders = new Headers();
            for (const [key, value] of Object.entries(res.headers)) {
              for (const v of Array.isArray(value) ? value : value === undefined ? [] : [value]) replyHeaders.append(key, v);
            }
            const empty = status === 204 || status === 205 || status === 304;
            resolve(new Response(empty ? null : Buffer.concat(chunks), { status, statusText: res.statusMessage ?? '', headers: replyHeaders }));
          });
        },
      );
      const onAbort = () => req.destroy(signal!.reason as Error);
      signal?.addEventListener('abort', onAbort, { once: true });
      req.on('error', fail);
      req.end(body);
    });
}
