import { z } from 'zod';
import { LeaseMetadataSchema, ProviderLeaseIdSchema } from '../operations.ts';
import { PermanentError } from '../providers/errors.ts';

// What providers return is checked like any other input: a provider (possibly a user's
// own module) that breaks the contract fails the operation clearly instead of storing junk.

export const LeaseSchema = z.strictObject({
  // The same rule as callers meet: an id they could not send back (a stop, a destroy) is no id.
  providerLeaseId: ProviderLeaseIdSchema,
  // Handed back later as a resume's leaseMetadata: held to the same limits here.
  metadata: LeaseMetadataSchema,
  expiresAt: z.iso.datetime({ offset: true }).nullable(),
});
export const ExpiredLeaseSchema = z.strictObject({
  providerLeaseId: z.null(),
  metadata: z.object({ expired: z.literal(true) }),
});
export const TerminationReceiptSchema = z.strictObject({
  providerLeaseId: ProviderLeaseIdSchema,
  state: z.enum(['stopped', 'destroyed']),
});
/** A termination receipt, or null when nothing ended (a keep_running release of a running sandbox). */
export const ReleaseResultSchema = TerminationReceiptSchema.nullable();

export function checkResult<T>(schema: z.ZodType<T>, value: unknown, provider: string, op: string): T {
  const parsed = schema.safeParse(value);
  if (!parsed.success) {
    throw new PermanentError(
      'invalid_provider_result',
      `provider ${provider} returned an invalid ${op} result: ${z.prettifyError(parsed.error)}`,
    );
  }
  return parsed.data;
}
