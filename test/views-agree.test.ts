import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { queueMetrics } from '../src/metrics.ts';
import { LeaseRecords } from '../src/queues/lease-records.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { cli } from './helpers/cli.ts';
import { gate, lease, readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// One truth per lease (issue 26 items 1, 3 and 4, and what an attack on them found): the CLI,
// /v1, the page and /metrics count the same leases and call the same lease stuck, whatever
// the settings of the process that reads them.

const ADMIN = 'views-agree-admin-token-0123456789';

describe('every view reads one model of a lease', () => {
  let bed: TestBed;
  let api: TestApi;
  const bearer = { authorization: `Bearer ${ADMIN}` };

  beforeAll(async () => {
    // The worker judges "stuck stopping" after 1 s; the API and the CLI below are told 30 minutes.
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: ADMIN, LEASE_OPS_STUCK_STOPPING_MS: '1000', LEASE_OPS_WATCHDOG: 'false', LEASE_OPS_KEEP_FAILED_S: '600' });
    const { provider } = createRecordingProvider({ behaviour: ({ ctx, op }) => (op === 'stop' && ctx.lease.leaseId.startsWith('fails') ? 'permanent' : 'ok') });
    await bed.startWorker(provider);
    api = await startTestApi({ ...bed, config: { ...bed.config, LEASE_OPS_STUCK_STOPPING_MS: 1_800_000 } } as TestBed);
  });

  afterAll(async () => {
    await api?.close();
    await bed?.close();
  });

  it('counts leases, not reasons: status, /v1/attention, the page and /metrics agree', async () => {
    const client = api.client;
    // fails-1: its stop failed and its lane is paused (two reasons, one lease); fails-2 failed; idle-1 is paused.
    for (const id of ['fails-1', 'fails-2']) expect((await client.waitForResult((await client.enqueue('stop', lease(id), { providerLeaseId: id })).jobId, 10_000)).state).toBe('failed');
    await client.pauseLane(lease('fails-1'), 'test');
    await client.pauseLane(lease('idle-1'), 'test');

    const status = await cli(['status', '--json'], workerEnv(bed, { LEASE_OPS_STUCK_STOPPING_MS: '1800000' }));
    const overview = JSON.parse(status.stdout) as { attention: { lease: { leaseId: string }; reasons: string[] }[] };
    const api1 = ((await (await fetch(`${api.base}/v1/attention`, { headers: bearer })).json()) as { items: { lease: { leaseId: string }; reasons: string[] }[] }).items;
    const page = await (await fetch(`${api.base}/ui/attention`, { headers: { authorization: `Basic ${Buffer.from(`x:${ADMIN}`).toString('base64')}` } })).text();
    const metrics = await (await fetch(`${api.base}/metrics`)).text();
    const byLease = (items: { lease: { leaseId: string }; reasons: string[] }[]) => Object.fromEntries(items.map((i) => [i.lease.leaseId, [...i.reasons].sort()]));
    const expected = { 'fails-1': ['operation_failed', 'paused'], 'fails-2': ['operation_failed'], 'idle-1': ['paused'] };
    expect(byLease(overview.attention)).toEqual(expected);
    expect(byLease(api1)).toEqual(expected);
    expect([...page.matchAll(/<tr data-lane="[^"]+" data-reasons="([^"]+)">/g)].map((m) => m[1]!.split(' ').sort().join(','))).toEqual(
      api1.map((i) => [...i.reasons].sort().join(',')),
    );
    // /metrics: per reason, the leases that have it.
    const gauge = (reason: string) => Number(new RegExp(`^lease_ops_leases_needing_attention\\{reason="${reason}"\\} (\\d+)$`, 'm').exec(metrics)?.[1]);
    for (const reason of ['operation_failed', 'paused', 'stuck_stopping']) expect({ reason, n: gauge(reason) }).toEqual({ reason, n: api1.filter((i) => i.reasons.includes(reason)).length });
    // And the leases, each once, whatever its reasons: the count the CLI and the overview say.
    expect(Number(/^lease_ops_attention_leases (\d+)$/m.exec(metrics)?.[1])).toBe(api1.length);
    expect((JSON.parse(status.stdout) as { attentionLeases: number }).attentionLeases).toBe(api1.length);
    // The CLI's text says the same leases, one line each.
    const text = await cli(['status'], workerEnv(bed, {}));
    expect(text.stdout).toMatch(/leases needing attention: 3\n/);
    expect(text.stdout).toMatch(/fails-1 {2}\[operation_failed, paused\]/);
  });

  it("calls a lease stuck by the workers' budget, in the API, the page and the CLI, whatever the reader's own setting", async () => {
    expect(await bed.ops.announcedStuckBudget()).toBe(1_000);
    // A sandbox seen stopping (as an operation's attempt records it).
    const records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    await records.observe(await bed.ops.laneOf(lease('slow')), lease('slow'), 'slow', { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' });
    const view = await readUntil(async () => {
      const v = await api.client.getLease(lease('slow'));
      return v.stuck ? v : null;
    }, 10_000, 'the lease to read stuck');
    expect(view.stuck?.budgetMs).toBe(1_000);
    const page = await (await fetch(`${api.base}/ui/leases/recording/co/env/slow`, { headers: { authorization: `Basic ${Buffer.from(`x:${ADMIN}`).toString('base64')}` } })).text();
    expect(page).toContain('data-badge="stuck"');
    const status = await cli(['status', '--provider', 'recording', '--company', 'co', '--environment', 'env', '--lease', 'slow'], workerEnv(bed, { LEASE_OPS_STUCK_STOPPING_MS: '1800000' }));
    expect(status.stdout).toMatch(/STUCK: +stopping since .*past the budget of 1\.00 s/);
    const attention = ((await (await fetch(`${api.base}/v1/attention`, { headers: bearer })).json()) as { items: { lease: { leaseId: string }; reasons: string[] }[] }).items;
    expect(attention.find((i) => i.lease.leaseId === 'slow')?.reasons).toEqual(['stuck_stopping']);
  });

  it('says an operation that never ran never started: cancelled, or out of time, in a paused lane; its error is { code, message } once', async () => {
    const client = api.client;
    await client.pauseLane(lease('never'), 'test');
    const cancelled = await client.enqueue('resume', lease('never'), { providerLeaseId: 'never', leaseMetadata: {} });
    const outOfTime = await client.enqueue('stop', lease('never'), { providerLeaseId: 'never' }, { deadlineMs: 300 });
    await readUntil(async () => (await client.getOperation(cancelled.jobId))?.state === 'paused', 10_000, 'the resume to wait in the paused lane');
    expect(await client.cancelOperation(cancelled.jobId, 'test')).toBeTruthy();
    for (const [jobId, code] of [[cancelled.jobId, 'cancelled'], [outOfTime.jobId, 'deadline_exceeded']] as const) {
      expect((await client.waitForResult(jobId, 10_000)).state).toBe('failed');
      const view = (await client.getOperation(jobId))!;
      expect({ code, attempts: view.attempts, startedAt: view.startedAt }).toEqual({ code, attempts: 0, startedAt: null });
      expect(view.error?.code).toBe(code);
      expect(view.error?.message.startsWith(`${code}:`)).toBe(false);
      // Out of time in a paused lane: the message says the lane was paused, and by whom.
      if (code === 'deadline_exceeded') expect(view.error?.message).toMatch(/paused by test since \d{4}-\d\d-\d\dT/);
      // The API says the same.
      const viaApi = (await (await fetch(`${api.base}/v1/operations/${encodeURIComponent(jobId)}`, { headers: bearer })).json()) as { attempts: number; startedAt: number | null };
      expect({ attempts: viaApi.attempts, startedAt: viaApi.startedAt }).toEqual({ attempts: 0, startedAt: null });
    }
    await client.unpauseLane(lease('never'), 'test');
  });

  it('counts what waits in a paused lane as paused, not queued or backing off: status, /v1/overview and /metrics', async () => {
    const client = api.client;
    await client.pauseLane(lease('held'), 'test');
    const jobs: string[] = [];
    for (const op of ['resume', 'stop'] as const) jobs.push((await client.enqueue(op, lease('held'), op === 'resume' ? { providerLeaseId: 'held', leaseMetadata: {} } : { providerLeaseId: 'held' })).jobId);
    await readUntil(async () => (await client.getOperation(jobs[0]!))?.state === 'paused', 10_000, 'the resume to wait in the paused lane');
    const overview = (await (await fetch(`${api.base}/v1/overview`, { headers: bearer })).json()) as { counts: Record<string, number> };
    expect(overview.counts).toMatchObject({ paused: 2, queued: 0, 'backing-off': 0 });
    const metrics = await (await fetch(`${api.base}/metrics`)).text();
    expect(metrics).toMatch(/^lease_ops_operations\{state="paused"\} 2$/m);
    expect(metrics).toMatch(/^lease_ops_operations\{state="queued"\} 0$/m);
    const text = await cli(['status'], workerEnv(bed, {}));
    expect(text.stdout).toMatch(/^ {2}paused {7}2$/m);
    await client.unpauseLane(lease('held'), 'test');
    for (const jobId of jobs) expect((await client.waitForResult(jobId, 10_000)).state).toBe('completed');
    const after = (await (await fetch(`${api.base}/v1/overview`, { headers: bearer })).json()) as { counts: Record<string, number> };
    expect(after.counts.paused).toBe(0);
  });

  it('enqueues from the CLI by the lease alone: the sandbox id comes from the lease', async () => {
    const acquired = await api.client.waitForResult((await api.client.enqueue('acquire', lease('run-9'), { runId: 'r9' })).jobId, 10_000);
    expect(acquired.state).toBe('completed');
    const stop = await cli(['enqueue', 'stop', '--provider', 'recording', '--company', 'co', '--environment', 'env', '--lease', 'run-9', '--wait', '10000', '--json'], workerEnv(bed, {}));
    expect(stop.code).toBe(0);
    expect(JSON.parse(stop.stdout)).toMatchObject({ operation: { op: 'stop', state: 'completed' } });
  });
});

describe('counts every lease that needs attention, however many there are', () => {
  it('a lane running past its deadline counts among 201 failed leases, and an item is dated by its oldest failure (the attack on issue 26)', async () => {
    const bed = await TestBed.create({ LEASE_OPS_KEEP_FAILED_S: '600', LEASE_OPS_CONCURRENCY: '50' });
    const held = gate();
    const { provider } = createRecordingProvider({ behaviour: async ({ ctx }) => (ctx.lease.leaseId === 'slow' ? (await held.promise, 'ok' as const) : ('permanent' as const)) });
    await bed.startWorker(provider);
    const client = new LeaseOpsClient(bed.config);
    try {
      const failed = await Promise.all(Array.from({ length: 201 }, (_, i) => bed.ops.enqueue({ op: 'stop', lease: lease(`f-${i}`), params: { providerLeaseId: `f-${i}` } }).then((r) => r.jobId)));
      await bed.waitForAll(failed, 30_000);
      const slow = await bed.ops.enqueue({ op: 'stop', lease: lease('slow'), params: { providerLeaseId: 'slow' }, deadlineMs: 300 });
      const counts = await readUntil(async () => {
        const c = await client.attentionCounts();
        return c.blocked === 1 ? c : null;
      }, 10_000, 'the running stop to be past its deadline');
      expect(counts.operation_failed).toBe(201);
      expect((await client.overview()).attentionLeases).toBe(202);
      expect(await queueMetrics(client, { bullmqTotals: false })()).toMatch(/^lease_ops_attention_leases 202$/m);

      // A second kind of failure on one lease: the item stays dated by the first.
      const first = (await client.leasesNeedingAttention(500)).find((i) => i.lease?.leaseId === 'f-0')!;
      const resume = await bed.ops.enqueue({ op: 'resume', lease: lease('f-0'), params: { providerLeaseId: 'f-0', leaseMetadata: {} } });
      await bed.waitForAll([resume.jobId]);
      const after = (await client.leasesNeedingAttention(500)).find((i) => i.lease?.leaseId === 'f-0')!;
      expect(after.detail).toMatch(/resume failed.*stop failed/);
      expect(after.since).toBe(first.since);
      held.open();
      await bed.waitForAll([slow.jobId]);
    } finally {
      held.open();
      await client.close();
      await bed.close();
    }
  });
});
