import { Redis } from 'ioredis';
import { expect, it } from 'vitest';
import { freePort, startPrivateRedis } from '../src/redis-server.ts';
import { serverFor } from './helpers/redis-process.ts';

// The all-in-one `start` runs a private redis-server when no Redis answers. The port it finds
// free may be taken before the server binds it, by another Redis even: that server answers
// there, and the private one's own has exited. It must start on another port, not use that one.
it('starts the private Redis on another port when another Redis took the one it found free, and never uses that one', async ({ onTestFinished }) => {
  const other = await serverFor(onTestFinished);
  const ports = [other.port];
  const mine = await startPrivateRedis(async () => ports.shift() ?? freePort());
  onTestFinished(() => mine?.stop());
  expect(mine).not.toBeNull();
  expect(mine!.url).not.toBe(other.url);
  const runId = async (url: string) => {
    const client = new Redis(url);
    try {
      return /^run_id:(\w+)/m.exec(await client.info('server'))?.[1];
    } finally {
      client.disconnect();
    }
  };
  const [mineId, otherId] = await Promise.all([runId(mine!.url), runId(other.url)]);
  expect(mineId).toMatch(/^\w{40}$/);
  expect(mineId).not.toBe(otherId);
});
