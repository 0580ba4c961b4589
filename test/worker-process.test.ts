import { execFile } from 'node:child_process';
import { mkdtempSync, rmSync, watch } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import { lease, REDIS_URL, TestBed } from './helpers/env.ts';
import { readCallFile } from './helpers/invariants.ts';
import { RedisProcess } from './helpers/redis-process.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const PROVIDER = fileURLToPath(new URL('./helpers/recording-provider.ts', import.meta.url));
const BIN = fileURLToPath(new URL('../bin/lease-ops.js', import.meta.url));

let bed: TestBed | undefined;
let dir: string | undefined;
afterEach(async () => {
  await bed?.close();
  if (dir) rmSync(dir, { recursive: true, force: true });
  bed = undefined;
  dir = undefined;
});

/** Resolves when the recording provider has written the record of a call's start. */
function firstCallIn(dir: string, callFile: string): Promise<void> {
  return new Promise<void>((resolve) => {
    const watcher = watch(dir, () => {
      if (readCallFile(callFile).length > 0) {
        watcher.close();
        resolve();
      }
    });
  });
}

describe('the worker process', () => {
  it('on SIGTERM finishes the operation in flight, then exits 0', async () => {
    bed = await TestBed.create();
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-term-'));
    const callFile = join(dir, 'calls.jsonl');
    const worker = new WorkerProcess({
      REDIS_URL: bed.config.REDIS_URL,
      LEASE_OPS_PREFIX: bed.config.LEASE_OPS_PREFIX,
      LEASE_OPS_PROVIDERS: PROVIDER,
      RECORDING_FILE: callFile,
      RECORDING_MIN_MS: '800',
      RECORDING_MAX_MS: '1000',
    });
    await worker.ready;
    // The provider writes a record when its call starts: that is the moment to signal.
    const callStarted = firstCallIn(dir, callFile);
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('t'), params: { providerLeaseId: 't' } });
    await callStarted;
    const ended = bed.waitForAll([jobId]);
    const termAt = process.hrtime.bigint();
    expect(await worker.terminate()).toBe(0);
    expect((await ended).get(jobId)).toBe('completed');
    const calls = readCallFile(callFile);
    expect(calls).toHaveLength(1);
    // The call was in flight when SIGTERM came, and ran to its end.
    expect(BigInt(calls[0]!.start)).toBeLessThan(termAt);
    expect(BigInt(calls[0]!.end!)).toBeGreaterThan(termAt);
  });

  // The simulated provider's embedded cloud also releases its claim in Redis on the way out.
  it.each([
    ['a test provider', { LEASE_OPS_PROVIDERS: PROVIDER }],
    ['the default embedded simulated cloud', { LEASE_OPS_PROVIDERS: 'simulated' }],
  ])('on SIGTERM with its Redis gone, stops at once instead of waiting for Redis (%s)', async (_name, providers) => {
    // BullMQ's graceful close waits for its blocking connection to end, which a connection
    // reconnecting to a Redis that is gone never does: the worker used to run on until killed.
    const server = await RedisProcess.start();
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-gone-'));
    try {
      const worker = new WorkerProcess({ REDIS_URL: server.url, LEASE_OPS_PREFIX: '{lo-gone}', RECORDING_FILE: join(dir, 'calls.jsonl'), ...providers });
      await worker.ready;
      await server.crash();
      await worker.waitForLog('Redis does not answer');
      expect(await worker.terminate(10_000)).toBe(0);
      expect(worker.logs.some((l) => l.includes('"msg":"stopping gracefully"'))).toBe(true);
      expect(worker.logs.some((l) => l.includes('closing without waiting for running jobs'))).toBe(true);
    } finally {
      await server.stop();
    }
  });

  it('on SIGTERM with an operation in flight, Redis then dying, still exits once that call ends', async () => {
    // The ping before the close found Redis; it died during the wait for the running
    // operation. Its end can never be written: the close must not wait for Redis for ever.
    const server = await RedisProcess.start();
    bed = await TestBed.create({ REDIS_URL: server.url, LEASE_OPS_PREFIX: '{lo-gone-mid}' });
    dir = mkdtempSync(join(tmpdir(), 'lease-ops-gone-mid-'));
    const callFile = join(dir, 'calls.jsonl');
    try {
      const worker = new WorkerProcess({
        REDIS_URL: server.url,
        LEASE_OPS_PREFIX: '{lo-gone-mid}',
        LEASE_OPS_PROVIDERS: PROVIDER,
        RECORDING_FILE: callFile,
        RECORDING_MIN_MS: '4000',
        RECORDING_MAX_MS: '4000',
      });
      await worker.ready;
      const callStarted = firstCallIn(dir, callFile);
      await bed.ops.enqueue({ op: 'stop', lease: lease('m'), params: { providerLeaseId: 'm' } });
      await callStarted;
      worker.child.kill('SIGTERM');
      await worker.waitForLog('"msg":"stopping gracefully"');
      await bed.close();
      bed = undefined;
      await server.crash();
      // The close sees Redis gone within about 3 s, lets the call end (4 s after it began), then exits.
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), 15_000)));
      const code = await Promise.race([worker.exited, late]).finally(() => clearTimeout(timer));
      if (code === 'late') worker.child.kill('SIGKILL');
      expect(code).toBe(0);
      // The call in flight ran to its end; the process did not cut it.
      expect(readCallFile(callFile)[0]?.end).toBeDefined();
      expect(worker.logs.some((l) => l.includes('Redis went away while closing'))).toBe(true);
    } finally {
      await server.stop();
    }
  });

  it('refuses a bad environment with a message naming the variable', async () => {
    const run = promisify(execFile)(process.execPath, [BIN, 'worker'], {
      env: { ...process.env, LEASE_OPS_CONCURRENCY: 'lots' },
    });
    await expect(run).rejects.toMatchObject({ code: 2, stderr: expect.stringMatching(/LEASE_OPS_CONCURRENCY="lots"/) });
  });

  it('`start --once` plays a full lease lifecycle over the HTTP API on the embedded simulated cloud', async () => {
    const prefix = `{lo-test-start-${process.pid}}`;
    const { stdout } = await promisify(execFile)(process.execPath, [BIN, 'start', '--once'], {
      env: { ...process.env, REDIS_URL, LEASE_OPS_PREFIX: prefix, LEASE_OPS_API_PORT: '0' },
      timeout: 60_000,
    });
    const lines = stdout.split('\n');
    for (const op of ['acquire', 'stop', 'resume', 'release']) {
      expect(lines.some((l) => new RegExp(`POST ${op}\\s+-> completed`).test(l))).toBe(true);
    }
    expect(stdout).toMatch(/lifecycle done/);
    bed = await TestBed.create({ LEASE_OPS_PREFIX: prefix });
  });
});
