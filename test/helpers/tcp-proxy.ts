import { connect, createServer, type Server, type Socket } from 'node:net';

/**
 * A TCP proxy in front of a Redis server, for faults Redis itself cannot make: it forwards
 * both ways until told to cut some connections (those that sent a given command or name)
 * and refuse every new one, while the others keep working; it can then accept again.
 */
export class TcpProxy {
  /** What each client connection sent first (its handshake names it), for picking it out. */
  private readonly sent = new Map<Socket, string>();
  private server: Server | null = null;

  private constructor(
    readonly port: number,
    private readonly targetPort: number,
  ) {}

  static async start(targetPort: number): Promise<TcpProxy> {
    const probe = createServer();
    await new Promise<void>((resolve) => probe.listen(0, '127.0.0.1', resolve));
    const port = (probe.address() as { port: number }).port;
    await new Promise((resolve) => probe.close(resolve));
    const proxy = new TcpProxy(port, targetPort);
    await proxy.acceptAgain();
    return proxy;
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** How many open connections have sent something matching `pattern`. */
  count(pattern: RegExp): number {
    return [...this.sent.values()].filter((text) => pattern.test(text)).length;
  }

  /** Refuses new connections and cuts those that sent something matching `pattern`; the rest go on. */
  cutAndRefuseNew(pattern: RegExp): void {
    this.server?.close();
    this.server = null;
    for (const [socket, text] of this.sent) if (pattern.test(text)) socket.destroy();
  }

  /**
   * The next command matching `pattern` reaches Redis, but its reply never reaches the client:
   * the connection is cut when the reply comes (a link lost after Redis ran the command). The
   * client reconnects and, as ioredis does by default, sends its unanswered commands again.
   */
  loseNextReplyTo(pattern: RegExp): void {
    this.losing = pattern;
  }

  /** How many replies loseNextReplyTo has lost. */
  lostReplies = 0;
  private losing: RegExp | null = null;

  /** Accepts new connections (again). */
  async acceptAgain(): Promise<void> {
    const server = createServer((client) => this.forward(client));
    await new Promise<void>((resolve) => server.listen(this.port, '127.0.0.1', resolve));
    this.server = server;
  }

  private forward(client: Socket): void {
    const upstream = connect(this.targetPort, '127.0.0.1');
    this.sent.set(client, '');
    const drop = () => {
      client.destroy();
      upstream.destroy();
      this.sent.delete(client);
    };
    let cutOnReply = false;
    client.on('data', (data) => {
      const text = this.sent.get(client);
      if (text !== undefined && text.length < 65_536) this.sent.set(client, text + data.toString('latin1'));
      if (this.losing?.test(data.toString('latin1'))) {
        this.losing = null;
        cutOnReply = true;
      }
      upstream.write(data);
    });
    upstream.on('data', (data) => {
      if (!cutOnReply) return void client.write(data);
      this.lostReplies++;
      drop();
    });
    for (const socket of [client, upstream]) {
      socket.on('close', drop);
      socket.on('error', drop);
    }
  }

  close(): void {
    this.server?.close();
    this.server = null;
    for (const socket of this.sent.keys()) socket.destroy();
  }
}
