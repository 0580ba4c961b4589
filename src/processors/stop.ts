import type { OperationParams } from '../operations.ts';
import type { LeaseProvider, OperationContext, TerminationReceipt } from '../providers/types.ts';
import { checkResult, TerminationReceiptSchema } from './results.ts';

/** Graceful stop; the receipt comes only once the provider confirms the sandbox stopped. */
export async function stop(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['stop']): Promise<TerminationReceipt> {
  return checkResult(TerminationReceiptSchema, await provider.stop(ctx, params), provider.name, 'stop');
}
