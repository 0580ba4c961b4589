import { once } from 'node:events';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';

/** A real HTTP server on a free port of 127.0.0.1 whose answers a test sets as it goes (`answer`). */
export class HttpStub {
  /** How the next requests are answered. */
  answer: (req: IncomingMessage, res: ServerResponse) => void = () => undefined;
  /** Requests taken since the stub started (a test may reset it). */
  asked = 0;
  private constructor(
    private readonly server: Server,
    /** http://127.0.0.1:<port> */
    readonly base: string,
  ) {}

  static async start(): Promise<HttpStub> {
    let stub: HttpStub | null = null;
    const server = createServer((req, res) => {
      stub!.asked++;
      stub!.answer(req, res);
    });
    server.listen(0, '127.0.0.1');
    await once(server, 'listening');
    stub = new HttpStub(server, `http://127.0.0.1:${(server.address() as AddressInfo).port}`);
    return stub;
  }

  /** A stub closed when the test ends (pass the test context's onTestFinished): tests with one each can run at once. */
  static async startFor(finished: (close: () => void) => void): Promise<HttpStub> {
    const stub = await HttpStub.start();
    finished(() => stub.close());
    return stub;
  }

  close(): void {
    this.server.closeAllConnections();
    this.server.close();
  }
}
