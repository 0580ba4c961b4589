import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import { MasterKeys } from '../src/providers/instances/sealing.ts';
import { ProviderInstanceStore } from '../src/providers/instances/store.ts';
import { BIN, cli } from './helpers/cli.ts';
import { TestBed, workerEnv } from './helpers/env.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

// Issue 25 part 1, in real processes: the master key checked at start (exit 2, one line,
// nothing decrypted), a rotation without downtime (old and new keys, then `secrets rewrap`),
// the CLI's providers commands, and a worker process that sees an update without a restart.

const K1 = randomBytes(32).toString('hex');
const K2 = randomBytes(32).toString('hex');
const KEY_A = 'dtn_proc_key_A_0123456789';
const KEY_B = 'dtn_proc_key_B_9876543210';
const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };

/** `lease-ops ...args` with `input` on its standard input. */
function cliWithStdin(args: string[], env: Record<string, string>, input: string): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, ...env }, stdio: ['pipe', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += String(d)));
    child.stderr.on('data', (d) => (stderr += String(d)));
    child.on('exit', (code) => resolve({ code, stdout, stderr }));
    child.stdin.end(input);
  });
}

describe('the provider registry across processes', () => {
  let bed: TestBed;
  let fake: DaytonaFake;
  let fakeUrl: string;
  let env: Record<string, string>;
  const workers: WorkerProcess[] = [];

  beforeAll(async () => {
    fake = new DaytonaFake({ timings: { create: 10, start: 20, stop: 20, forceStop: 0, destroy: 10, archive: 20 } });
    fake.acceptKeys(KEY_A);
    fakeUrl = await fake.listen();
    bed = await TestBed.create({ LEASE_OPS_INSTANCE_API_URLS: '' });
    env = workerEnv(bed, { LEASE_OPS_PROVIDERS: '', LEASE_OPS_INSTANCE_API_URLS: fakeUrl, LEASE_OPS_LOG_LEVEL: 'info' });
    // One instance sealed under K1, saved as the API would (no worker yet to probe it).
    const store = new ProviderInstanceStore(bed.redis, bed.config.LEASE_OPS_PREFIX, { keys: new MasterKeys(Buffer.from(K1, 'hex')), allowedApiUrls: [fakeUrl] });
    await store.create('acme', { name: 'acme-dt', type: 'daytona', config: { apiUrl: fakeUrl, rateLimits: unpaced }, credentials: { apiKey: KEY_A } }, 'test');
  });

  afterAll(async () => {
    await Promise.all(workers.map((w) => w.terminate()));
    await bed?.close();
    await fake?.close();
  });

  it('a worker or an API with a wrong master key, or none, exits 2 with one line and decrypts nothing', async () => {
    const apiEnv = { LEASE_OPS_API_TOKENS: 'registry-proc-token-0123456789', LEASE_OPS_API_PORT: '0' };
    for (const [command, extra] of [
      [['worker'], { LEASE_OPS_SECRETS_KEY: K2 }],
      [['api'], { ...apiEnv, LEASE_OPS_SECRETS_KEY: K2 }],
      [['worker'], {}],
      [['worker'], { LEASE_OPS_SECRETS_KEY: 'not-a-key' }],
    ] as [string[], Record<string, string>][]) {
      const before = fake.calls.length;
      const run = await cli(command, { ...env, ...extra }, 30_000);
      const lines = run.stderr.trim().split('\n');
      expect(run.code, `${command} ${JSON.stringify(extra)}: ${run.stderr}`).toBe(2);
      expect(lines, run.stderr).toHaveLength(1);
      expect(lines[0]).toMatch(/^lease-ops: .*LEASE_OPS_SECRETS_KEY/);
      for (const secret of [K1, K2, KEY_A, 'not-a-key']) expect(run.stderr + run.stdout).not.toContain(secret);
      // Nothing reached the service: nothing was decrypted and used.
      expect(fake.calls.length).toBe(before);
    }
  });

  it('rotates without downtime: old and new keys during the rotation, `secrets rewrap`, then the new key alone', async () => {
    const rotating = new WorkerProcess({ ...env, LEASE_OPS_SECRETS_KEY: K2, LEASE_OPS_SECRETS_KEY_PREVIOUS: K1 });
    workers.push(rotating);
    await rotating.ready;
    const client = new LeaseOpsClient(bed.config, { masterKeys: null });
    try {
      const first = await client.enqueueAndWait('acquire', { provider: 'acme-dt', companyId: 'acme', environmentId: 'prod', leaseId: 'run-1' }, { runId: 'run-1' }, { waitMs: 20_000 });
      expect(first.operation, JSON.stringify(first)).toMatchObject({ state: 'completed' });

      const rewrap = await cli(['secrets', 'rewrap'], { ...env, LEASE_OPS_SECRETS_KEY: K2, LEASE_OPS_SECRETS_KEY_PREVIOUS: K1 });
      expect(rewrap.code, rewrap.stderr).toBe(0);
      expect(rewrap.stdout).toContain('rewrapped 1, already under the current key 0, failed 0');
      const again = await cli(['secrets', 'rewrap', '--json'], { ...env, LEASE_OPS_SECRETS_KEY: K2 });
      expect(JSON.parse(again.stdout)).toEqual({ rewrapped: 0, current: 1, failed: [] });

      // The old key alone no longer opens the registry; the new one alone does.
      const old = await cli(['worker'], { ...env, LEASE_OPS_SECRETS_KEY: K1 }, 30_000);
      expect(old.code, old.stderr).toBe(2);
      const wrongRewrap = await cli(['secrets', 'rewrap'], { ...env, LEASE_OPS_SECRETS_KEY: K1 });
      expect([wrongRewrap.code, wrongRewrap.stderr.trim().split('\n').length], wrongRewrap.stderr).toEqual([2, 1]);
      const renewed = new WorkerProcess({ ...env, LEASE_OPS_SECRETS_KEY: K2 });
      workers.push(renewed);
      await renewed.ready;
      await rotating.terminate();
      const second = await client.enqueueAndWait('stop', { provider: 'acme-dt', companyId: 'acme', environmentId: 'prod', leaseId: 'run-1' }, { providerLeaseId: (first.operation.result as { providerLeaseId: string }).providerLeaseId }, { waitMs: 20_000 });
      expect(second.operation, JSON.stringify(second)).toMatchObject({ state: 'completed' });
    } finally {
      await client.close();
    }
  });

  it('manages instances from the CLI (keys from a variable or stdin, never argv), and a running worker uses an update at once', async () => {
    const cliEnv = { ...env, LEASE_OPS_SECRETS_KEY: K2 };
    const added = await cli(['providers', 'add', 'acme-cli', '--type', 'daytona', '--company', 'acme', '--environments', 'prod', '--config', JSON.stringify({ apiUrl: fakeUrl, rateLimits: unpaced }), '--api-key-env', 'ACME_DAYTONA_KEY'], { ...cliEnv, ACME_DAYTONA_KEY: KEY_A });
    expect(added.code, added.stderr).toBe(0);
    expect(added.stdout).toMatch(/^acme\/acme-cli: daytona, environments prod, key sha256:[0-9a-f]{8}, revision \d+/);
    expect(added.stdout).toContain('probe: ok');
    expect(added.stdout + added.stderr).not.toContain(KEY_A);

    const noKey = await cli(['providers', 'add', 'acme-nokey', '--type', 'daytona', '--company', 'acme', '--api-key-env', 'UNSET_VARIABLE_X'], cliEnv);
    expect([noKey.code, noKey.stderr.trim()]).toEqual([2, 'lease-ops: UNSET_VARIABLE_X is not set (--api-key-env names the variable that holds the key)']);
    const badConfig = await cli(['providers', 'add', 'acme-bad', '--type', 'daytona', '--company', 'acme', '--config', '{"autoStopMinutes":-1}', '--api-key-env', 'K', '--no-probe'], { ...cliEnv, K: KEY_A });
    expect(badConfig.code).toBe(2);
    expect(badConfig.stderr).toContain('config.autoStopMinutes');
    const refused = await cli(['providers', 'add', 'acme-refused', '--type', 'daytona', '--company', 'acme', '--config', JSON.stringify({ apiUrl: fakeUrl }), '--api-key-env', 'K'], { ...cliEnv, K: 'dtn_wrong' });
    expect(refused.code).toBe(1);
    expect(refused.stderr).toContain('credentials_refused');

    const acquired = await cli(['enqueue', 'acquire', '--provider', 'acme-cli', '--company', 'acme', '--environment', 'prod', '--lease', 'run-cli', '--params', '{"runId":"run-cli"}', '--wait', '20000', '--json'], cliEnv);
    expect(acquired.code, acquired.stderr + acquired.stdout).toBe(0);
    const sandbox = (JSON.parse(acquired.stdout) as { operation: { result: { providerLeaseId: string } } }).operation.result.providerLeaseId;

    // A new key through stdin; the service takes both while it is probed, then only the new one.
    fake.acceptKeys(KEY_A, KEY_B);
    const updated = await cliWithStdin(['providers', 'update', 'acme-cli', '--company', 'acme', '--api-key-stdin'], cliEnv, `${KEY_B}\n`);
    expect(updated.code, updated.stderr).toBe(0);
    fake.acceptKeys(KEY_B);
    const usedB = fake.requestsByKey.get(KEY_B) ?? 0;
    const stopped = await cli(['enqueue', 'stop', '--provider', 'acme-cli', '--company', 'acme', '--environment', 'prod', '--lease', sandbox, '--params', JSON.stringify({ providerLeaseId: sandbox }), '--wait', '20000'], cliEnv);
    expect(stopped.code, stopped.stderr + stopped.stdout).toBe(0);
    expect(fake.requestsByKey.get(KEY_B)).toBeGreaterThan(usedB);

    const listed = await cli(['providers', 'list', '--company', 'acme', '--json'], cliEnv);
    const page = JSON.parse(listed.stdout) as { instances: { name: string }[] };
    expect(page.instances.map((i) => i.name)).toEqual(['acme-cli', 'acme-dt']);
    expect(listed.stdout).not.toContain(KEY_B);

    const removed = await cli(['providers', 'remove', 'acme-cli', '--company', 'acme'], cliEnv);
    expect(removed.code, removed.stderr).toBe(0);
    const destroyed = await cli(['enqueue', 'destroy', '--provider', 'acme-cli', '--company', 'acme', '--environment', 'prod', '--lease', sandbox, '--params', JSON.stringify({ providerLeaseId: sandbox }), '--wait', '20000', '--json'], cliEnv);
    expect(destroyed.code).toBe(1);
    expect(destroyed.stdout).toContain('provider_deleted');
  });
});
