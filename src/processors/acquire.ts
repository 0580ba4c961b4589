import type { OperationParams } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';
import type { Lease, LeaseProvider, OperationContext } from '../providers/types.ts';
import { checkResult, LeaseSchema } from './results.ts';

/**
 * Creates a sandbox for a run. Expiry as paperclip defines it: a provider that can bound the
 * sandbox at `requestedExpiresAt` does and returns the service's own expiry; otherwise the
 * lease comes back with `expiresAt: null` (the host fails closed and releases it), or, with
 * `requireExpiry`, the acquire is refused before anything is made. An expiry after the one
 * asked for is no bound at all, and is answered as none. A size the provider cannot honour is
 * refused before anything is made.
 */
export async function acquire(provider: LeaseProvider, ctx: OperationContext, params: OperationParams['acquire']): Promise<Lease> {
  const requested = params.requestedExpiresAt ? Date.parse(params.requestedExpiresAt) : null;
  if (requested !== null && params.requireExpiry && !provider.capabilities.expiry) {
    throw new PermanentError('expiry_unsupported', `provider ${provider.name} cannot bound a sandbox's life: acquire without requireExpiry to get the lease with no expiry`);
  }
  if (params.resources && !provider.capabilities.resources) {
    throw new PermanentError('resources_unsupported', `provider ${provider.name} sizes sandboxes by its own configuration: acquire without resources`);
  }
  const lease = checkResult(LeaseSchema, await provider.acquire(ctx, params), provider.name, 'acquire');
  if (requested === null) return lease;
  const bounded = lease.expiresAt !== null && Date.parse(lease.expiresAt) <= requested;
  if (!bounded && params.requireExpiry) {
    // Made, but not bounded by the time asked (too soon for the service's granularity, say):
    // failing for good has the acquire's clean-up destroy what it made.
    throw new PermanentError('expiry_unsupported', `provider ${provider.name} could not bound the sandbox by ${params.requestedExpiresAt}`);
  }
  if (bounded || lease.expiresAt === null) return lease;
  ctx.log.warn({ expiresAt: lease.expiresAt, requestedExpiresAt: params.requestedExpiresAt }, 'the provider bounded the sandbox later than asked: the lease is answered with no expiry');
  return { ...lease, expiresAt: null };
}
