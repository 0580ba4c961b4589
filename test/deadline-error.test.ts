import { afterEach, describe, expect, it } from 'vitest';
import { TransientError } from '../src/providers/errors.ts';
import type { OperationContext } from '../src/providers/types.ts';
import { lease, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

let bed: TestBed | undefined;
afterEach(async () => {
  await bed?.close();
  bed = undefined;
});

/**
 * A stop on a provider whose attempts `settleFirst` (the first one settling) and then send
 * nothing: each waits past the operation's deadline for its request's turn, and is refused
 * with `deadline_passed` (as the pacer and the providers' own check refuse). Its failure.
 */
async function failedAtDeadline(leaseId: string, deadlineMs: number, settleFirst: boolean, refusal: string): Promise<string | undefined> {
  bed = await TestBed.create();
  let deadlineAt = 0;
  await bed.startWorker(
    createRecordingProvider({
      behaviour: async ({ ctx }: { ctx: OperationContext }): Promise<'settling'> => {
        if (settleFirst && ctx.attempt === 1) return 'settling';
        await new Promise((r) => setTimeout(r, Math.max(0, deadlineAt - Date.now()) + 20));
        throw new TransientError('deadline_passed', refusal);
      },
    }).provider,
  );
  deadlineAt = Date.now() + deadlineMs;
  const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease(leaseId), params: { providerLeaseId: leaseId }, deadlineMs });
  expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('failed');
  return (await bed.ops.queue.getJob(jobId))!.failedReason;
}

describe('an operation that fails at its deadline names what the provider said last', () => {
  it('not the provider client\'s own "deadline passed before this request could be sent" of an attempt that sent nothing', { timeout: 30_000 }, async () => {
    // The retry came due just before the deadline, and the deadline passed before its request could go.
    expect(await failedAtDeadline('d1', 900, true, "recording: the operation's deadline passed before this request could be sent")).toBe(
      'deadline_exceeded: last provider error: lease d1 is still settling',
    );
  });

  it('an attempt whose request was not sent, with no earlier failure, says the deadline passed while a request waited to be sent: no "last provider error" that never was', { timeout: 30_000 }, async () => {
    // The first attempt's request waited for its turn (pacing.ts) past the deadline.
    expect(await failedAtDeadline('d2', 600, false, "request budget authenticated: the operation's deadline passed before this request could be sent")).toBe(
      "deadline_exceeded: the deadline passed while a request waited to be sent (request budget authenticated: the operation's deadline passed before this request could be sent)",
    );
  });
});
