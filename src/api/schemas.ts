import { z } from 'zod';
import { LeaseIdentitySchema } from '../lease.ts';
import { OPERATIONS, OperationParamsSchemas } from '../operations.ts';
import type { AttentionItem, LeaseView, OperationView, QueueOverview } from '../queues/inspect.ts';

// The HTTP API's request and response shapes. Requests are validated with these schemas and
// the OpenAPI document (openapi.ts) is generated from them, so the two cannot drift.

const idParam = (name: keyof typeof LeaseIdentitySchema.shape, description: string) =>
  LeaseIdentitySchema.shape[name].meta({ description });

export const LeasePathSchema = z.strictObject({
  provider: idParam('provider', 'provider key, e.g. daytona'),
  companyId: idParam('companyId', 'the company that owns the lease'),
  environmentId: idParam('environmentId', 'the environment of the lease'),
  leaseId: idParam('leaseId', "the provider's sandbox id, or for an acquire the id the caller chose for the lease"),
});

const deadlineMs = z
  .number()
  .int()
  .positive()
  .max(7 * 24 * 3_600_000)
  .optional()
  .meta({ description: 'ms after acceptance by which the operation must have succeeded; default per operation' });
/** One rule for the key, whether it comes in the body or in the Idempotency-Key header. */
export const IdempotencyKeySchema = z.string().min(1).max(256);
const idempotencyKey = IdempotencyKeySchema.optional().meta({
  description: 'the same key returns the same operation for 24 h (the Idempotency-Key header works too)',
});
export const IdempotencyHeaderSchema = z.object({ 'idempotency-key': IdempotencyKeySchema.optional() });

const enqueueVariant = <Op extends (typeof OPERATIONS)[number]>(op: Op) =>
  z.strictObject({ op: z.literal(op), params: OperationParamsSchemas[op], deadlineMs, idempotencyKey });

export const EnqueueBodySchema = z
  .discriminatedUnion('op', [
    enqueueVariant('acquire'),
    enqueueVariant('resume'),
    enqueueVariant('release'),
    enqueueVariant('stop'),
    enqueueVariant('force-stop'),
    enqueueVariant('destroy'),
  ])
  .meta({ id: 'EnqueueRequest', description: 'One lease operation and its parameters' });

export const EnqueuedSchema = z
  .object({
    jobId: z.string(),
    laneId: z.string(),
    deduplicated: z.enum(['coalesced', 'idempotency-key', 'absorbed-stop']).optional().meta({
      description: 'set when no new operation was made: an identical queued request, the same idempotency key, or a queued stop this force-stop took over',
    }),
    location: z.string().meta({ description: 'where to read the operation' }),
  })
  .meta({ id: 'Enqueued' });

export const OperationPathSchema = z.strictObject({
  jobId: z.string().min(1).max(300).meta({ description: 'the id enqueue returned' }),
});

export const WaitQuerySchema = z.strictObject({
  // Decimal digits only: no `0x10`, no `1e3`, no empty value.
  waitMs: z
    .string()
    .regex(/^\d{1,9}$/, 'waitMs is a whole number of milliseconds (decimal digits)')
    .transform(Number)
    .optional()
    .meta({ description: 'wait up to this long (capped by LEASE_OPS_API_MAX_WAIT_MS) for the operation to end before answering' }),
});

const OperationStateSchema = z.enum(['queued', 'ready', 'running', 'backing-off', 'completed', 'failed']);

export const OperationViewSchema = z
  .object({
    jobId: z.string(),
    laneId: z.string(),
    op: z.string(),
    lease: LeaseIdentitySchema.nullable(),
    state: OperationStateSchema,
    attempts: z.number().int(),
    acceptedAt: z.number().nullable(),
    deadlineAt: z.number().nullable(),
    startedAt: z.number().nullable(),
    finishedAt: z.number().nullable(),
    retryAt: z.number().nullable(),
    result: z.unknown().optional(),
    error: z.object({ code: z.string(), message: z.string() }).optional(),
  })
  .meta({ id: 'Operation' });

export const LeaseViewSchema = z
  .object({
    lease: LeaseIdentitySchema,
    laneId: z.string(),
    executing: OperationViewSchema.nullable(),
    backingOff: OperationViewSchema.nullable(),
    queued: z.array(OperationViewSchema),
    queuedTotal: z.number().int(),
    observed: z
      .object({
        providerLeaseId: z.string(),
        kind: z.string(),
        providerState: z.string(),
        since: z.number(),
        observedAt: z.number(),
        forceStops: z.number().int(),
      })
      .nullable(),
    lastFailure: z.object({ jobId: z.string(), at: z.number(), code: z.string(), message: z.string() }).nullable(),
  })
  .meta({ id: 'Lease' });

export const AttentionItemSchema = z
  .object({
    laneId: z.string(),
    lease: LeaseIdentitySchema.nullable(),
    reason: z.enum(['stuck_stopping', 'last_operation_failed', 'blocked']),
    since: z.number(),
    detail: z.string(),
  })
  .meta({ id: 'AttentionItem' });

export const AttentionListSchema = z.object({ items: z.array(AttentionItemSchema) }).meta({ id: 'AttentionList' });

export const OverviewSchema = z
  .object({
    counts: z.record(OperationStateSchema, z.number().int()),
    openLanes: z.number().int(),
    attention: z.array(AttentionItemSchema),
  })
  .meta({ id: 'Overview' });

export const ErrorBodySchema = z
  .object({
    error: z.object({
      code: z.string().meta({ description: 'stable; branch on it' }),
      message: z.string(),
      details: z.array(z.unknown()).optional().meta({ description: "zod's issues for a request that did not validate" }),
    }),
  })
  .meta({ id: 'Error' });

// Compile-time checks that the views the inspector builds match the published schemas.
type Assignable<T, U extends T> = U;
export type ViewsMatchSchemas = [
  Assignable<z.input<typeof OperationViewSchema>, OperationView>,
  Assignable<z.input<typeof LeaseViewSchema>, LeaseView>,
  Assignable<z.input<typeof AttentionItemSchema>, AttentionItem>,
  Assignable<z.input<typeof OverviewSchema>, QueueOverview>,
];
