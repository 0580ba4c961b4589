import http from 'node:http';
import https from 'node:https';

/** A request refused at the last moment: its attempt's fence was not fresh when it was about to be sent. */
export class FenceWindowError extends Error {
  override name = 'FenceWindowError';
  readonly code = 'fence_window_passed';
}

/**
 * An HTTP transport (axios' `transport` option) that checks `isFresh()` synchronously just
 * before the request's bytes leave the process: when the socket is handed over, or, for a
 * new connection, before the request buffered for it is written on connect. A process paused
 * between its awaited fence check and the send wakes up here and drops the request.
 */
export function fencedTransport(isFresh: () => boolean) {
  return {
    request(options: http.RequestOptions, callback?: (res: http.IncomingMessage) => void): http.ClientRequest {
      const req = (options.protocol === 'https:' ? https : http).request(options, callback);
      req.on('socket', (socket) => {
        const guard = () => {
          if (!isFresh()) req.destroy(new FenceWindowError('the attempt was not confirmed recently enough to send this request'));
        };
        // Node writes a request buffered for a connecting socket from a 'connect' listener;
        // this one goes first. On a ready socket the request is flushed right after 'socket'.
        if (socket.connecting) socket.prependOnceListener('connect', guard);
        else guard();
      });
      return req;
    },
  };
}
