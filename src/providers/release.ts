import type { OperationParams } from '../operations.ts';
import type { ReleaseReceipt, TerminationReceipt } from './types.ts';

/**
 * A release is one of three things a provider already does: destroy, leave the sandbox as
 * it is (reporting truthfully what that is), or stop and retain. This maps the disposition
 * to the provider's step and builds the receipt.
 */
export async function releaseByDisposition(
  params: OperationParams['release'],
  steps: {
    destroy(): Promise<TerminationReceipt>;
    /** The sandbox as it is now, read fresh, for keep_running. */
    current(): Promise<ReleaseReceipt['state']>;
    stopAndRetain(): Promise<TerminationReceipt>;
  },
): Promise<ReleaseReceipt> {
  const disposition = params.resourceDisposition;
  const state =
    disposition === 'destroy'
      ? (await steps.destroy()).state
      : disposition === 'keep_running'
        ? await steps.current()
        : (await steps.stopAndRetain()).state;
  return { providerLeaseId: params.providerLeaseId, disposition, state };
}
