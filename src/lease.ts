import { createHash } from 'node:crypto';
import { z } from 'zod';

// Ids come from control planes and provider APIs; bound them so one hostile value cannot
// bloat Redis or logs, and refuse control characters that would corrupt log lines.
const idString = (what: string) =>
  z
    .string()
    .min(1, `${what} must not be empty`)
    .max(256, `${what} must be at most 256 characters`)
    .regex(/^[^\p{Cc}]+$/u, `${what} must not contain control characters`)
    // A URL path would resolve these away: /v1/leases/p/c/e/.. is another route.
    .refine((id) => id !== '.' && id !== '..', `${what} must not be "." or ".."`);

/**
 * Who a lease is. Operations for one identity form one lane and never overlap.
 * `leaseId` is the provider's sandbox id (providerLeaseId) once the lease exists; an
 * acquire names the lane it will create with a caller-chosen id instead.
 */
export const LeaseIdentitySchema = z.strictObject({
  provider: idString('provider').regex(/^[a-z0-9][a-z0-9._-]*$/, 'provider must be a lowercase key like "daytona"'),
  companyId: idString('companyId'),
  environmentId: idString('environmentId'),
  leaseId: idString('leaseId'),
});
export type LeaseIdentity = z.infer<typeof LeaseIdentitySchema>;

/**
 * Short, fixed-length id of a lease's lane: a hash of its identity. Lane keys and job ids
 * stay small whatever the identity holds, and a job id alone tells which lane it is in.
 */
export function laneIdOf(lease: LeaseIdentity): string {
  const canonical = JSON.stringify([lease.provider, lease.companyId, lease.environmentId, lease.leaseId]);
  return createHash('sha256').update(canonical).digest('base64url').slice(0, 22);
}

/** Job ids are `<laneId>.<unique>`; BullMQ forbids ':' in custom ids, base64url has none. */
export function laneIdOfJobId(jobId: string): string | null {
  const dot = jobId.indexOf('.');
  return dot === 22 ? jobId.slice(0, 22) : null;
}
