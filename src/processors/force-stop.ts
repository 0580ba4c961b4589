import type { OperationParams } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';
import type { LeaseProvider, OperationContext, TerminationReceipt } from '../providers/types.ts';
import { isStopping } from '../queues/lease-records.ts';
import { checkResult, TerminationReceiptSchema } from './results.ts';

/** A conditional force-stop that found nothing to force: the sandbox had stopped, or left stopping. */
export interface NotForced {
  providerLeaseId: string;
  forced: false;
  /** What the read inside the lane found (`stopped`, `running`, ...). */
  providerState: string;
}

/**
 * Kills the sandbox's processes; refused up front for a provider that cannot force a stop.
 * A conditional one (the watchdog's) reads the sandbox inside its lane first and forces
 * only a sandbox still on its way to stopped: one that finished stopping by itself is never
 * forced.
 */
export async function forceStop(
  provider: LeaseProvider,
  ctx: OperationContext,
  params: OperationParams['force-stop'],
): Promise<TerminationReceipt | NotForced> {
  if (!provider.capabilities.forceStop) {
    throw new PermanentError('force_stop_unsupported', `provider ${provider.name} cannot force a stop`);
  }
  if (params.ifStoppingSince !== undefined) {
    const state = await provider.status(ctx, { providerLeaseId: params.providerLeaseId });
    if (!isStopping(state)) {
      return { providerLeaseId: params.providerLeaseId, forced: false, providerState: 'providerState' in state ? state.providerState : state.kind };
    }
  }
  return checkResult(TerminationReceiptSchema, await provider.forceStop(ctx, { providerLeaseId: params.providerLeaseId }), provider.name, 'force-stop');
}
