import type { OperationParams } from '../operations.ts';
import type { LeaseProvider, OperationContext, TerminationReceipt } from '../providers/types.ts';
import { checkResult, TerminationReceiptSchema } from './results.ts';

export interface AbandonReceipt {
  /** The sandbox the failed acquire left behind, now destroyed; null when it made none. */
  providerLeaseId: string | null;
  state: TerminationReceipt['state'] | 'none';
}

/**
 * Cleans up after an acquire that failed for good: finds the sandbox its attempts made the
 * way a retry of it would (a name derived from its job, or its checkpoint) and destroys it.
 * Settling and transient errors (a sandbox still creating, a cloud that is down) are
 * retried by the lane like any operation's, within this operation's own, longer deadline.
 */
export async function abandonAcquire(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['abandon-acquire'], spare: string | null = null): Promise<AbandonReceipt> {
  // Once found, the sandbox is remembered: a destroy may rename it (Daytona does), and a
  // retry must still finish destroying the one it found.
  const saved = await ctx.checkpoint.read();
  let sandbox = typeof saved.abandonedSandboxId === 'string' ? saved.abandonedSandboxId : null;
  if (!sandbox) {
    sandbox = (await provider.findAcquired?.(ctx, { jobId: params.acquireJobId, checkpoint: params.checkpoint })) ?? null;
    if (!sandbox) return { providerLeaseId: null, state: 'none' };
    if (sandbox === spare) {
      // The lease's live sandbox, which another acquire handed out: found by an id they
      // share (the lease's own), it is not this acquire's to destroy.
      ctx.log.warn({ sandbox }, 'the sandbox found is the lease\'s, handed out by another acquire: left alone');
      return { providerLeaseId: null, state: 'none' };
    }
    await ctx.checkpoint.write({ abandonedSandboxId: sandbox });
  }
  return checkResult(TerminationReceiptSchema, await provider.destroy(ctx, { providerLeaseId: sandbox }), provider.name, 'abandon-acquire');
}
