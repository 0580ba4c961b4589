import { z } from 'zod';
import { createDocument } from 'zod-openapi';
import {
  ActivityBodySchema,
  ActivityPathSchema,
  ActivitySchema,
  HeartbeatBodySchema,
  HeartbeatSchema,
  AttentionListSchema,
  AttentionQuerySchema,
  EnqueueBodySchema,
  EndedOperationSchema,
  EnqueuedSchema,
  ErrorBodySchema,
  PreferHeaderSchema,
  ProbeQuerySchema,
  IfMatchHeaderSchema,
  ExecBodySchema,
  ExecResultSchema,
  InstanceCreateBodySchema,
  InstanceDeleteQuerySchema,
  InstancePatchBodySchema,
  InstanceSaveQuerySchema,
  ProviderInstanceSchema,
  ProviderListQuerySchema,
  ProviderListSchema,
  ProviderPathSchema,
  ProviderSchema,
  IdempotencyKeySchema,
  LeasePathSchema,
  CancelResultSchema,
  LeaseTimelineSchema,
  PauseResultSchema,
  AcknowledgeResultSchema,
  RerunResultSchema,
  LeaseViewSchema,
  OperationPathSchema,
  OperationViewSchema,
  OverviewSchema,
  WaitQuerySchema,
} from './schemas.ts';

const json = (schema: z.ZodType, description: string) => ({ description, content: { 'application/json': { schema } } });
// Every authenticated route (it answers 401) may answer 429 too: a company's request rate.
const errors = (...codes: string[]) =>
  Object.fromEntries([...codes, ...(codes.includes('401') && !codes.includes('429') ? ['429'] : [])].map((status) => [status, json(ErrorBodySchema, ERROR_DESCRIPTIONS[status] ?? 'error')]));
/** What Node's HTTP server answers itself (no JSON body), on any route. */
const NODE_ANSWERS = {
  '408': { description: 'the request took longer than LEASE_OPS_API_REQUEST_TIMEOUT_MS (headers: LEASE_OPS_API_HEADERS_TIMEOUT_MS)' },
  '417': { description: 'an Expect header other than 100-continue' },
  '431': { description: 'the request line or headers are larger than Node accepts (16 KiB)' },
};
/** Node's own 400 for a malformed request (bad chunked encoding, say), where a route lists no 400 of its own. */
const NODE_BAD_REQUEST = { '400': { description: 'a malformed request, answered by Node (no body)' } };
const ERROR_DESCRIPTIONS: Record<string, string> = {
  '400':
    'invalid_request (with zod details: a path, query, header or body field that does not validate, leaseMetadata over 16 KiB or nested deeper than 32 levels, a path that is not valid percent-encoding, no body), invalid_json or invalid_body (a body that cannot be read: bad gzip, say); Node answers a malformed request (bad chunked encoding) with 400 and no body',
  '401': 'unauthorized: no or unknown bearer token',
  '403': "forbidden: the token is scoped to a company and this needs an admin, or names another company's or environment's provider instances",
  '404': 'not found (also for leases, operations and activities outside the token scope): lease_not_found, operation_not_found, activity_not_found (ended, or past its TTL), unknown_provider; exec: sandbox_gone, not_a_sandbox_id, not_the_lease_sandbox (providerLeaseId is not the sandbox of the lease in the path), lease_environment_mismatch',
  '413': 'payload_too_large: bodies are capped at 64 KiB',
  '415': 'unsupported_media_type: send application/json',
  '412': 'rev_conflict: the provider instance changed since the revision If-Match names',
  '422': 'exec_unsupported (the provider cannot run commands), provider_deleted, provider_credentials_unreadable; credentials_refused: the service refused the credentials of a provider instance, which was not saved (`probe` says what it answered); idempotency_key_reused: the idempotency key came with a different request (lease, operation or parameters) before (`jobId` names the operation it names); unknown_provider: no worker has ever served the provider named in the path (or it is admin-only, to a company token), and the company has no instance of that name',
  '429':
    'lease_queue_full, environment_queue_full, company_queue_full or queue_full, with Retry-After (LEASE_OPS_MAX_QUEUED_PER_LEASE, LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT, LEASE_OPS_MAX_QUEUED_PER_COMPANY, LEASE_OPS_MAX_QUEUED and a fair share); company_waits_full or server_waits_full, with Retry-After (a wait: ?waitMs, exec; LEASE_OPS_API_MAX_WAITS_PER_COMPANY, LEASE_OPS_API_MAX_WAITS); company_pauses_full (LEASE_OPS_MAX_PAUSED_PER_COMPANY; an admin goes past it); company_bytes_full, with Retry-After (operations of the company on their way hold all of LEASE_OPS_MAX_BYTES_PER_COMPANY); company_providers_full (LEASE_OPS_MAX_PROVIDER_INSTANCES_PER_COMPANY); company_rate_limited, with Retry-After (a company with a scoped token past its rate of reads, walks or changes: LEASE_OPS_API_COMPANY_RATES); company_walks_full, with Retry-After (attention, a timeline: 4 of the company\'s walks already wait for their turn); company_requests_full, with Retry-After (the company\'s requests in progress and its line of waiting ones are full: LEASE_OPS_API_REQUESTS_PER_COMPANY)',
  '409':
    'lease_closing (with Retry-After: a stop, release or destroy of the lease is queued or running), lease_has_sandbox (an acquire of a lease whose sandbox lives: destroy it first, or acquire under another id), operation_executing (it runs: an attempt in flight cannot be taken back), operation_ended (it completed or failed), operation_not_failed (only a failed operation runs again), operation_not_rerunnable (an acquire: enqueue a new one), operation_not_waiting (not in its lane any more), provider_exists (the company has an instance of that name), provider_name_taken (a configured provider has that name), sandbox_not_running (exec: resume it first), activity_lapsed (exec: the command waited for a worker past its ttlMs, or a stop asked to cancel it before it started: it did not run)',
  '502': 'exec: the service or the worker failed to run the command (its code says why); exec_cut: the API closed while it ran and could not cancel it (it may still be running)',
  '503': 'redis_unavailable; walk_unavailable, with Retry-After (attention, a timeline: its walk thread stopped, or the API is closing); client_closed, with Retry-After (the API is closing: it cut the request short, or the request came as it closed); secrets_key_missing (saving credentials, or an exec with env or stdin, needs LEASE_OPS_SECRETS_KEY); secrets_key_mismatch (the workers cannot open what this API seals); providers_unannounced (saving a provider instance while no worker has said what it serves: none started, or Redis lost its data; its name cannot be checked against theirs)',
  '504': 'exec_timeout: no worker ran the command in time',
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
    // Bearer only: the pages and the board take Basic (a browser's), /v1 never does, so a
    // browser's ambient credentials cannot drive it from another site.
    components: { securitySchemes: { bearer: { type: 'http', scheme: 'bearer' } } },
    security: [{ bearer: [] }],
    paths: {
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/operations': {
        post: {
          operationId: 'enqueueOperation',
          summary: 'Enqueue an operation for a lease; answers at once with its job id, or with Prefer: wait=<s> once it ended (if it does in time)',
          requestParams: {
            path: LeasePathSchema,
            header: z.object({ 'Idempotency-Key': IdempotencyKeySchema.optional(), Prefer: PreferHeaderSchema }),
          },
          requestBody: { content: { 'application/json': { schema: EnqueueBodySchema } } },
          responses: {
            '200': {
              ...json(EndedOperationSchema, 'with Prefer: wait, the operation ended in time: completed (with its result) or failed (with its error)'),
              headers: z.object({ Location: z.string(), 'Preference-Applied': z.string().meta({ description: 'wait=<the seconds waited at most>' }) }),
            },
            '202': {
              ...json(EnqueuedSchema, 'accepted; the Location header points at the operation'),
              headers: z.object({ Location: z.string() }),
            },
            ...errors('400', '401', '404', '409', '413', '415', '422', '429', '503'), ...NODE_ANSWERS,
          },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}': {
        get: {
          operationId: 'getLease',
          summary: "A lease's lane: executing, queued, backing off, last observed provider state and since when",
          requestParams: { path: LeasePathSchema },
          responses: { '200': json(LeaseViewSchema, 'the lease'), ...errors('400', '401', '404', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/timeline': {
        get: {
          operationId: 'getLeaseTimeline',
          summary: "A lease's lane and its recent history: accepted, each attempt, what the provider said, backoffs, the watchdog's force-stops, the end",
          requestParams: { path: LeasePathSchema },
          responses: { '200': json(LeaseTimelineSchema, 'the lease and its events'), ...errors('400', '401', '404', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/operations/{jobId}/cancel': {
        post: {
          operationId: 'cancelOperation',
          summary: 'Cancel a queued or backing-off operation: it leaves its lane and fails with code cancelled (never one that executes, but an executing acquire is asked to stop at its next step); what a cancelled acquire made is destroyed; recorded on its lease timeline',
          requestParams: { path: OperationPathSchema },
          responses: { '200': json(CancelResultSchema, 'cancelled'), ...errors('400', '401', '404', '409', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/operations/{jobId}/rerun': {
        post: {
          operationId: 'rerunOperation',
          summary: "Run a failed operation again: it joins its lane at the tail with its original time budget from now; recorded on its lease timeline. Its provider is checked as an enqueue's (422 unknown_provider)",
          requestParams: { path: OperationPathSchema },
          responses: { '202': json(RerunResultSchema, 'queued again'), ...errors('400', '401', '404', '409', '422', '429', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/pause': {
        post: {
          operationId: 'pauseLane',
          summary: "Pause a lease's lane: the executing operation finishes, nothing new starts; operations are still accepted (and fail at their deadline)",
          requestParams: { path: LeasePathSchema },
          responses: { '200': json(PauseResultSchema, 'paused'), ...errors('400', '401', '404', '429', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/acknowledge': {
        post: {
          operationId: 'acknowledgeFailures',
          summary: "Acknowledge a lease's failures: they leave the attention list (each also leaves when that kind of operation next succeeds)",
          requestParams: { path: LeasePathSchema },
          responses: { '200': json(AcknowledgeResultSchema, 'acknowledged'), ...errors('400', '401', '404', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/unpause': {
        post: {
          operationId: 'unpauseLane',
          summary: "Unpause a lease's lane: its head goes to the workers",
          requestParams: { path: LeasePathSchema },
          responses: { '200': json(PauseResultSchema, 'unpaused'), ...errors('400', '401', '404', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/operations/{jobId}': {
        get: {
          operationId: 'getOperation',
          summary: "An operation's state, result or error; optionally waits for it to end",
          requestParams: { path: OperationPathSchema, query: WaitQuerySchema },
          responses: { '200': json(OperationViewSchema, 'the operation'), ...errors('400', '401', '404', '429', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/activities': {
        post: {
          operationId: 'beginActivity',
          summary: "Begin an activity (work inside the lease's sandbox): its stops, releases and destroys wait until it ends, or its heartbeats stop for ttlMs; refused (409 lease_closing, Retry-After) while one of them is queued or runs",
          requestParams: { path: LeasePathSchema },
          requestBody: { content: { 'application/json': { schema: ActivityBodySchema } } },
          responses: { '201': json(ActivitySchema, 'begun'), ...errors('400', '401', '404', '409', '413', '415', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/leases/{provider}/{companyId}/{environmentId}/{leaseId}/exec': {
        post: {
          operationId: 'execInSandbox',
          summary: "Run a command in the lease's sandbox and answer how it ended. An activity brackets it: refused (409 lease_closing, Retry-After) while a stop, release or destroy of the lease is queued or runs; such an operation waits for it, and one with cancelActiveWork cancels it (`cancelled`)",
          requestParams: { path: LeasePathSchema },
          requestBody: { content: { 'application/json': { schema: ExecBodySchema } } },
          responses: { '200': json(ExecResultSchema, 'it ended (whatever its exit code)'), ...errors('400', '401', '404', '409', '413', '415', '422', '429', '502', '503', '504'), ...NODE_ANSWERS },
        },
      },
      '/v1/activities/{token}/heartbeat': {
        post: {
          operationId: 'heartbeatActivity',
          summary: 'Keep an activity open for ttlMs more; says whether a stop asked it to cancel. An activity past its TTL is gone for good (404)',
          requestParams: { path: ActivityPathSchema },
          requestBody: { content: { 'application/json': { schema: HeartbeatBodySchema } } },
          responses: { '200': json(HeartbeatSchema, 'extended'), ...errors('400', '401', '404', '413', '415', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/activities/{token}': {
        delete: {
          operationId: 'endActivity',
          summary: 'End an activity: what waits for it goes on',
          requestParams: { path: ActivityPathSchema },
          responses: { '204': { description: 'ended' }, ...errors('400', '401', '404', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/providers': {
        get: {
          operationId: 'listProviders',
          summary: "The workers' configured providers this token may use, and the provider instances saved at run time within its scope (a page at a time), each with what it can do",
          requestParams: { query: ProviderListQuerySchema },
          responses: { '200': json(ProviderListSchema, 'the providers'), ...errors('400', '401', '403', '503'), ...NODE_ANSWERS },
        },
        post: {
          operationId: 'createProviderInstance',
          summary: "Save a company's provider instance (its own key and settings); a worker tries the credentials first and refused ones are not saved (422 credentials_refused). The key is sealed with the master key and never returned",
          requestParams: { query: InstanceSaveQuerySchema },
          requestBody: { content: { 'application/json': { schema: InstanceCreateBodySchema } } },
          responses: { '201': json(ProviderInstanceSchema, 'saved (Location names it)'), ...errors('400', '401', '403', '409', '413', '415', '422', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/providers/{name}': {
        get: {
          operationId: 'getProvider',
          summary: "A configured provider, or the company's instance of that name, and what it can do; with probe=true, whether its service takes its credentials (a worker asks it)",
          requestParams: { path: ProviderPathSchema, query: ProbeQuerySchema },
          responses: { '200': json(z.union([ProviderSchema, ProviderInstanceSchema]), 'the provider'), ...errors('400', '401', '404', '503'), ...NODE_ANSWERS },
        },
        patch: {
          operationId: 'updateProviderInstance',
          summary: 'Change a provider instance: each field given replaces that field; new credentials are tried first. Workers use it from their next attempt',
          requestParams: { path: ProviderPathSchema, query: InstanceSaveQuerySchema, header: IfMatchHeaderSchema },
          requestBody: { content: { 'application/json': { schema: InstancePatchBodySchema } } },
          responses: { '200': json(ProviderInstanceSchema, 'saved'), ...errors('400', '401', '403', '404', '412', '413', '415', '422', '503'), ...NODE_ANSWERS },
        },
        delete: {
          operationId: 'deleteProviderInstance',
          summary: 'Delete a provider instance: operations that name it fail with provider_deleted',
          requestParams: { path: ProviderPathSchema, query: InstanceDeleteQuerySchema, header: IfMatchHeaderSchema },
          responses: { '204': { description: 'deleted' }, ...errors('400', '401', '404', '412', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/attention': {
        get: {
          operationId: 'listLeasesNeedingAttention',
          summary: 'Leases stuck stopping, with a failed operation not made good, or whose lane is paused or blocked, a page at a time',
          requestParams: { query: AttentionQuerySchema },
          responses: { '200': json(AttentionListSchema, 'the leases, within the token scope'), ...errors('400', '401', '503'), ...NODE_ANSWERS },
        },
      },
      '/v1/overview': {
        get: {
          operationId: 'getOverview',
          summary: 'The whole queue at a glance (admin tokens only)',
          responses: { '200': json(OverviewSchema, 'operations by state, open lanes, attention'), ...NODE_BAD_REQUEST, ...errors('401', '403', '503'), ...NODE_ANSWERS },
        },
      },
    },
  });
}
