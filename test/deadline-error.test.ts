import { afterEach, describe, expect, it } from 'vitest';
import { TransientError } from '../src/providers/errors.ts';
import { lease, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

let bed: TestBed | undefined;
afterEach(async () => {
  await bed?.close();
  bed = undefined;
});

describe('an operation that fails at its deadline names what the provider said last', () => {
  it('not the provider client\'s own "deadline passed before this request could be sent" of an attempt that sent nothing', { timeout: 30_000 }, async () => {
    bed = await TestBed.create();
    const deadlineMs = 900;
    let deadlineAt = 0;
    await bed.startWorker(
      createRecordingProvider({
        behaviour: async ({ ctx }): Promise<'settling'> => {
          if (ctx.attempt === 1) return 'settling';
          // The retry came due just before the deadline, and the deadline passed before its request could go.
          await new Promise((r) => setTimeout(r, Math.max(0, deadlineAt - Date.now()) + 20));
          throw new TransientError('deadline_passed', "recording: the operation's deadline passed before this request could be sent");
        },
      }).provider,
    );
    deadlineAt = Date.now() + deadlineMs;
    const { jobId } = await bed.ops.enqueue({ op: 'stop', lease: lease('d1'), params: { providerLeaseId: 'd1' }, deadlineMs });
    expect((await bed.waitForAll([jobId], 20_000)).get(jobId)).toBe('failed');
    expect((await bed.ops.queue.getJob(jobId))!.failedReason).toBe('deadline_exceeded: last provider error: lease d1 is still settling');
  });
});
