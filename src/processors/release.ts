import type { OperationParams } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';
import type { LeaseProvider, OperationContext, ReleaseResult } from '../providers/types.ts';
import { checkResult, ReleaseResultSchema } from './results.ts';

/**
 * Gives a lease back with the requested disposition (keep running, stop and retain, archive,
 * destroy): a termination receipt once the service confirmed that execution ended, or null
 * when nothing ended (keep_running).
 */
export async function release(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['release']): Promise<ReleaseResult> {
  // Refused before anything is touched, whatever the provider module does with them.
  if (params.resourceDisposition === 'archive' && !provider.capabilities.archive) {
    throw new PermanentError('archive_unsupported', `provider ${provider.name} cannot archive a sandbox: release with stop_and_retain or destroy`);
  }
  if (params.cancelActiveWork && params.resourceDisposition !== 'destroy' && !provider.capabilities.forceStop) {
    throw new PermanentError('cancel_unsupported', `provider ${provider.name} cannot end the work in a sandbox it keeps: release with destroy, or without cancelActiveWork`);
  }
  return checkResult(ReleaseResultSchema, await provider.release(ctx, params), provider.name, 'release');
}
