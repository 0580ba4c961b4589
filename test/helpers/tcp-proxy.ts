import { connect, createServer, type Server, type Socket } from 'node:net';

/**
 * A TCP proxy in front of a Redis server, for faults Redis itself cannot make: it forwards
 * both ways until told to cut the connections that sent a blocking command (BullMQ's wait
 * for work) and refuse every new connection, while the others keep working.
 */
export class TcpProxy {
  private readonly sockets = new Set<Socket>();
  private readonly blocking = new Set<Socket>();

  private constructor(
    private server: Server | null,
    readonly port: number,
  ) {}

  static async start(targetPort: number): Promise<TcpProxy> {
    const server = createServer();
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const proxy = new TcpProxy(server, (server.address() as { port: number }).port);
    server.on('connection', (client) => {
      const upstream = connect(targetPort, '127.0.0.1');
      const drop = () => {
        client.destroy();
        upstream.destroy();
        proxy.sockets.delete(client);
        proxy.blocking.delete(client);
      };
      proxy.sockets.add(client);
      client.on('data', (data) => {
        if (/BZPOPMIN/i.test(data.toString('latin1'))) proxy.blocking.add(client);
        upstream.write(data);
      });
      upstream.on('data', (data) => client.write(data));
      for (const socket of [client, upstream]) {
        socket.on('close', drop);
        socket.on('error', drop);
      }
    });
    return proxy;
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** How many connections have sent a blocking command so far. */
  get blockingCount(): number {
    return this.blocking.size;
  }

  /** Refuses new connections and cuts those that sent a blocking command; the rest go on. */
  cutBlockingAndRefuseNew(): void {
    this.server?.close();
    this.server = null;
    for (const socket of this.blocking) socket.destroy();
  }

  close(): void {
    this.server?.close();
    this.server = null;
    for (const socket of this.sockets) socket.destroy();
  }
}
