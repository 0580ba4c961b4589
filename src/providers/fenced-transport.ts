import http from 'node:http';
import https from 'node:https';
import type { Socket } from 'node:net';

/** A request refused at the last moment: its attempt's fence was not fresh when it was about to be sent. */
export class FenceWindowError extends Error {
  override name = 'FenceWindowError';
  readonly code = 'fence_window_passed';
}

type WriteGeneric = (this: Socket, writev: boolean, data: unknown, encoding: string, cb: (err?: Error | null) => void) => unknown;

/**
 * An HTTP transport (axios' `transport` option; fenced-fetch.ts uses it too) that checks
 * `isFresh()` synchronously at the last point JavaScript sees before a request's bytes go
 * to the kernel: net.Socket's `_writeGeneric`, called for each write (for a socket still
 * connecting, again once it connected). A process frozen (SIGSTOP, a long GC) after its fence
 * check wakes up here and drops the request instead of sending it late.
 *
 * What remains is the few microseconds between this check and the write system call: a
 * freeze exactly there sends the request late, and only the provider could refuse it then
 * (docs/reliability.md, "Fencing and its limits"). Checking at the socket's 'socket' event
 * instead left tens of microseconds (Node's cork, buffering and flush in between); a
 * process stopped at random 30 times while sending 20 requests at a time sent about 6
 * requests late that way (see test/fenced-transport.test.ts for the pinned behaviour).
 */
export function fencedTransport(isFresh: () => boolean) {
  return {
    request(options: http.RequestOptions, callback?: (res: http.IncomingMessage) => void): http.ClientRequest {
      const req = (options.protocol === 'https:' ? https : http).request(options, callback);
      req.on('socket', (socket: Socket & { _writeGeneric?: WriteGeneric }) => {
        const original = socket._writeGeneric;
        if (typeof original !== 'function') {
          // Not a net.Socket as Node 20 builds it: check now, at the hand-over.
          if (!isFresh()) req.destroy(new FenceWindowError('the attempt was not confirmed recently enough to send this request'));
          return;
        }
        // Only this request's writes are checked: a keep-alive socket goes back to the pool after.
        const restore = () => {
          if (socket._writeGeneric === guarded) socket._writeGeneric = original;
        };
        const guarded: WriteGeneric = function (this: Socket, writev, data, encoding, cb) {
          if (!isFresh()) {
            restore();
            const err = new FenceWindowError('the attempt was not confirmed recently enough to send this request');
            req.destroy(err);
            cb(err);
            return false;
          }
          return original.call(this, writev, data, encoding, cb);
        };
        socket._writeGeneric = guarded;
        req.once('finish', restore);
        req.once('close', restore);
      });
      return req;
    },
  };
}
