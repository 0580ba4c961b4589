import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { freePort } from '../../src/redis-server.ts';

class PortTakenError extends Error {
  constructor(port: number) {
    super(`redis-server on ${port} exited: a port it binds is taken`);
  }
}

/**
 * A redis-server of a test's own, on another port than the shared one, with its data in a
 * temporary directory: it can be crashed, paused and restarted without touching anyone else.
 */
export class RedisProcess {
  private child: ChildProcess | null = null;
  readonly dir = mkdtempSync(join(tmpdir(), 'lease-ops-redis-'));

  private constructor(
    readonly port: number,
    private readonly args: string[],
  ) {}

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** Starts one; `args` are redis-server options, e.g. ['--appendonly', 'yes', '--appendfsync', 'always']. */
  static async start(args: string[] = [], port?: number): Promise<RedisProcess> {
    const clusterNode = args.includes('--cluster-enabled');
    for (let attempt = 1; ; attempt++) {
      let chosen = port ?? (await freePort());
      // A cluster node also binds the port 10,000 above its own, which must be a port.
      while (port === undefined && clusterNode && chosen > 55_535) chosen = await freePort();
      const redis = new RedisProcess(chosen, args);
      try {
        await redis.run();
        return redis;
      } catch (err) {
        rmSync(redis.dir, { recursive: true, force: true });
        // A port found free may be taken before the server binds it (by another test's server
        // or connection; a cluster node's bus port, which freePort never looked at): another
        // port then (a CI run met a cluster node exiting at its start). Any other reason is
        // the test's to see, with what the server said.
        if (port !== undefined || attempt >= 5 || !(err instanceof PortTakenError)) throw err;
      }
    }
  }

  /** Resolves when the server logs that it accepts connections (after loading its AOF). */
  private async run(): Promise<void> {
    const child = spawn('redis-server', ['--port', String(this.port), '--bind', '127.0.0.1', '--save', '', '--dir', this.dir, ...this.args], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    this.child = child;
    let portTaken = false;
    const said: string[] = [];
    await new Promise<void>((resolve, reject) => {
      createInterface({ input: child.stdout! }).on('line', (line) => {
        if (line.includes('Ready to accept connections')) resolve();
        if (line.includes('Address already in use')) portTaken = true;
        said.push(line);
        if (said.length > 3) said.shift();
      });
      // 'close', not 'exit': the line that says why it stopped may still be on its way then.
      child.once('close', (code) => reject(portTaken ? new PortTakenError(this.port) : new Error(`redis-server on ${this.port} exited (${code}): ${said.join(' | ')}`)));
    });
  }

  /** SIGKILL: a crash; whatever the persistence settings did not write is lost. */
  async crash(): Promise<void> {
    const child = this.child;
    if (!child) return;
    this.child = null;
    child.kill('SIGKILL');
    if (child.exitCode === null && child.signalCode === null) await once(child, 'exit');
  }

  /** Starts it again on the same port with the same data directory. */
  restart(): Promise<void> {
    return this.run();
  }

  /** SIGSTOP: connections stay open but nothing answers (a partition, or a stuck host). */
  pause(): void {
    this.child?.kill('SIGSTOP');
  }

  resume(): void {
    this.child?.kill('SIGCONT');
  }

  async stop(): Promise<void> {
    this.resume();
    await this.crash();
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** A redis-server of the test's own, stopped when the test ends (pass the test context's onTestFinished). */
export async function serverFor(finished: (close: () => Promise<void>) => void): Promise<RedisProcess> {
  const server = await RedisProcess.start();
  finished(() => server.stop());
  return server;
}
