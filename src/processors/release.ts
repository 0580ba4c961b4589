import type { OperationParams } from '../operations.ts';
import type { LeaseProvider, OperationContext, ReleaseReceipt } from '../providers/types.ts';
import { checkResult, ReleaseReceiptSchema } from './results.ts';

/** Gives a lease back with the requested disposition (keep running, stop and retain, destroy). */
export async function release(
  provider: LeaseProvider,
  ctx: OperationContext,
  params: OperationParams['release'],
): Promise<ReleaseReceipt> {
  return checkResult(ReleaseReceiptSchema, await provider.release(ctx, params), provider.name, 'release');
}
