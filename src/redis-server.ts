import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, realpathSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { Redis } from 'ioredis';
import { ConfigError } from './config.ts';
import { isClusterUrl } from './queues/redis.ts';
import { maskUrl } from './secrets.ts';

/** True when a Redis answers PING at the URL within a short time. */
export async function redisAnswers(url: string, timeoutMs = 1_500): Promise<boolean> {
  return (await probeRedis(url, timeoutMs)) === 'answers';
}

/** Whether a Redis answers at the URL, refuses its credentials, or is not there. */
export async function probeRedis(url: string, timeoutMs = 1_500): Promise<'answers' | 'refuses-credentials' | 'absent'> {
  // commandTimeout too: a listener that accepts and never answers would hold the probe for ever (helper-52).
  const client = new Redis(url, { lazyConnect: true, connectTimeout: timeoutMs, commandTimeout: timeoutMs, maxRetriesPerRequest: 0, retryStrategy: () => null });
  // A refused AUTH comes as an error event; connect() then rejects with "Connection is closed".
  let lastError: unknown;
  client.on('error', (err: unknown) => (lastError = err));
  try {
    await client.connect();
    return (await client.ping()) === 'PONG' ? 'answers' : 'absent';
  } catch (err) {
    const said = `${String((err as Error)?.message)} ${String((lastError as Error | undefined)?.message)}`;
    return /NOAUTH|WRONGPASS|invalid password|invalid username/i.test(said) ? 'refuses-credentials' : 'absent';
  } finally {
    client.disconnect();
  }
}

/**
 * The working directory of the Redis answering at the URL (CONFIG GET dir), '' when something
 * answers that does not say (another server, a Redis that refuses), null when nothing answers.
 */
async function answeringDir(url: string, timeoutMs: number): Promise<string | null> {
  const client = new Redis(url, { lazyConnect: true, connectTimeout: timeoutMs, commandTimeout: timeoutMs, maxRetriesPerRequest: 0, retryStrategy: () => null, enableReadyCheck: false });
  client.on('error', () => undefined);
  try {
    await client.connect();
  } catch {
    return null;
  }
  try {
    const reply = (await client.config('GET', 'dir')) as string[];
    return reply[1] ?? '';
  } catch {
    return '';
  } finally {
    client.disconnect();
  }
}

/** A TCP port on the loopback interface that nothing listens on right now. */
export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      const port = typeof address === 'object' && address ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}

const livePrivateRedis = new Set<() => void>();

/** Stops every private Redis this process started, even one not answering yet (a signal came). */
export function stopPrivateRedis(): void {
  for (const stop of [...livePrivateRedis]) stop();
}

export interface PrivateRedis {
  url: string;
  stop(): void;
}

/**
 * Starts a throwaway redis-server on a free loopback port (no persistence), for the
 * all-in-one `start` when no Redis answers. Returns null when redis-server is not installed.
 * `choosePort` is for tests.
 */
export async function startPrivateRedis(choosePort: () => Promise<number> = freePort): Promise<PrivateRedis | null> {
  if (spawnSync('redis-server', ['--version']).status !== 0) return null;
  // A port found free may be taken before the server binds it; it then exits, and whatever
  // took the port may be another Redis that answers: the next port is tried instead.
  for (let attempt = 1; ; attempt++) {
    const started = await startOn(await choosePort());
    if (started !== 'port-taken') return started;
    if (attempt >= 3) throw new Error('redis-server could not bind a free loopback port (three tries)');
  }
}

async function startOn(port: number): Promise<PrivateRedis | 'port-taken'> {
  const dir = mkdtempSync(join(tmpdir(), 'lease-ops-redis-'));
  // Ours is the server that runs in this directory (Redis reports it resolved): a pid would
  // not tell, where redis-server on the PATH is a wrapper that starts it (helper-52).
  const ownDir = realpathSync(dir);
  // In a process group of its own, killed whole: a wrapper's server goes with it.
  const child = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', dir], {
    stdio: ['ignore', 'pipe', 'pipe'],
    detached: true,
  });
  /** Its last lines, for an error that says why it stopped. */
  const said: string[] = [];
  for (const stream of [child.stdout, child.stderr]) {
    createInterface({ input: stream }).on('line', (line) => {
      said.push(line);
      if (said.length > 5) said.shift();
    });
  }
  // 'close', not 'exit': the line that says why it stopped may still be on its way at its exit.
  let exited = false;
  child.once('close', () => {
    exited = true;
  });
  const url = `redis://127.0.0.1:${port}`;
  let stopped = false;
  const stop = () => {
    if (stopped) return;
    stopped = true;
    livePrivateRedis.delete(stop);
    process.removeListener('exit', stop);
    // Nothing in it is kept (no persistence): killed, it is gone at once, even if this
    // process exits right after.
    try {
      if (child.pid !== undefined) process.kill(-child.pid, 'SIGKILL');
    } catch {
      child.kill('SIGKILL');
    }
    rmSync(dir, { recursive: true, force: true });
  };
  // On every way out the process sees (an error, process.exit, the end): not left running.
  process.once('exit', stop);
  livePrivateRedis.add(stop);
  for (let i = 0; i < 50; i++) {
    const answering = await answeringDir(url, 200);
    if (answering === ownDir) return { url, stop };
    // Another server answers there, or ours stopped because the port was taken: another port.
    if (answering !== null || (exited && said.some((line) => line.includes('Address already in use')))) {
      stop();
      return 'port-taken';
    }
    if (exited) {
      stop();
      throw new Error(`redis-server stopped before it answered on ${url}: ${said.join(' | ') || 'it said nothing'}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  stop();
  throw new Error(`redis-server did not answer on ${url}`);
}

/** Thrown when no Redis answers and none can be started; the message says how to get one. */
export class NoRedisError extends Error {
  override name = 'NoRedisError';
}

/**
 * The Redis to use: the one at `url` if it answers, else a private one (say so via
 * `onPrivate`). Throws NoRedisError, saying how to get one, when neither is possible.
 */
export async function redisOrPrivate(url: string, onPrivate: (privateUrl: string) => void): Promise<{ url: string; privateRedis: PrivateRedis | null }> {
  // A cluster is there on purpose: use it as it is.
  if (isClusterUrl(url)) return { url, privateRedis: null };
  const found = await probeRedis(url);
  if (found === 'answers') return { url, privateRedis: null };
  // A Redis that is there but refuses the credentials is a mistake to fix, not a reason to
  // run somewhere else without saying so.
  if (found === 'refuses-credentials') throw new ConfigError(`the Redis at ${maskUrl(url)} refuses the credentials in REDIS_URL: fix them (or unset REDIS_URL)`);
  const privateRedis = await startPrivateRedis();
  if (!privateRedis) {
    throw new NoRedisError(
      `no Redis answers at ${maskUrl(url)} and redis-server is not installed.\n` +
        '  Install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis),\n' +
        '  or run one with Docker: docker run -p 6379:6379 redis:7, or set REDIS_URL.',
    );
  }
  onPrivate(privateRedis.url);
  return { url: privateRedis.url, privateRedis };
}
