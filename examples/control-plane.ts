// A control plane's side of lease-ops: enqueue, wait, read the lease, branch on errors.
// Run it with a worker going (`npm start` in another terminal): npx tsx examples/control-plane.ts
import { InvalidRequestError, LeaseOpsClient, loadConfig, WaitTimeoutError } from 'lease-ops';

const client = new LeaseOpsClient(loadConfig());
const lease = { provider: 'simulated', companyId: 'acme', environmentId: 'prod', leaseId: `run-${Date.now()}` };

try {
  // The idempotency key makes a retried request (say, after a timeout) return the same job.
  const { jobId } = await client.enqueue('acquire', lease, { runId: 'run-42' }, { idempotencyKey: `acquire:${lease.leaseId}`, deadlineMs: 120_000 });
  const acquired = await client.waitForResult(jobId, 30_000);
  if (acquired.state === 'failed') throw new Error(`acquire failed: ${acquired.error?.code}: ${acquired.error?.message}`);
  const { providerLeaseId } = acquired.result as { providerLeaseId: string };

  // Later operations name the sandbox; they run one at a time, in this order.
  const sandbox = { ...lease, leaseId: providerLeaseId };
  const stop = await client.enqueue('stop', sandbox, { providerLeaseId });
  const resume = await client.enqueue('resume', sandbox, { providerLeaseId, leaseMetadata: {} });
  const view = await client.getLease(sandbox); // executing, queued, backing off, last observed state
  console.log(`lane of ${providerLeaseId}: executing ${view.executing?.op ?? '-'}, ${view.queuedTotal} queued`);
  for (const { jobId: id } of [stop, resume]) console.log((await client.waitForResult(id, 30_000)).state);

  console.log('observed:', (await client.getLease(sandbox)).observed?.providerState);
  await client.enqueue('stop', sandbox, { providerLeaseId: 42 }); // a bad request: never enqueued
} catch (err) {
  if (err instanceof InvalidRequestError) console.log(`refused: ${err.code}: ${err.issues.map((i) => i.path.join('.')).join(', ')}`);
  else if (err instanceof WaitTimeoutError) console.log('still running; read it later with client.getOperation(jobId)');
  else throw err;
} finally {
  await client.close();
}
