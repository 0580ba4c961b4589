import { afterEach, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import type { OperationName } from '../src/operations.ts';
import { cli } from './helpers/cli.ts';
import { gate, TestBed, workerEnv } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// Issue 26 item 3: attention keeps what needs a human: a failure stays until the lease's next
// operation of the same kind succeeds or an operator acknowledges it; one item per lease.

let bed: TestBed | undefined;
let client: LeaseOpsClient | undefined;
afterEach(async () => {
  await client?.close();
  await bed?.close();
  client = bed = undefined;
});

const lease = (leaseId: string) => ({ provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId });

async function setUp(failing: Set<string>) {
  bed = await TestBed.create();
  const held = gate<void>();
  await bed.startWorker(
    createRecordingProvider({
      behaviour: async ({ ctx, op }: { ctx: { lease: { leaseId: string } }; op: OperationName }) => {
        if (failing.has(`${ctx.lease.leaseId}:${op}`)) return 'permanent' as const;
        if (failing.has(`${ctx.lease.leaseId}:hold`)) await held.promise;
        return 'ok' as const;
      },
    }).provider,
  );
  client = new LeaseOpsClient(bed.config);
  return { bed, client, held };
}

const run = async (c: LeaseOpsClient, op: OperationName, leaseId: string, params: Record<string, unknown>) => (await c.enqueueAndWait(op, lease(leaseId), params, { waitMs: 10_000 })).operation;

describe('attention remembers what needs a human', () => {
  it('a failed resume stays after a later force-stop succeeds, until a resume succeeds; one item per lease, however many kinds failed', async () => {
    const failing = new Set(['l1:resume', 'l1:stop']);
    const { client } = await setUp(failing);
    expect((await run(client, 'resume', 'l1', { providerLeaseId: 'l1' })).state).toBe('failed');
    expect((await run(client, 'stop', 'l1', { providerLeaseId: 'l1' })).state).toBe('failed');
    expect((await run(client, 'force-stop', 'l1', { providerLeaseId: 'l1' })).state).toBe('completed');
    let items = (await client.leasesNeedingAttention()).filter((i) => i.reason === 'operation_failed');
    expect(items).toHaveLength(1);
    expect(items[0]!.detail).toMatch(/resume failed: refused/);
    expect(items[0]!.detail).toMatch(/stop failed: refused/);
    expect((await client.attentionCounts()).operation_failed).toBe(1);
    failing.delete('l1:resume');
    expect((await run(client, 'resume', 'l1', { providerLeaseId: 'l1' })).state).toBe('completed');
    items = (await client.leasesNeedingAttention()).filter((i) => i.reason === 'operation_failed');
    expect(items.map((i) => i.detail)).toEqual([expect.not.stringMatching(/resume failed/)]);
    expect(items[0]!.detail).toMatch(/stop failed/);
  });

  it('a failed acquire stays although its clean-up completed', async () => {
    const { client } = await setUp(new Set(['run-9:acquire']));
    const acquired = await run(client, 'acquire', 'run-9', { runId: 'run-9' });
    expect(acquired.state).toBe('failed');
    // Its clean-up (abandon-acquire) runs in the same lane and completes.
    await new Promise((r) => setTimeout(r, 0));
    const view = await client.getLease(lease('run-9'));
    await bed!.waitForAll((await client.getLeaseTimeline(lease('run-9'))).operations.map((o) => o.jobId), 10_000);
    const items = (await client.leasesNeedingAttention()).filter((i) => i.laneId === view.laneId);
    expect(items).toEqual([expect.objectContaining({ reason: 'operation_failed', detail: expect.stringMatching(/acquire failed: refused/) })]);
  });

  it("an operator's cancel is not a failure to attend to; an acknowledgement clears a failure (client, CLI), and the timeline says who", async () => {
    const failing = new Set(['l2:hold', 'l3:stop']);
    const { client, held } = await setUp(failing);
    const head = await client.enqueue('stop', lease('l2'), { providerLeaseId: 'l2' });
    const queued = await client.enqueue('destroy', lease('l2'), { providerLeaseId: 'l2' });
    expect(await client.cancelOperation(queued.jobId, 'ops:carol')).toBeTruthy();
    held.open();
    await bed!.waitForAll([head.jobId], 10_000);
    expect((await client.leasesNeedingAttention()).filter((i) => i.reason === 'operation_failed')).toEqual([]);

    expect((await run(client, 'stop', 'l3', { providerLeaseId: 'l3' })).state).toBe('failed');
    expect((await client.leasesNeedingAttention()).some((i) => i.reason === 'operation_failed')).toBe(true);
    const acked = await cli(['ack', '--provider', 'recording', '--company', 'acme', '--environment', 'prod', '--lease', 'l3'], workerEnv(bed!, {}));
    expect(acked.code, acked.stderr).toBe(0);
    expect(acked.stdout).toMatch(/acknowledged 1 failure/);
    expect((await client.leasesNeedingAttention()).filter((i) => i.reason === 'operation_failed')).toEqual([]);
    expect((await client.getLease(lease('l3'))).lastFailure).toBeNull();
    const events = (await client.getLeaseTimeline(lease('l3'))).events;
    expect(events.some((e) => e.kind === 'acknowledged' && /acknowledged by cli:\S+: stop/.test(e.message ?? ''))).toBe(true);
    // Nothing to acknowledge: says so.
    expect(await client.acknowledgeFailures(lease('l3'), 'ops')).toEqual({ acknowledged: [] });
  });
});
