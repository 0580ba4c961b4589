import { metrics, SpanKind, SpanStatusCode, trace } from '@opentelemetry/api';
import { registry } from '../src/metrics.ts';
import { AggregationTemporality, InMemoryMetricExporter, MeterProvider, PeriodicExportingMetricReader } from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SettlingError } from '../src/providers/errors.ts';
import { lease, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

describe('OpenTelemetry hooks', () => {
  const spans = new InMemorySpanExporter();
  const metricExporter = new InMemoryMetricExporter(AggregationTemporality.CUMULATIVE);
  const reader = new PeriodicExportingMetricReader({ exporter: metricExporter, exportIntervalMillis: 60_000 });
  let bed: TestBed;
  beforeAll(async () => {
    trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(spans)] }));
    metrics.setGlobalMeterProvider(new MeterProvider({ readers: [reader] }));
    bed = await TestBed.create();
  });
  afterAll(async () => {
    await bed.close();
    trace.disable();
    metrics.disable();
  });

  it('count settling retries, force-stops by outcome and deadline failures, and trace the waits and force-stops', async () => {
    let forceTries = 0;
    let stopTries = 0;
    const base = createRecordingProvider({ behaviour: () => 'ok' }).provider;
    await bed.startWorker({
      ...base,
      async stop(ctx, p) {
        // A provider may name states as it likes (here, per lease for the ones that never stop).
        ctx.observe(p.providerLeaseId, { kind: 'transitioning', providerState: ctx.lease.leaseId.startsWith('never') ? `stopping:${ctx.lease.leaseId}` : 'stopping' });
        if (ctx.lease.leaseId.startsWith('never') || ++stopTries === 1) throw new SettlingError('sandbox_stopping', 'still stopping');
        return { providerLeaseId: p.providerLeaseId, state: 'stopped' as const };
      },
      async forceStop(_ctx, p) {
        if (++forceTries === 1) throw new SettlingError('state_change_in_progress', 'state change in progress');
        return { providerLeaseId: p.providerLeaseId, state: 'stopped' as const };
      },
    });
    const stop = await bed.ops.enqueue({ op: 'stop', lease: lease('t'), params: { providerLeaseId: 't' } });
    const force = await bed.ops.enqueue({ op: 'force-stop', lease: lease('u'), params: { providerLeaseId: 'u' } });
    const late = await bed.ops.enqueue({ op: 'stop', lease: lease('never'), params: { providerLeaseId: 'never' }, deadlineMs: 300 });
    const ended = await bed.waitForAll([stop.jobId, force.jobId, late.jobId]);
    expect([...ended.values()]).toEqual(['completed', 'completed', 'failed']);

    const names = spans.getFinishedSpans().map((s) => s.name);
    expect(names.filter((n) => n === 'lease.force_stop')).toHaveLength(2);
    // The failed attempt's span is an error with the code; the one that succeeded is not.
    const forceSpans = spans.getFinishedSpans().filter((s) => s.name === 'lease.force_stop');
    expect(forceSpans.map((s) => s.status.code).sort()).toEqual([SpanStatusCode.UNSET, SpanStatusCode.ERROR].sort());
    expect(forceSpans.find((s) => s.status.code === SpanStatusCode.ERROR)?.status.message).toBe('state_change_in_progress');
    // Each attempt is a CONSUMER span named as OpenTelemetry's messaging conventions name it.
    const process = spans.getFinishedSpans().filter((s) => s.name === `process ${bed.config.LEASE_OPS_QUEUE}`);
    expect(process.length).toBeGreaterThanOrEqual(5); // stop twice, force-stop twice, the late stop at least once
    for (const s of process) {
      expect(s.kind).toBe(SpanKind.CONSUMER);
      expect(s.attributes).toMatchObject({ 'messaging.system': 'bullmq', 'messaging.operation.type': 'process', 'messaging.destination.name': bed.config.LEASE_OPS_QUEUE });
      expect(s.attributes['messaging.message.id']).toBe(s.attributes['lease.job_id']);
    }
    const failedForce = process.find((s) => s.attributes['lease.op'] === 'force-stop' && s.status.code === SpanStatusCode.ERROR);
    expect(failedForce?.attributes['error.type']).toBe('state_change_in_progress');
    const wait = spans.getFinishedSpans().find((s) => s.name === 'lease.wait_transition' && s.attributes['lease.op'] === 'stop');
    expect(wait?.attributes['lease.provider_state']).toBe('stopping');

    await reader.forceFlush();
    const points = new Map<string, number>();
    for (const batch of metricExporter.getMetrics())
      for (const scope of batch.scopeMetrics)
        for (const m of scope.metrics)
          for (const dp of m.dataPoints) {
            const key = `${m.descriptor.name}${dp.attributes.outcome ? `:${dp.attributes.outcome}` : ''}`;
            points.set(key, (points.get(key) ?? 0) + (typeof dp.value === 'number' ? dp.value : 0));
          }
    expect(points.get('lease_ops.force_stops:refused')).toBe(1);
    expect(points.get('lease_ops.force_stops:succeeded')).toBe(1);
    expect(points.get('lease_ops.deadline_failures')).toBe(1);
    expect(points.get('lease_ops.settling_retries')).toBeGreaterThanOrEqual(3);
  });

  it('no metric attribute grows with leases, jobs or delays: the series stay the same from 5 leases to 60', { timeout: 60_000 }, async () => {
    // (Issue 14, telemetry.) Every lease settles twice with growing delays, and some fail at their deadline.
    const seriesAfter = async (leases: number, tag: string) => {
      const ids: string[] = [];
      for (let i = 0; i < leases; i++) {
        ids.push((await bed.ops.enqueue({ op: 'stop', lease: lease(`${tag}-${i}`), params: { providerLeaseId: `${tag}-${i}` } })).jobId);
        // These keep settling (growing delays) and fail at their deadline.
        if (i % 5 === 0) ids.push((await bed.ops.enqueue({ op: 'stop', lease: lease(`never-${tag}-${i}`), params: { providerLeaseId: `never-${tag}-${i}` }, deadlineMs: 400 })).jobId);
      }
      await bed.waitForAll(ids, 50_000);
      await reader.forceFlush();
      const series = new Set<string>();
      for (const batch of metricExporter.getMetrics())
        for (const scope of batch.scopeMetrics)
          for (const m of scope.metrics) for (const dp of m.dataPoints) series.add(`${m.descriptor.name} ${JSON.stringify(dp.attributes)}`);
      // And the Prometheus registry's series (a sample line without its value), process metrics aside.
      for (const line of (await registry.metrics()).split('\n')) {
        if (line && !line.startsWith('#') && !line.startsWith('lease_ops_process_')) series.add(`prometheus ${line.slice(0, line.lastIndexOf(' '))}`);
      }
      return series;
    };
    const few = await seriesAfter(5, 'few');
    const many = await seriesAfter(60, 'many');
    expect([...many].filter((s) => !few.has(s))).toEqual([]);
    expect(few.size).toBeGreaterThan(0);
    expect([...few].filter((s) => s.startsWith('prometheus lease_ops_retries_total')).length).toBeGreaterThan(0);
  });
});
