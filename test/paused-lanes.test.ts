import { Queue } from 'bullmq';
import { afterEach, describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../src/client.ts';
import { createLogger } from '../src/logger.ts';
import { sweepLanes } from '../src/queues/sweep.ts';
import { cli } from './helpers/cli.ts';
import { gate, readUntil, TestBed, workerEnv } from './helpers/env.ts';
import { captureLog } from './helpers/log-capture.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// Issue 26 item 2: a paused lane is "paused" everywhere (operation, lease, attention, CLI
// --wait, board), and the sweep leaves its parked head alone.

let bed: TestBed | undefined;
let client: LeaseOpsClient | undefined;
afterEach(async () => {
  await client?.close();
  await bed?.close();
  client = bed = undefined;
});

const lease = (leaseId: string) => ({ provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId });

describe('paused lanes', () => {
  it('an operation waiting in a paused lane reads paused (who, since), the lease and attention say so, and the sweep leaves its head alone', async () => {
    bed = await TestBed.create();
    const held = gate<void>();
    await bed.startWorker(createRecordingProvider({ behaviour: async ({ ctx }) => (ctx.lease.leaseId === 'busy' ? (await held.promise, 'ok' as const) : ('ok' as const)) }).provider);
    client = new LeaseOpsClient(bed.config);
    const paused = await client.pauseLane(lease('p1'), 'ops:alice');
    const stop = await client.enqueue('stop', lease('p1'), { providerLeaseId: 'p1' });
    const behind = await client.enqueue('destroy', lease('p1'), { providerLeaseId: 'p1' });
    await readUntil(async () => (await client!.getOperation(stop.jobId))?.state === 'paused', 5_000, 'the head paused');
    const view = (await client.getOperation(stop.jobId))!;
    expect(view).toMatchObject({ state: 'paused', attempts: 0, retryAt: null, paused: { by: 'ops:alice', since: paused.since } });
    expect((await client.getOperation(behind.jobId))!.state).toBe('paused');
    const leaseView = await client.getLease(lease('p1'));
    expect(leaseView.paused).toEqual({ by: 'ops:alice', since: paused.since });
    expect(leaseView.backingOff).toBeNull();

    // The sweep, however often it passes, hands nothing off and logs nothing for it.
    const log = captureLog();
    for (let i = 0; i < 5; i++) {
      const report = await sweepLanes(bed.ops, 0, log.log);
      expect(report.handedOff).toBe(0);
    }
    expect(log.lines.join('')).not.toContain('handed it off');
    expect((await client.getOperation(stop.jobId))!.state).toBe('paused');

    // Attention lists the paused lane with who and since when; the counts agree.
    const items = await client.leasesNeedingAttention();
    expect(items.filter((i) => i.laneId === leaseView.laneId)).toEqual([
      expect.objectContaining({ reason: 'paused', since: paused.since, lease: lease('p1'), detail: expect.stringMatching(/paused by ops:alice.*2 operations wait/) }),
    ]);
    expect((await client.attentionCounts()).paused).toBe(1);

    // The CLI's --wait says paused, not "is a worker running?".
    const waited = await cli(['enqueue', 'stop', '--provider', 'recording', '--company', 'acme', '--environment', 'prod', '--lease', 'p1', '--params', '{"providerLeaseId":"p1"}', '--wait', '500'], workerEnv(bed, {}));
    expect(waited.code).toBe(3);
    expect(waited.stderr).toMatch(/paused by ops:alice since .*: lease-ops unpause/);
    expect(waited.stderr).not.toContain('is a worker running');

    // The worker's own sweep passes stay on the maintenance queue, each with what it did.
    const maintenance = new Queue(`${bed.config.LEASE_OPS_QUEUE}-maintenance`, { connection: bed.redis, prefix: bed.config.LEASE_OPS_PREFIX });
    await readUntil(async () => (await maintenance.getCompleted(0, 0)).length > 0, 10_000, 'a finished sweep pass kept');
    const [pass] = await maintenance.getCompleted(0, 0);
    expect(pass!.returnvalue).toMatchObject({ inspected: expect.any(Number), dropped: 0, handedOff: 0 });
    await maintenance.close();

    await client.unpauseLane(lease('p1'), 'ops:alice');
    const results = await bed.waitForAll([stop.jobId, behind.jobId], 10_000);
    expect([...results.values()]).toEqual(['completed', 'completed']);
    expect((await client.leasesNeedingAttention()).filter((i) => i.reason === 'paused')).toEqual([]);
    held.open();
  });

  it('a paused lane with nothing queued is listed too (someone must unpause it), and an empty lane unpaused leaves nothing behind', async () => {
    bed = await TestBed.create();
    client = new LeaseOpsClient(bed.config);
    const paused = await client.pauseLane(lease('idle'), 'ops:bob');
    expect(await client.leasesNeedingAttention()).toEqual([expect.objectContaining({ reason: 'paused', since: paused.since, detail: expect.stringContaining('paused by ops:bob') })]);
    await client.unpauseLane(lease('idle'), 'ops:bob');
    expect(await client.leasesNeedingAttention()).toEqual([]);
  });
});
