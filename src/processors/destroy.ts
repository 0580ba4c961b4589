import type { OperationParams } from '../operations.ts';
import type { LeaseProvider, OperationContext, TerminationReceipt } from '../providers/types.ts';
import { checkResult, TerminationReceiptSchema } from './results.ts';

/** Deletes the sandbox; one that is already gone counts as destroyed. */
export async function destroy(
  provider: LeaseProvider,
  ctx: OperationContext,
  params: OperationParams['destroy'],
): Promise<TerminationReceipt> {
  return checkResult(TerminationReceiptSchema, await provider.destroy(ctx, params), provider.name, 'destroy');
}
