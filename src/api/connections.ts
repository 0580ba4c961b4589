import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import type { Socket } from 'node:net';

/**
 * The API's connections, at most `cap` at once. Node's own `maxConnections` refuses the
 * newcomer, so one client holding every connection idle (or with half a request's headers)
 * kept probes and every other company out until the headers timeout, and again when it
 * reconnected (issue 27). Here a connection past the cap closes the one idle longest instead:
 * a connection with a request in progress (a long poll, a walk) is never closed for another,
 * and the newcomer goes only when every other one has a request in progress.
 */
export class ConnectionPool {
  /** Open connections, the idle ones in the order they became idle (a Map keeps insertion order). */
  private readonly open = new Map<Socket, { requests: number }>();
  /** Connections closed to let another in (for /metrics). */
  evicted = 0;

  constructor(private readonly cap: number) {}

  /** Takes charge of `server`'s connections (before it listens). */
  attach(server: Server): void {
    // A backstop only: a closed socket leaves Node's count when its close event has run.
    server.maxConnections = this.cap * 2;
    server.on('connection', (socket: Socket) => this.admit(socket));
    server.on('request', (req: IncomingMessage, res: ServerResponse) => this.busy(req.socket, res));
  }

  /** Open connections now. */
  get size(): number {
    return this.open.size;
  }

  private admit(socket: Socket): void {
    this.open.set(socket, { requests: 0 });
    socket.once('close', () => this.open.delete(socket));
    if (this.open.size <= this.cap) return;
    for (const [other, state] of this.open) {
      if (other === socket || state.requests > 0) continue;
      this.evicted++;
      this.open.delete(other);
      other.destroy();
      return;
    }
    socket.destroy();
  }

  private busy(socket: Socket, res: ServerResponse): void {
    const state = this.open.get(socket);
    if (!state) return;
    state.requests++;
    res.once('close', () => {
      state.requests--;
      // Idle again: to the end of the line of idle ones.
      if (state.requests === 0 && this.open.delete(socket)) this.open.set(socket, state);
    });
  }
}
