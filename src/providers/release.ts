import type { OperationParams } from '../operations.ts';
import { PermanentError } from './errors.ts';
import type { ReleaseResult, TerminationReceipt } from './types.ts';

/**
 * A release is one of the things a provider already does: destroy, stop and retain, archive,
 * or leave the sandbox as it is. This maps the disposition to the provider's step. With
 * `cancelActiveWork`, the stop is a kill where the provider has one (`forceStopAndRetain`).
 */
export async function releaseByDisposition(
  params: OperationParams['release'],
  steps: {
    destroy(): Promise<TerminationReceipt>;
    /** keep_running: a fresh read; a receipt if execution has ended already (stopped, gone), else null. */
    current(): Promise<ReleaseResult>;
    stopAndRetain(): Promise<TerminationReceipt>;
    forceStopAndRetain?(): Promise<TerminationReceipt>;
    archive?(): Promise<TerminationReceipt>;
  },
  provider: string,
): Promise<ReleaseResult> {
  switch (params.resourceDisposition) {
    case 'destroy':
      return steps.destroy();
    case 'keep_running':
      return steps.current();
    case 'archive':
      if (!steps.archive) throw new PermanentError('archive_unsupported', `${provider} cannot archive a sandbox: release with stop_and_retain or destroy`);
      return steps.archive();
    case 'stop_and_retain':
      if (!params.cancelActiveWork) return steps.stopAndRetain();
      // A stop that lets the work finish (or suspends it, as a pause does) is no cancel.
      if (!steps.forceStopAndRetain) throw new PermanentError('cancel_unsupported', `${provider} cannot end the work in a sandbox it keeps: release with destroy, or without cancelActiveWork`);
      return steps.forceStopAndRetain();
  }
}
