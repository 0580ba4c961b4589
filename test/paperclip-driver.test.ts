import { describe, expect, it } from 'vitest';
import type { LeaseOpsBackend } from '../src/paperclip/backend.ts';
import { leaseOpsDriverHooks } from '../src/paperclip/driver.ts';
import type { OperationView } from '../src/queues/inspect.ts';

// The plugin's give-up, against a backend that answers as lease-ops does when an acquire
// completes in the moment the hook gives up on it (helper-3: 12 of 40 such hooks left a
// sandbox running that the host never heard of).

const view = (state: OperationView['state'], result?: unknown): OperationView => ({
  jobId: 'lane-id-of-twenty-two.job',
  laneId: 'lane',
  op: 'acquire',
  lease: null,
  state,
  attempts: 0,
  acceptedAt: 0,
  deadlineAt: 0,
  startedAt: null,
  finishedAt: null,
  retryAt: null,
  ...(result === undefined ? {} : { result }),
});

function backend(cancelAnswer: 'cancelled' | 'ended' | 'unknown'): LeaseOpsBackend & { cancels: number } {
  let finished = false;
  const b = {
    cancels: 0,
    enqueue: async () => ({ jobId: 'j', operation: null, joined: false }),
    // Still running for as long as the hook waits; it ended by the time the cancel comes.
    wait: async (_jobId: string, waitMs: number) => {
      if (finished) return view('completed', { providerLeaseId: 'sb-1', metadata: {}, expiresAt: null });
      await new Promise((r) => setTimeout(r, waitMs));
      return view('running');
    },
    cancel: async () => {
      b.cancels++;
      finished = cancelAnswer === 'ended';
      return cancelAnswer;
    },
    provider: async () => null,
    exec: async () => {
      throw new Error('not used here');
    },
  };
  return b;
}

const params = { driverKey: 'lease-ops', companyId: 'co', environmentId: 'env', runId: 'run', config: { provider: 'simulated', leaseOpsUrl: 'http://x', hookTimeoutMs: 1_200 } };

describe("the plugin's acquire hook giving up", () => {
  it('an acquire that completed before its cancel is answered as the lease: the host gets its sandbox, none runs unknown', async () => {
    const b = backend('ended');
    const lease = await leaseOpsDriverHooks(() => b).onAcquireLease(params);
    expect(lease).toEqual({ providerLeaseId: 'sb-1', metadata: {}, expiresAt: null });
    expect(b.cancels).toBe(1);
  });

  it('a cancelled one fails with hook_timeout saying so; one that could not be cancelled says that instead', async () => {
    await expect(leaseOpsDriverHooks(() => backend('cancelled')).onAcquireLease(params)).rejects.toThrow(/hook_timeout: .*the acquire was cancelled, and what it made is destroyed/);
    await expect(leaseOpsDriverHooks(() => backend('unknown')).onAcquireLease(params)).rejects.toThrow(/hook_timeout: .*could not be cancelled/);
  });
});
