import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { freePort } from '../../src/redis-server.ts';

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
    const redis = new RedisProcess(port ?? (await freePort()), args);
    await redis.run();
    return redis;
  }

  /** Resolves when the server logs that it accepts connections (after loading its AOF). */
  private async run(): Promise<void> {
    const child = spawn('redis-server', ['--port', String(this.port), '--bind', '127.0.0.1', '--save', '', '--dir', this.dir, ...this.args], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    this.child = child;
    await new Promise<void>((resolve, reject) => {
      createInterface({ input: child.stdout! }).on('line', (line) => {
        if (line.includes('Ready to accept connections')) resolve();
      });
      child.once('exit', (code) => reject(new Error(`redis-server on ${this.port} exited (${code})`)));
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
