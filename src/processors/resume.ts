import { jsonBytes, LEASE_METADATA_MAX_BYTES, type OperationParams } from '../operations.ts';
import type { ExpiredLease, Lease, LeaseProvider, OperationContext } from '../providers/types.ts';
import { checkResult, ExpiredLeaseSchema, LeaseSchema } from './results.ts';

/**
 * Reuses a retained sandbox; an expired lease (gone, mismatched) is a result, not an error.
 * The lease comes back with the host's metadata and, over it, what the provider read now.
 */
export async function resume(
  provider: LeaseProvider,
  ctx: OperationContext,
  params: OperationParams['resume'],
): Promise<Lease | ExpiredLease> {
  const result = checkResult(LeaseSchema.or(ExpiredLeaseSchema), await provider.resume(ctx, params), provider.name, 'resume');
  if (result.providerLeaseId === null) return result;
  const merged = { ...params.leaseMetadata, ...result.metadata };
  // Both fit the limit alone; together they may not: then what was read now wins.
  if (jsonBytes(merged) > LEASE_METADATA_MAX_BYTES) {
    ctx.log.warn('the host\'s lease metadata and what was read do not fit together: the lease is answered with what was read');
    return result;
  }
  return { ...result, metadata: merged };
}
