import type { OperationParams } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';
import type { Lease, LeaseProvider, OperationContext } from '../providers/types.ts';
import { checkResult, LeaseSchema } from './results.ts';

/** Creates a sandbox for a run. A requested expiry the provider cannot honour is refused before anything is created. */
export async function acquire(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['acquire']): Promise<Lease> {
  if (params.requestedExpiresAt && !provider.capabilities.expiry) {
    throw new PermanentError('expiry_unsupported', `provider ${provider.name} cannot promise an expiry: acquire without requestedExpiresAt, and release the lease yourself`);
  }
  return checkResult(LeaseSchema, await provider.acquire(ctx, params), provider.name, 'acquire');
}

/**
 * An acquire failed for good: whatever its attempts created must not outlive it. The
 * provider finds it as a retry would (by the name it derives from the job); the caller
 * queues its destroy.
 */
export async function findAcquired(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['acquire']): Promise<string | null> {
  return (await provider.findAcquired?.(ctx, params)) ?? null;
}
