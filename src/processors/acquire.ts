import type { OperationParams } from '../operations.ts';
import type { Lease, LeaseProvider, OperationContext } from '../providers/types.ts';
import { checkResult, LeaseSchema } from './results.ts';

/** Creates a sandbox for a run. A requested expiry the provider cannot honour is its error to raise. */
export async function acquire(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['acquire']): Promise<Lease> {
  return checkResult(LeaseSchema, await provider.acquire(ctx, params), provider.name, 'acquire');
}
