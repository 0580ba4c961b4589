import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { writeBenchFiles, type Figures } from '../bench/bench.ts';
import { barChartSvg, histogramSvg } from '../src/charts.ts';

const widths = (svg: string) => [...svg.matchAll(/<rect x="290" y="[\d.]+" width="([\d.]+)"/g)].map((m) => Number(m[1]));

describe('the bench charts', () => {
  it('draws bars in proportion to their values, whatever the values', () => {
    fc.assert(
      fc.property(fc.array(fc.integer({ min: 1, max: 1_000_000 }), { minLength: 1, maxLength: 6 }), (values) => {
        const drawn = widths(barChartSvg('t', '/s', values.map((value, i) => ({ label: `b${i}`, value }))));
        expect(drawn).toHaveLength(values.length);
        const top = Math.max(...values);
        values.forEach((v, i) => expect(drawn[i]! / Math.max(...drawn)).toBeCloseTo(Math.max(1, (360 * v) / top) / 360, 1));
      }),
      { seed: 20261130, numRuns: 200 },
    );
  });

  it('marks the p50 and p99 of the hand-offs it was given', () => {
    const values = Array.from({ length: 1_000 }, (_, i) => 0.2 + (i % 100) * 0.05 + (i === 999 ? 40 : 0));
    const svg = histogramSvg('h', values);
    const sorted = [...values].sort((a, b) => a - b);
    expect(svg).toContain(`p50 ${sorted[500]!.toFixed(2)} ms`);
    expect(svg).toContain(`p99 ${sorted[990]!.toFixed(2)} ms`);
    expect(svg).toContain('1000 hand-offs');
  });

  it('writes the figures as JSON and the charts beside them, with every round of lanes and plain BullMQ', () => {
    const figures = {
      lanes_ops_per_s: 8_000,
      plain_bullmq_jobs_per_s: 12_000,
      ratio_vs_plain: 0.667,
      hot_lease_ops_per_s: 1_500,
      hot_lease_one_worker_ops_per_s: 1_700,
      groupmq_hot_group_jobs_per_s: 2_100,
      hot_ratio_vs_groupmq: 0.76,
      hot_redis_cpu_us_per_op: 230,
      hot_worker_cpu_us_per_op: 330,
      groupmq_hot_redis_cpu_us_per_job: 180,
      groupmq_hot_worker_cpu_us_per_job: 270,
      hot_redis_commands_per_op: 61,
      groupmq_hot_redis_commands_per_job: 26,
      groupmq_jobs_per_s: 13_000,
      ratio_vs_groupmq: 0.615,
      handoff_one_worker_p50_ms: 0.5,
      handoff_p50_ms: 0.55,
      handoff_p99_ms: 3,
      many_leases_ops_per_s: 9_000,
      redis_memory_before_bytes: 1,
      redis_memory_after_bytes: 1,
      redis_keys_before: 0,
      redis_keys_after: 0,
      stuck_stop_recovery_s: 33,
      hook_overhead_p50_ms: 12,
      hook_overhead_p99_ms: 40,
      lanes_redis_cpu_us_per_op: 200,
      plain_redis_cpu_us_per_op: 100,
      lanes_worker_cpu_us_per_op: 900,
      plain_worker_cpu_us_per_op: 500,
      lanes_redis_commands_per_op: 61,
      plain_redis_commands_per_op: 22,
      settle_lag_p50_ms: 900,
      settle_lag_p99_ms: 3_900,
      settle_lag_operations_waited: 60,
      settle_provider_requests_per_op: 6,
      settle_lag_backoff_p50_ms: 1000,
      settle_lag_backoff_p99_ms: 4000,
      settle_backoff_provider_requests_per_op: 7.7,
      activity_redis_cpu_us_per_call: 30,
      activity_script_us_per_call: 10,
      instances: { instances: 10_000, saves_per_s: 2_000, redis_bytes_per_instance: 900, list_page_p50_ms: 20, list_page_max_ms: 40, list_pages: 20, worker_bytes_per_built_instance: 20_000, built: 1_000, resolve_cached_p50_us: 100 },
      lane_keys_left: 0,
      loads: { jobs: 20_000, leases: 1_000, hot_ops: 2_000, many_leases: 100_000 },
    } satisfies Figures;
    const dir = mkdtempSync(join(tmpdir(), 'lease-ops-bench-'));
    const files = writeBenchFiles(figures, { lanesRounds: [7_900, 8_000, 8_100], plainRounds: [11_800, 12_000, 12_300], groupmqRounds: [12_900, 13_000, 13_100], hotRounds: [1_400, 1_500, 1_600], groupmqHotRounds: [2_000, 2_100, 2_200], handoffsMs: [0.4, 0.5, 0.6, 3], settleLagsMs: [120, 900, 1_300, 4_100] }, dir, 'x');
    expect(files).toEqual({ json: join(dir, 'bench-x.json'), svg: join(dir, 'bench-x.svg') });
    expect(JSON.parse(readFileSync(files.json, 'utf8'))).toMatchObject({ ratio_vs_plain: 0.667, samples: { lanesRounds: [7_900, 8_000, 8_100] } });
    const svg = readFileSync(files.svg, 'utf8');
    expect(svg).toContain('plain BullMQ, same jobs (median)');
    expect(svg).toContain('groupmq, same jobs (median)');
    expect(svg).toContain('groupmq, one hot group');
    expect(svg).toContain('2,100 /s');
    expect(svg).toContain('8,000 /s');
    // One dot per round, for lanes, plain BullMQ and groupmq, and for the hot lease and groupmq's hot group.
    expect(svg.match(/<circle /g)).toHaveLength(15);
    expect(svg).toContain('Hand-off latency');
    expect(svg).toContain('Settle lag');
    expect(svg).toContain('4 operations that waited');
  });
});
