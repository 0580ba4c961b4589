import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { freePort } from '../src/redis-server.ts';
import { BIN, cli } from './helpers/cli.ts';
import { REDIS_URL, TestBed, workerEnv } from './helpers/env.ts';
import { WorkerProcess } from './helpers/worker-process.ts';

const TOKEN = 'cli-test-token-0123456789';


// The commands' tests run in order on one bed; the demo, on keys of its own, runs beside them.
describe.concurrent('the lease-ops commands', () => {
  let bed: TestBed;
  let env: Record<string, string>;
  let api: ChildProcess | null = null;
  let apiUrl = '';
  let worker: WorkerProcess | null = null;
  let metricsPort = 0;

  beforeAll(async () => {
    bed = await TestBed.create();
    env = workerEnv(bed, { LEASE_OPS_LOG_LEVEL: 'warn', LEASE_OPS_API_TOKENS: TOKEN, LEASE_OPS_API_PORT: '0' });
  });

  afterAll(async () => {
    api?.kill('SIGTERM');
    await worker?.terminate();
    await bed?.close();
  });

  it.sequential('`api` refuses to start without tokens, naming the variable', async () => {
    const r = await cli(['api'], { ...env, LEASE_OPS_API_TOKENS: '' });
    expect(r.code).toBe(2);
    expect(r.stderr).toContain('LEASE_OPS_API_TOKENS');
    const weak = await cli(['api'], { ...env, LEASE_OPS_API_TOKENS: 'short' });
    expect(weak.code).toBe(2);
    expect(weak.stderr).toMatch(/LEASE_OPS_API_TOKENS.*at least 16/);
  });

  it.sequential('`api` is not ready without workers, and ready once a worker runs', async () => {
    api = spawn(process.execPath, [BIN, 'api'], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'inherit'] });
    apiUrl = await new Promise<string>((resolve, reject) => {
      createInterface({ input: api!.stdout! }).on('line', (line) => {
        const m = /API on (http:\/\/\S+)\/v1/.exec(line);
        if (m) resolve(m[1]!);
      });
      api!.once('exit', (code) => reject(new Error(`api exited (${code})`)));
    });
    const before = await fetch(`${apiUrl}/readyz`);
    expect(before.status).toBe(503);
    expect(await before.json()).toMatchObject({ status: 'not_ready', redis: 'ok', workers: 0 });

    metricsPort = await freePort();
    worker = new WorkerProcess({ ...env, LEASE_OPS_METRICS_PORT: String(metricsPort), LEASE_OPS_LOG_LEVEL: 'info' });
    await worker.ready;
    const after = await fetch(`${apiUrl}/readyz`);
    expect(after.status).toBe(200);
    expect(await after.json()).toMatchObject({ status: 'ready', redis: 'ok', workers: 1 });
    // Its own /readyz listens a moment after the worker says it started.
    await worker.waitForLog('worker metrics listening');
    expect((await fetch(`http://127.0.0.1:${metricsPort}/readyz`)).status).toBe(200);
  });

  it.sequential('`enqueue --wait` runs an operation to its end; bad input exits 2 and names the field', async () => {
    const lease = ['--provider', 'simulated', '--company', 'cli-co', '--environment', 'cli-env', '--lease', 'cli-lease'];
    const ok = await cli(['enqueue', 'acquire', ...lease, '--params', '{"runId":"cli"}', '--wait', '20000'], env);
    expect(ok.code).toBe(0);
    const view = JSON.parse(ok.stdout.slice(ok.stdout.indexOf('{'))) as { state: string; op: string };
    expect(view).toMatchObject({ op: 'acquire', state: 'completed' });

    const bad = await cli(['enqueue', 'stop', ...lease, '--params', '{"providerLeaseId":5}'], env);
    expect(bad.code).toBe(2);
    expect(bad.stderr).toContain('providerLeaseId');
    expect((await cli(['enqueue', 'explode', ...lease], env)).code).toBe(2);
    expect((await cli(['enqueue', 'stop', ...lease, '--params', '{oops'], env)).code).toBe(2);

    // The worker counted the attempt it ran on its own /metrics.
    const metrics = await (await fetch(`http://127.0.0.1:${metricsPort}/metrics`)).text();
    expect(metrics).toMatch(/lease_ops_operations_total\{op="acquire",outcome="completed"\} 1/);
    // The API's: BullMQ's job counts by state; its totals only with LEASE_OPS_BULLMQ_METRICS.
    const apiMetrics = await (await fetch(`${apiUrl}/metrics`)).text();
    expect(apiMetrics).toMatch(/bullmq_job_count\{queue="ops", state="completed"\} 1/);
    expect(apiMetrics).not.toContain('bullmq_job_completed_total');
  });

  it.sequential('`enqueue --wait --json` of an operation that fails exits 1 with one JSON document naming its error', async () => {
    const lease = ['--provider', 'simulated', '--company', 'cli-co', '--environment', 'cli-env', '--lease', 'cli-fails'];
    // The simulated cloud sizes sandboxes by its snapshot: refused for good before anything is created.
    const params = JSON.stringify({ runId: 'cli', resources: { cpu: 4 } });
    const failed = await cli(['enqueue', 'acquire', ...lease, '--params', params, '--wait', '20000', '--json'], env);
    expect(failed.code).toBe(1);
    expect(JSON.parse(failed.stdout)).toMatchObject({ operation: { op: 'acquire', state: 'failed', error: { code: 'resources_unsupported' } } });
  });

  it.sequential('`status` shows the queue or one lease, and refuses half a lease', async () => {
    const queue = await cli(['status', '--json'], env);
    expect(queue.code).toBe(0);
    expect((JSON.parse(queue.stdout) as { counts: { completed: number } }).counts.completed).toBeGreaterThanOrEqual(1);
    const one = await cli(['status', '--provider', 'simulated', '--company', 'cli-co', '--environment', 'cli-env', '--lease', 'cli-lease'], env);
    expect(one.code).toBe(0);
    expect(one.stdout).toContain('lease simulated/cli-co/cli-env/cli-lease');
    expect(one.stdout).toMatch(/executing: +-/);
    const half = await cli(['status', '--provider', 'simulated'], env);
    expect(half.code).toBe(2);
    expect(half.stderr).toContain('--lease');
  });

  it.sequential('every command has --help', async () => {
    for (const command of ['start', 'worker', 'api', 'enqueue', 'status', 'demo', 'bench', 'simulated-cloud']) {
      const r = await cli([command, '--help'], env);
      expect({ command, code: r.code }).toEqual({ command, code: 0 });
      expect(r.stdout).toContain(`Usage: lease-ops ${command}`);
    }
  });
});

describe.concurrent('the lease-ops demo', () => {
  it('`demo --quick` prints the incident as a timeline and writes both runs as an HTML page', { timeout: 60_000 }, async () => {
    const out = join(mkdtempSync(join(tmpdir(), 'lease-ops-demo-')), 'incident.html');
    const r = await cli(['demo', '--quick', '--out', out], { REDIS_URL, LEASE_OPS_LOG_LEVEL: 'warn' }, 45_000);
    expect({ code: r.code, stdout: r.stdout, stderr: r.stderr.slice(-2_000) }).toMatchObject({ code: 0 });
    // With the watchdog: the force-stop's row with its mark; without: the resume fails at its deadline.
    // The lease's one lane holds its acquire too: the rows start when it was acquired.
    expect(r.stdout).toMatch(/force-stop \(watchdog\) +\|[ ·]*◆/);
    expect(r.stdout).toMatch(/acquire +\|[░▒]*█/);
    // Waiting (·) again between a backoff and its late retry, on a busy machine.
    expect(r.stdout).toMatch(/resume +\| *·+[░▒█·]*✗\|/);
    expect(r.stdout).toMatch(/Without: failed after [\d.]+ s \(deadline_exceeded: /);
    expect(r.stdout).toContain(`The two timelines, drawn: ${out}`);
    const html = readFileSync(out, 'utf8');
    expect(html.match(/<svg /g)).toHaveLength(2);
    expect(html).toContain('data-op="force-stop"');
    expect(html).toContain('class="mark-stuck"');
  });
});
