import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import type { Socket } from 'node:net';

/** Requests one connection may have waiting for their answers to be written (pipelined). */
export const MAX_PIPELINED = 16;

/**
 * The API's connections, at most `cap` at once. Node's own `maxConnections` refuses the
 * newcomer, so one client holding every connection idle (or with half a request's headers)
 * kept probes and every other company out until the headers timeout, and again when it
 * reconnected (issue 27). Here a connection past the cap closes the one idle longest instead:
 * a connection with a request being worked on (a long poll, a walk) is never closed for
 * another, and the newcomer goes only when every other one has such a request. A request whose
 * answer is complete no longer counts, written or not: a client that pipelines requests and
 * reads nothing held its connections "in progress" for good (helper-18). A connection with more
 * than MAX_PIPELINED answers not yet written is closed: each holds its answer in memory.
 */
export class ConnectionPool {
  /**
   * Open connections, the idle ones in the order they became idle (a Map keeps insertion
   * order): requests being worked on, and answers not yet written.
   */
  private readonly open = new Map<Socket, { working: number; unwritten: number }>();
  /** Connections closed to let another in (for /metrics). */
  evicted = 0;
  /** Connections closed for pipelining more than MAX_PIPELINED requests ahead (for /metrics). */
  overPipelined = 0;

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
    this.open.set(socket, { working: 0, unwritten: 0 });
    socket.once('close', () => this.open.delete(socket));
    if (this.open.size <= this.cap) return;
    for (const [other, state] of this.open) {
      if (other === socket || state.working > 0) continue;
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
    state.working++;
    state.unwritten++;
    if (state.unwritten > MAX_PIPELINED) {
      this.overPipelined++;
      socket.destroy();
      return;
    }
    let working = true;
    const done = () => {
      if (!working) return;
      working = false;
      state.working--;
      // Idle again: to the end of the line of idle ones.
      if (state.working === 0 && this.open.delete(socket)) this.open.set(socket, state);
    };
    // Complete when the app ends it, though it may wait to be written behind another's.
    const end = res.end.bind(res) as (...args: unknown[]) => ServerResponse;
    res.end = ((...args: unknown[]) => {
      done();
      return end(...args);
    }) as typeof res.end;
    res.once('close', () => {
      state.unwritten--;
      done();
    });
  }
}
