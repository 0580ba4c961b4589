import type { OperationParams } from '../operations.ts';
import type { ExpiredLease, Lease, LeaseProvider, OperationContext } from '../providers/types.ts';
import { checkResult, ExpiredLeaseSchema, LeaseSchema } from './results.ts';

/** Reuses a retained sandbox; an expired lease (gone, mismatched) is a result, not an error. */
export async function resume(
  provider: LeaseProvider,
  ctx: OperationContext,
  params: OperationParams['resume'],
): Promise<Lease | ExpiredLease> {
  return checkResult(LeaseSchema.or(ExpiredLeaseSchema), await provider.resume(ctx, params), provider.name, 'resume');
}
