import type { OperationParams } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';
import type { Lease, LeaseProvider, OperationContext } from '../providers/types.ts';
import { checkResult, LeaseSchema } from './results.ts';

/** Creates a sandbox for a run. A requested expiry or size the provider cannot honour is refused before anything is created. */
export async function acquire(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['acquire']): Promise<Lease> {
  if (params.requestedExpiresAt && !provider.capabilities.expiry) {
    throw new PermanentError('expiry_unsupported', `provider ${provider.name} cannot promise an expiry: acquire without requestedExpiresAt, and release the lease yourself`);
  }
  if (params.resources && !provider.capabilities.resources) {
    throw new PermanentError('resources_unsupported', `provider ${provider.name} sizes sandboxes by its own configuration: acquire without resources`);
  }
  return checkResult(LeaseSchema, await provider.acquire(ctx, params), provider.name, 'acquire');
}
