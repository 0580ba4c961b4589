import { describe, expect, it } from 'vitest';
import { eventRows, foldRetries, timelineRows, timelineSvg } from '../src/api/pages.ts';
import type { OperationView } from '../src/queues/inspect.ts';
import type { HistoryEvent } from '../src/queues/lease-history.ts';
import { duration, moment } from '../src/time-format.ts';

// The timeline's model, from events as a lease's history gives them back: what each bar says.

const T = 1_700_000_000_000;
const ev = (at: number, kind: HistoryEvent['kind'], jobId: string | null, rest: Partial<HistoryEvent> = {}): HistoryEvent => ({ at: T + at, kind, jobId, ...rest });
const view = (jobId: string, op: string, state: OperationView['state']): OperationView => ({
  jobId,
  laneId: 'lane',
  op,
  lease: null,
  state,
  attempts: 0,
  acceptedAt: null,
  deadlineAt: null,
  startedAt: null,
  finishedAt: null,
  retryAt: null,
});

describe('the timeline of a lease', () => {
  it('keeps a queued bar running while the operation is queued: a stop whose retry fell due behind a force-stop that jumped ahead', () => {
    const events = [
      ev(0, 'accepted', 'stop', { op: 'stop', ahead: 0 }),
      ev(10, 'started', 'stop', { op: 'stop', attempt: 1 }),
      ev(50, 'backing-off', 'stop', { op: 'stop', attempt: 1, code: 'sandbox_settling', until: T + 300 }),
      ev(100, 'accepted', 'force', { op: 'force-stop', ahead: 0 }),
      ev(110, 'started', 'force', { op: 'force-stop', attempt: 1 }),
    ];
    const now = T + 5_000;
    const { rows } = timelineRows({ events, now, operations: [view('stop', 'stop', 'queued'), view('force', 'force-stop', 'running')] });
    const stop = rows.find((r) => r.op === 'stop')!;
    expect(stop.spans.map((s) => [s.kind, s.from - T, s.to - T])).toEqual([
      ['waiting', 0, 10],
      ['attempt', 10, 50],
      ['backoff', 50, 300],
      ['waiting', 300, 5_000],
    ]);
    const force = rows.find((r) => r.op === 'force-stop')!;
    expect(force.spans.at(-1)).toMatchObject({ kind: 'attempt', outcome: 'running', to: now });
  });

  it('splits a backoff that outlasted its retry time when the next attempt starts: backoff, then waiting', () => {
    const events = [
      ev(0, 'accepted', 'a', { op: 'resume', ahead: 0 }),
      ev(0, 'started', 'a', { op: 'resume', attempt: 1 }),
      ev(20, 'backing-off', 'a', { op: 'resume', attempt: 1, code: 'x', until: T + 100 }),
      ev(2_900, 'started', 'a', { op: 'resume', attempt: 2 }),
      ev(2_950, 'completed', 'a', { op: 'resume' }),
    ];
    const { rows } = timelineRows({ events, now: T + 3_000, operations: [] });
    expect(rows[0]!.spans.map((s) => [s.kind, s.from - T, s.to - T])).toEqual([
      ['waiting', 0, 0],
      ['attempt', 0, 20],
      ['backoff', 20, 100],
      ['waiting', 100, 2_900],
      ['attempt', 2_900, 2_950],
    ]);
    // A retry picked up within a worker's block timeout (1 s) is its backoff, not a wait.
    const prompt = timelineRows({ events: [...events.slice(0, 3), ev(700, 'started', 'a', { op: 'resume', attempt: 2 }), ev(750, 'completed', 'a', { op: 'resume' })], now: T + 800, operations: [] });
    expect(prompt.rows[0]!.spans.map((s) => s.kind)).toEqual(['waiting', 'attempt', 'backoff', 'attempt']);
  });

  it('ends an operation that ended without its event at its end, not at now', () => {
    const events = [ev(0, 'accepted', 'a', { op: 'stop', ahead: 2 })];
    const ended = { ...view('a', 'stop', 'completed'), finishedAt: T + 400 };
    const { rows } = timelineRows({ events, now: T + 10_000, operations: [ended] });
    expect(rows[0]!.spans).toEqual([expect.objectContaining({ kind: 'waiting', to: T + 400 })]);
  });

  it('folds a retry streak of three or more into one bar with the count and the last error; shorter streaks stay as they are', () => {
    const streak = (n: number) =>
      Array.from({ length: n }, (_, i) => [
        { from: i * 100, to: i * 100 + 10, kind: 'attempt' as const, label: `attempt ${i + 1}`, outcome: 'retry' as const },
        { from: i * 100 + 10, to: i * 100 + 100, kind: 'backoff' as const, label: `backing off: code${i}` },
      ]).flat();
    expect(foldRetries(streak(2))).toHaveLength(4);
    const folded = foldRetries([...streak(40), { from: 4_000, to: 4_100, kind: 'attempt', label: 'attempt 41', outcome: 'completed' }]);
    expect(folded).toEqual([
      { from: 0, to: 4_000, kind: 'backoff', label: '40 attempts retried, last backing off: code39' },
      { from: 4_000, to: 4_100, kind: 'attempt', label: 'attempt 41', outcome: 'completed' },
    ]);
  });

  it('folds an event table streak (same operation, same code) into one row that keeps its raw events', () => {
    const events: HistoryEvent[] = [ev(0, 'accepted', 's', { op: 'stop', ahead: 0 }), ev(1, 'observed', null, { state: 'transitioning', providerState: 'stopping' })];
    for (let i = 1; i <= 30; i++) {
      events.push(ev(i * 10, 'started', 's', { op: 'stop', attempt: i }));
      events.push(ev(i * 10 + 5, 'backing-off', 's', { op: 'stop', attempt: i, code: 'sandbox_settling', until: T + i * 10 + 9 }));
    }
    events.push(ev(400, 'started', 's', { op: 'stop', attempt: 31 }), ev(401, 'backing-off', 's', { op: 'stop', attempt: 31, code: 'other' }));
    const rows = eventRows(events);
    expect(rows.map((r) => (r.kind === 'event' ? r.event.kind : `retries ${r.retries.length}/${r.events.length}`))).toEqual([
      'accepted',
      'observed',
      'retries 30/61',
      'backing-off',
    ]);
    // Two retries with the same code are not a streak.
    expect(eventRows(events.slice(0, 6)).every((r) => r.kind === 'event')).toBe(true);
  });

  it('keeps every bar inside the picture when the sandbox has been in its last state since long after the last operation', () => {
    const events = [
      ev(0, 'accepted', 'a', { op: 'resume', ahead: 0 }),
      ev(10, 'started', 'a', { op: 'resume', attempt: 1 }),
      ev(20, 'observed', 'a', { state: 'running', providerState: 'running' }),
      ev(30, 'completed', 'a', { op: 'resume' }),
    ];
    const svg = timelineSvg({ events, now: T + 600_000, operations: [] }, 1200);
    const bars = [...svg.matchAll(/<rect class="[^"]*" data-bar="\d+" x="([\d.]+)" y="[\d.]+" width="([\d.]+)"/g)].map((m) => Number(m[1]) + Number(m[2]));
    expect(bars.length).toBeGreaterThan(1);
    for (const right of bars) expect(right).toBeLessThanOrEqual(1200 - 16 + 0.1);
    // The state bar runs to now, and the axis with it.
    expect(Math.max(...bars)).toBeCloseTo(1200 - 16, 0);
    expect(svg).toContain('+10 min');
  });

  it('ends the last tick label at the picture\'s right edge when the range is a whole number of steps (the pages test saw "+7.00 s" half outside)', () => {
    const events = [ev(0, 'accepted', 'a', { op: 'resume', ahead: 0 }), ev(10, 'started', 'a', { op: 'resume', attempt: 1 })];
    const svg = timelineSvg({ events, now: T + 7_000, operations: [] }, 1200);
    const ticks = [...svg.matchAll(/<text x="([\d.]+)" y="[\d.]+" font-size="11" text-anchor="(\w+)" fill="#5b6573">\+([^<]+)<\/text>/g)].map((m) => ({ x: Number(m[1]), anchor: m[2], label: m[3] }));
    expect(ticks.at(-1)).toMatchObject({ label: '7.00 s', anchor: 'end' });
    expect(ticks.at(-1)!.x).toBeLessThanOrEqual(1200);
    // Centred labels keep half their width (at most 30 px at 11 px) inside the picture.
    for (const t of ticks.filter((t) => t.anchor === 'middle')) expect(t.x).toBeLessThanOrEqual(1200 - 30);
  });

  it('says every moment one way: ISO 8601 in UTC and how long ago', () => {
    expect(moment(T, T + 125_000)).toBe('2023-11-14T22:13:20.000Z (2 min 5 s ago)');
    expect(moment(T + 3_000, T)).toBe('2023-11-14T22:13:23.000Z (in 3.00 s)');
    expect([850, 4_200, 61_000, 7_500_000, 300_000_000].map(duration)).toEqual(['850 ms', '4.20 s', '1 min 1 s', '2 h 5 min', '3 d 11 h']);
  });
});
