import { existsSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { LeaseOpsClient } from '../../src/client.ts';
import { DaytonaFake } from '../../src/fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../../src/providers/daytona/index.ts';
import { ProviderRegistry } from '../../src/providers/registry.ts';
import { QUICK_RECOVERY, TestBed, workerEnv, type Finished } from '../helpers/env.ts';
import { WorkerProcess } from '../helpers/worker-process.ts';

// Crash at each step of a pass-on (src/queues/pass-on.ts): a worker that does not serve a
// probe's or an exec's provider moves the job back for another replica. That worker is killed
// before the move and after it, at the fault points there. A command runs at most once, and
// only on a worker that serves it; its caller hears how it went either way; a probe is answered.

const lease = (leaseId: string) => ({ provider: 'daytona', companyId: 'co', environmentId: 'env', leaseId });
const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };

/** A bed and a Daytona fake that runs commands on this machine, a sandbox acquired by a serving worker that is then closed. */
async function setUp(finished: Finished) {
  const bed = await TestBed.create({ LEASE_OPS_KEEP_COMPLETED_S: '600' });
  const fake = new DaytonaFake({ apiKey: 'k', timings: { create: 10, start: 50, stop: 50, forceStop: 0, destroy: 10 }, execOnThisMachine: true });
  const url = await fake.listen();
  const client = new LeaseOpsClient(bed.config, { masterKeys: null });
  finished(async () => {
    await client.close();
    await fake.close();
    await bed.close();
  });
  const serving = () => bed.startWorkerWith(new ProviderRegistry([createDaytonaProvider({ name: 'daytona', apiUrl: url, apiKey: 'k', rateLimits: unpaced })]));
  const first = await serving();
  const acquired = await client.enqueueAndWait('acquire', lease('run'), { runId: 'run' }, { waitMs: 10_000 });
  const id = (acquired.operation.result as { providerLeaseId: string }).providerLeaseId;
  // Gone, but its announcement of "daytona" stays: the worker below passes daytona's jobs on.
  await first.close();
  return { bed, client, id, serving };
}

/** A worker process serving only the simulated cloud, killed at `point`; resolves once it is dead. */
async function notServingKilledAt(bed: TestBed, finished: Finished, point: string) {
  const worker = new WorkerProcess(workerEnv(bed, { ...QUICK_RECOVERY, LEASE_OPS_PROVIDERS: 'simulated', LEASE_OPS_FAULT_POINTS: `${point}=kill*1` }));
  finished(async () => void (await worker.terminate()));
  await worker.ready;
  return { killed: (async () => (await worker.waitForLog(`lease-ops fault point ${point}: kill`), await worker.exited))() };
}

describe('a probe or exec passed on by a worker that does not serve its provider, that worker killed at each step', () => {
  it('killed after the move: the command runs once, on the worker that serves it', async ({ onTestFinished }) => {
    const { bed, client, id, serving } = await setUp(onTestFinished);
    const { killed } = await notServingKilledAt(bed, onTestFinished, 'pass-on-moved');
    const dir = mkdtempSync(join(tmpdir(), 'lease-ops-pass-on-'));
    const ran = client.exec(lease(id), { providerLeaseId: id, command: `mkdir ${join(dir, 'once')} && echo ran`, ttlMs: 20_000 });
    await killed;
    await serving();
    // mkdir fails a second run: once, and with its output.
    expect(await ran).toMatchObject({ exitCode: 0, stdout: 'ran\n' });
    expect(existsSync(join(dir, 'once'))).toBe(true);
  });

  it('killed before the move: the command is answered as failed and never runs (an exec is not run again after a stall)', async ({ onTestFinished }) => {
    const { bed, client, id, serving } = await setUp(onTestFinished);
    const { killed } = await notServingKilledAt(bed, onTestFinished, 'pass-on-before-move');
    const dir = mkdtempSync(join(tmpdir(), 'lease-ops-pass-on-'));
    const ran = client.exec(lease(id), { providerLeaseId: id, command: `mkdir ${join(dir, 'never')}`, ttlMs: 20_000 }).then(
      (result) => ({ result }),
      (err: Error & { code?: string }) => ({ code: err.code, message: err.message }),
    );
    await killed;
    await serving();
    const answer = await ran;
    expect(answer, JSON.stringify(answer)).toMatchObject({ code: 'exec_failed', message: expect.stringMatching(/not run again/) });
    expect(existsSync(join(dir, 'never'))).toBe(false);
    // The serving worker runs the next command at once: nothing of the dead one's job holds it.
    expect(await client.exec(lease(id), { providerLeaseId: id, command: 'echo', args: ['next'] })).toMatchObject({ exitCode: 0, stdout: 'next\n' });
  });

  for (const point of ['pass-on-before-move', 'pass-on-moved']) {
    it(`killed at ${point}: a probe is answered by the worker that serves its provider`, async ({ onTestFinished }) => {
      const { bed, client, serving } = await setUp(onTestFinished);
      const { killed } = await notServingKilledAt(bed, onTestFinished, point);
      const probe = client.probeProvider({ provider: 'daytona', companyId: `probe-${point}` });
      await killed;
      await serving();
      expect(await probe).toMatchObject({ ok: true, code: 'ok' });
    });
  }
});
