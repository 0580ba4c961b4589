import { metrics, trace } from '@opentelemetry/api';
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
        ctx.observe(p.providerLeaseId, { kind: 'transitioning', providerState: 'stopping' });
        if (ctx.lease.leaseId === 'never' || ++stopTries === 1) throw new SettlingError('sandbox_stopping', 'still stopping');
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
});
