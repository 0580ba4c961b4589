import { z } from 'zod';
import { createDocument } from 'zod-openapi';
import {
  AttentionListSchema,
  EnqueueBodySchema,
  EnqueuedSchema,
  ErrorBodySchema,
  IdempotencyKeySchema,
  LeasePathSchema,
  LeaseViewSchema,
  OperationPathSchema,
  OperationViewSchema,
  OverviewSchema,
  WaitQuerySchema,
} from './schemas.ts';

const json = (schema: z.ZodType, description: string) => ({ description, content: { 'application/json': { schema } } });
const errors = (...codes: string[]) =>
  Object.fromEntries(codes.map((status) => [status, json(ErrorBodySchema, ERROR_DESCRIPTIONS[status] ?? 'error')]));
const ERROR_DESCRIPTIONS: Record<string, string> = {
  '400': 'invalid_request (with zod details) or invalid_json',
  '401': 'unauthorized: no or unknown bearer token',
  '403': 'forbidden: the token is scoped to a company and this needs an admin',
  '404': 'not found (also for leases and operations outside the token scope)',
  '413': 'payload_too_large',
  '415': 'unsupported_media_type: send application/json',
  '422': 'idempotency_key_reused: the idempotency key came with a different request (lease, operation or parameters) before; unknown_provider: no worker has ever served the provider named in the path',
  '429': 'lease_queue_full or queue_full, with Retry-After (LEASE_OPS_MAX_QUEUED_PER_LEASE, LEASE_OPS_MAX_QUEUED)',
  '503': 'redis_unavailable',
};

/** The OpenAPI 3.1 document of the HTTP API, generated from the zod schemas it validates with. */
export function openApiDocument(version: string): ReturnType<typeof createDocument> {
  return createDocument({
    openapi: '3.1.0',
    info: {
      title: 'lease-ops',
      version,
      description: 'Sandbox lease operations, one at a time per lease and in order, across worker replicas.',
      license: { name: 'MIT', identifier: 'MIT' },
    },
    // Relative: the document is served by the API it describes, wherever that listens.
    servers: [{ url: '/', description: 'the lease-ops API serving this document' }],
    components: { securitySchemes: { bearer: { type: 'http', scheme: 'bearer' } } },
    security: [{ bearer: [] }],
    paths: {
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/operations': {
        post: {
          operationId: 'enqueueOperation',
          summary: 'Enqueue an operation for a lease; answers at once with its job id',
          requestParams: {
            path: LeasePathSchema,
            header: z.object({ 'Idempotency-Key': IdempotencyKeySchema.optional() }),
          },
          requestBody: { content: { 'application/json': { schema: EnqueueBodySchema } } },
          responses: {
            '202': {
              ...json(EnqueuedSchema, 'accepted; the Location header points at the operation'),
              headers: z.object({ Location: z.string() }),
            },
            ...errors('400', '401', '404', '413', '415', '422', '429', '503'),
          },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}': {
        get: {
          operationId: 'getLease',
          summary: "A lease's lane: executing, queued, backing off, last observed provider state and since when",
          requestParams: { path: LeasePathSchema },
          responses: { '200': json(LeaseViewSchema, 'the lease'), ...errors('400', '401', '404', '503') },
        },
      },
      '/v1/operations/{jobId}': {
        get: {
          operationId: 'getOperation',
          summary: "An operation's state, result or error; optionally waits for it to end",
          requestParams: { path: OperationPathSchema, query: WaitQuerySchema },
          responses: { '200': json(OperationViewSchema, 'the operation'), ...errors('400', '401', '404', '503') },
        },
      },
      '/v1/attention': {
        get: {
          operationId: 'listLeasesNeedingAttention',
          summary: 'Leases stuck stopping, whose last operation failed, or whose lane is blocked',
          responses: { '200': json(AttentionListSchema, 'the leases, within the token scope'), ...errors('401', '503') },
        },
      },
      '/v1/overview': {
        get: {
          operationId: 'getOverview',
          summary: 'The whole queue at a glance (admin tokens only)',
          responses: { '200': json(OverviewSchema, 'operations by state, open lanes, attention'), ...errors('401', '403', '503') },
        },
      },
    },
  });
}
