import { execFileSync } from 'node:child_process';
import { chmodSync, writeFileSync } from 'node:fs';
import { createServer, type Socket } from 'node:net';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { afterEach, describe, expect, it } from 'vitest';
import { freePort, startPrivateRedis, stopPrivateRedis } from '../src/redis-server.ts';
import { dirFor } from './helpers/env.ts';
import { serverFor } from './helpers/redis-process.ts';

// The all-in-one `start` runs a private redis-server when no Redis answers. The port it finds
// free may be taken before the server binds it, by another Redis even: that one answers there.
// It must start on another port and never use that one. redis-server on the PATH is a wrapper
// here that waits a second before it starts the real one, as a slow machine (or a wrapper
// script) would: its own server is still starting when the other answers.

const REAL = execFileSync('sh', ['-c', 'command -v redis-server'], { encoding: 'utf8' }).trim();

/** Runs `fn` with `redis-server` on the PATH being `script` (sh), then puts the PATH back. */
async function withRedisServer<T>(dir: string, script: string, fn: () => Promise<T>): Promise<T> {
  const file = join(dir, 'redis-server');
  writeFileSync(file, `#!/bin/sh\n${script}\n`);
  chmodSync(file, 0o755);
  const path = process.env.PATH;
  process.env.PATH = `${dir}:${path}`;
  try {
    return await fn();
  } finally {
    process.env.PATH = path;
  }
}

const runId = async (url: string) => {
  const client = new Redis(url);
  try {
    return /^run_id:(\w+)/m.exec(await client.info('server'))?.[1];
  } finally {
    client.disconnect();
  }
};

describe.sequential('the private Redis of `lease-ops start`', () => {
  // Whatever a test started is stopped when it ends, even one still starting when it failed.
  afterEach(() => stopPrivateRedis());

  it('starts on another port when another Redis took the one it found free, and never uses that one', async ({ onTestFinished }) => {
    const other = await serverFor(onTestFinished);
    const ports = [other.port];
    const mine = await withRedisServer(dirFor(onTestFinished, 'lease-ops-wrap-'), `sleep 1\nexec ${REAL} "$@"`, () => startPrivateRedis(async () => ports.shift() ?? freePort()));
    onTestFinished(() => mine?.stop());
    expect(mine).not.toBeNull();
    expect(mine!.url).not.toBe(other.url);
    const [mineId, otherId] = await Promise.all([runId(mine!.url), runId(other.url)]);
    expect(mineId).toMatch(/^\w{40}$/);
    expect(mineId).not.toBe(otherId);
  });

  it('moves on from a port where something accepts connections and never answers, instead of waiting for it for ever', async ({ onTestFinished }) => {
    const sockets = new Set<Socket>();
    const silent = createServer((socket) => void sockets.add(socket));
    await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
    onTestFinished(async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => silent.close(resolve));
    });
    const taken = (silent.address() as { port: number }).port;
    const ports = [taken];
    const mine = await startPrivateRedis(async () => ports.shift() ?? freePort());
    onTestFinished(() => mine?.stop());
    expect(mine!.url).not.toBe(`redis://127.0.0.1:${taken}`);
    expect(await runId(mine!.url)).toMatch(/^\w{40}$/);
  });

  it('says what redis-server said when it stops for another reason than its port', async ({ onTestFinished }) => {
    await expect(withRedisServer(dirFor(onTestFinished, 'lease-ops-wrap-'), 'case "$1" in --version) exit 0;; esac\necho "FATAL CONFIG FILE ERROR (a test)" >&2\nexit 1', () => startPrivateRedis())).rejects.toThrow(/stopped before it answered .*FATAL CONFIG FILE ERROR \(a test\)/);
  });
});
