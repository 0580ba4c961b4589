import type { OperationParams } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';
import type { LeaseProvider, OperationContext, TerminationReceipt } from '../providers/types.ts';
import { checkResult, TerminationReceiptSchema } from './results.ts';

/** Kills the sandbox's processes; refused up front for a provider that cannot force a stop. */
export async function forceStop(
  provider: LeaseProvider,
  ctx: OperationContext,
  params: OperationParams['force-stop'],
): Promise<TerminationReceipt> {
  if (!provider.capabilities.forceStop) {
    throw new PermanentError('force_stop_unsupported', `provider ${provider.name} cannot force a stop`);
  }
  return checkResult(TerminationReceiptSchema, await provider.forceStop(ctx, params), provider.name, 'force-stop');
}
