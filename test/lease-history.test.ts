import { afterAll, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import type { SandboxState } from '../src/providers/types.ts';
import { Inspector } from '../src/queues/inspect.ts';
import { historyEntry, historyKey, historyNote } from '../src/queues/lease-history.ts';
import { LeaseRecords } from '../src/queues/lease-records.ts';
import { gate, lease, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// An attempt's start is not stored on its own: its end, written in the lane step that ends
// it, says how long it ran, and reading gives the start back.
describe('a lease history', () => {
  let bed: TestBed;
  let inspector: Inspector;
  let records: LeaseRecords;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_BACKOFF_BASE_MS: '50', LEASE_OPS_BACKOFF_CAP_MS: '100' });
    records = new LeaseRecords(bed.redis, bed.config.LEASE_OPS_PREFIX);
    inspector = new Inspector(bed.ops, records, { stuckStoppingMs: 60_000, blockedAfterMs: 60_000 });
  });
  afterAll(() => bed.close());

  it("writes an enqueue's note once when two requests with its key race, whichever puts the job in its lane", async () => {
    // The watchdog's scan and the episode's own check queue one force-stop under one key; the
    // second request may find the first's job stored but not yet in its lane, and put it there
    // itself: its note must come with it (under load, the demo's timeline lost its watchdog mark).
    const jobs: { laneId: string; jobId: string }[] = [];
    for (let i = 0; i < 30; i++) {
      const request = {
        op: 'force-stop' as const,
        lease: lease(`race-${i}`),
        params: { providerLeaseId: `race-${i}`, ifStoppingSince: 1 },
        idempotencyKey: `watchdog:race-${i}`,
        note: historyNote({ kind: 'stuck', op: 'force-stop', since: 1, message: 'stuck; force-stop queued' }),
      };
      const [a, b] = await Promise.all([bed.ops.enqueue(request), bed.ops.enqueue(request)]);
      expect(b.jobId).toBe(a.jobId);
      jobs.push({ laneId: a.laneId, jobId: a.jobId });
    }
    for (const { laneId, jobId } of jobs) {
      const stuck = (await bed.ops.history.read(laneId)).filter((e) => e.kind === 'stuck' && e.jobId === jobId);
      expect([jobId, stuck.length]).toEqual([jobId, 1]);
    }
  });

  it('shows each attempt started, then what it saw, then how it ended, in time order', async () => {
    const held = gate();
    let calls = 0;
    const provider = createRecordingProvider({
      behaviour: async ({ ctx }) => {
        ctx.observe('h1', { kind: 'running' });
        if (++calls === 1) return 'settling';
        await held.promise;
        return 'ok';
      },
    }).provider;
    const worker = await bed.startWorker(provider);
    const op = await bed.ops.enqueue({ op: 'stop', lease: lease('h1'), params: { providerLeaseId: 'h1' } });
    // A failure below must not leave the worker held: closing it would wait. The tests after
    // this one play attempts by hand, with no worker to take their jobs.
    onTestFinished(async () => {
      held.open();
      await worker.close();
    });
    // The second attempt runs: its start comes from its job, as no end says it yet.
    await expect.poll(async () => (await inspector.timeline(lease('h1'))).events.filter((e) => e.kind === 'started').length, { timeout: 10_000 }).toBe(2);
    const running = (await inspector.timeline(lease('h1'))).events;
    expect(running.map((e) => [e.kind, e.attempt ?? null])).toEqual([
      ['accepted', null],
      ['started', 1],
      ['observed', null],
      ['backing-off', 1],
      ['started', 2],
    ]);
    held.open();
    expect((await bed.waitForAll([op.jobId])).get(op.jobId)).toBe('completed');
    const events = (await inspector.timeline(lease('h1'))).events;
    // The stop's receipt is its last word on the sandbox: stopped, after the read that saw it running.
    expect(events.map((e) => [e.kind, e.attempt ?? null, e.state ?? null])).toEqual([
      ['accepted', null, null],
      ['started', 1, null],
      ['observed', null, 'running'],
      ['backing-off', 1, null],
      ['started', 2, null],
      ['observed', null, 'stopped'],
      ['completed', 2, null],
    ]);
    expect(events.every((e, i) => i === 0 || events[i - 1]!.at <= e.at)).toBe(true);
    expect(events.filter((e) => e.kind === 'started').every((e) => e.jobId === op.jobId && e.op === 'stop')).toBe(true);
  });

  it('keeps no end of a stale attempt: the lane refuses its release, and its entry with it', async () => {
    const first = await bed.ops.enqueue({ op: 'destroy', lease: lease('h2'), params: { providerLeaseId: 'h2' } });
    const acquired = await bed.laneAcquire(first.laneId, first.jobId);
    const newer = await bed.laneAcquire(first.laneId, first.jobId);
    if (acquired.kind !== 'run' || newer.kind !== 'run') throw new Error('expected to run');
    // Ran 0 ms: released at once after its acceptance, a longer run would date its start before that.
    const entry = historyEntry({ kind: 'completed', jobId: first.jobId, op: 'destroy', attempt: 1, ran: 0 });
    expect(await bed.ops.lanes.release(first.laneId, first.jobId, acquired.token, { status: 'completed', result: null }, false, false, entry)).toEqual({ kind: 'stale' });
    expect((await bed.ops.history.read(first.laneId)).map((e) => e.kind)).toEqual(['accepted']);
    expect(await bed.ops.lanes.release(first.laneId, first.jobId, newer.token, { status: 'completed', result: null }, false, false, entry)).toEqual({ kind: 'idle' });
    const events = await bed.ops.history.read(first.laneId);
    expect(events.map((e) => e.kind)).toEqual(['accepted', 'started', 'completed']);
    expect(events[2]!.at - events[1]!.at).toBe(0);
    expect(events[1]).toMatchObject({ kind: 'started', jobId: first.jobId, op: 'destroy', attempt: 1 });
  });

  // The end's `ran` is measured on the worker before its lane step is sent, and its time is
  // Redis' when the step runs: the start read back lands that send later than it was, which
  // on a fast provider is after what the attempt saw. The lane runs one attempt at a time,
  // so the order is known: the start goes before what its attempt saw.
  it('puts a start read back late before what its attempt saw, and after the attempt before it', async () => {
    const first = await bed.ops.enqueue({ op: 'stop', lease: lease('h3'), params: { providerLeaseId: 'h3' } });
    for (let attempt = 1; attempt <= 2; attempt++) {
      const acquired = await bed.laneAcquire(first.laneId, first.jobId);
      if (acquired.kind !== 'run') throw new Error('expected to run');
      const ranFrom = performance.now();
      // A history keeps a change of state: each attempt sees another.
      const state: SandboxState = attempt === 1 ? { kind: 'transitioning', providerState: 'stopping', toward: 'stopped' } : { kind: 'stopped', providerState: 'stopped' };
      await records.observe(first.laneId, lease('h3'), 'h3', state, first.jobId);
      // What the worker measures, then the time its step takes to reach Redis (a busy link).
      const ran = performance.now() - ranFrom;
      await new Promise((resolve) => setTimeout(resolve, 25));
      const end =
        attempt === 1
          ? bed.ops.lanes.yield(first.laneId, first.jobId, acquired.token, Date.now(), historyEntry({ kind: 'backing-off', jobId: first.jobId, op: 'stop', attempt, until: Date.now(), ran }))
          : bed.ops.lanes.release(first.laneId, first.jobId, acquired.token, { status: 'completed', result: null }, false, false, historyEntry({ kind: 'completed', jobId: first.jobId, op: 'stop', attempt, ran }));
      await end;
    }
    const events = await bed.ops.history.read(first.laneId);
    expect(events.map((e) => [e.kind, e.attempt ?? null])).toEqual([
      ['accepted', null],
      ['started', 1],
      ['observed', null],
      ['backing-off', 1],
      ['started', 2],
      ['observed', null],
      ['completed', 2],
    ]);
    expect(events.every((e, i) => i === 0 || events[i - 1]!.at <= e.at)).toBe(true);
  });

  it('keeps a lease\'s last 200 events, for a week after the last one', async () => {
    const laneId = (await bed.ops.enqueue({ op: 'destroy', lease: lease('h4'), params: { providerLeaseId: 'h4' } })).laneId;
    for (let i = 1; i <= 250; i++) bed.ops.history.append(laneId, { kind: 'paused', jobId: `j${i}` });
    const key = historyKey(bed.config.LEASE_OPS_PREFIX, laneId);
    // The appends are sent without waiting: read once the last one is in.
    await expect.poll(async () => (await bed.ops.history.read(laneId)).at(-1)?.jobId, { timeout: 10_000 }).toBe('j250');
    expect(await bed.redis.llen(key)).toBe(200);
    const events = await bed.ops.history.read(laneId);
    // The newest 200 (the enqueue's own 'accepted' may land among them: it is sent without waiting too).
    expect(events).toHaveLength(200);
    const paused = events.filter((e) => e.kind === 'paused').map((e) => Number(e.jobId!.slice(1)));
    expect(paused.length).toBeGreaterThanOrEqual(199);
    expect(paused).toEqual(Array.from({ length: paused.length }, (_, i) => 251 - paused.length + i));
    const ttl = await bed.redis.pttl(key);
    expect(ttl).toBeGreaterThan(7 * 86_400_000 - 60_000);
    expect(ttl).toBeLessThanOrEqual(7 * 86_400_000);
  });
});
