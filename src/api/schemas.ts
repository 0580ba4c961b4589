import { z } from 'zod';
import { InstanceCreateSchema, InstancePatchSchema, INSTANCE_TYPES } from '../providers/instances/schemas.ts';
import { ExecRequestSchema } from '../queues/exec-jobs.ts';
import { LeaseIdentitySchema } from '../lease.ts';
import { OPERATIONS, OperationParamsSchemas } from '../operations.ts';
import type { AttentionItem, LeaseTimeline, LeaseView, OperationView, QueueOverview } from '../queues/inspect.ts';
import { HISTORY_EVENT_KINDS, type HistoryEvent } from '../queues/lease-history.ts';

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
export const IdempotencyKeySchema = z
  .string()
  .min(1)
  .max(256)
  .refine((key) => !key.startsWith('lease-ops:'), { message: 'keys starting with "lease-ops:" are lease-ops\' own (its watchdog\'s force-stops)' });
const idempotencyKey = IdempotencyKeySchema.optional().meta({
  description: 'the same key returns the same operation for 24 h (the Idempotency-Key header works too); keys starting with "lease-ops:" are lease-ops\' own and refused',
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
  .meta({
    id: 'EnqueueRequest',
    description: "One lease operation and its parameters; params.providerLeaseId, where an operation takes one, must be the path's leaseId (400 otherwise)",
  });

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

/**
 * The Prefer header of an enqueue (RFC 7240): `wait=<seconds>` asks the API to answer once the
 * operation ended, for up to that long (capped by LEASE_OPS_API_MAX_WAIT_MS). Preferences are
 * hints: others, and a wait that is not a whole number of seconds, are ignored.
 */
export const PreferHeaderSchema = z
  .string()
  .max(1_024)
  .optional()
  .meta({ description: 'RFC 7240; `wait=<seconds>`: answer 200 with the ended operation if it ends within that long (capped by LEASE_OPS_API_MAX_WAIT_MS), else 202 as without it' });

/** The wait an enqueue's Prefer header asks for, in ms (0 for none). */
export function preferredWaitMs(prefer: string | undefined): number {
  if (!prefer) return 0;
  for (const part of prefer.split(',')) {
    const m = /^\s*wait\s*=\s*"?(\d{1,9})"?\s*(?:;.*)?$/i.exec(part);
    if (m) return Number(m[1]) * 1_000;
  }
  return 0;
}

/** Where one operation is (`paused`: waiting in a lane an operator paused); the overview counts them by the same states. */
const OperationStateSchema = z.enum(['queued', 'ready', 'running', 'backing-off', 'paused', 'completed', 'failed']);

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
    paused: z.object({ by: z.string(), since: z.number() }).optional().meta({ description: 'state paused: who paused the lane, and since when (epoch ms)' }),
    result: z.unknown().optional(),
    error: z.object({ code: z.string(), message: z.string() }).optional(),
  })
  .meta({ id: 'Operation' });

export const EndedOperationSchema = OperationViewSchema.extend({
  deduplicated: z.enum(['coalesced', 'idempotency-key', 'absorbed-stop']).optional(),
  location: z.string().meta({ description: 'where to read the operation' }),
}).meta({ id: 'EndedOperation', description: 'an enqueue with Prefer: wait whose operation ended in time: the operation as GET /v1/operations/{jobId} shows it' });

export const LeaseViewSchema = z
  .object({
    lease: LeaseIdentitySchema.meta({ description: 'the lease as asked for: by either of its names (its sandbox id, or the id its acquire was enqueued under) the view is the same' }),
    laneId: z.string(),
    sandboxId: z.string().nullable().meta({ description: "the sandbox's id as last seen: the lease's other name (every view by either name is this one)" }),
    acquiredAs: z.string().nullable().meta({ description: "the id the lease's acquire was enqueued under, when it is not the sandbox's" }),
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
        forceJob: z.string().nullable().meta({ description: 'the job of the last force-stop the watchdog queued in this stuck episode' }),
      })
      .nullable(),
    lastFailure: z.object({ jobId: z.string(), at: z.number(), code: z.string(), message: z.string() }).nullable(),
    paused: z
      .object({ by: z.string(), since: z.number() })
      .nullable()
      .meta({ description: 'an operator paused the lane: nothing new starts until it is unpaused' }),
    stuck: z
      .object({ since: z.number(), budgetMs: z.number().int() })
      .nullable()
      .meta({ description: 'the sandbox has been on its way to stopped since `since` (epoch ms), longer than LEASE_OPS_STUCK_STOPPING_MS (`budgetMs`): what the watchdog forces and attention lists' }),
  })
  .meta({ id: 'Lease' });

export const HistoryEventSchema = z
  .object({
    at: z.number().meta({ description: "epoch ms, Redis' clock" }),
    kind: z.enum(HISTORY_EVENT_KINDS),
    jobId: z.string().nullable(),
    op: z.string().optional(),
    ahead: z.number().int().optional().meta({ description: 'accepted: operations ahead of it in the lane (0: it was the head)' }),
    attempt: z.number().int().optional().meta({ description: '1 for the first attempt' }),
    until: z.number().optional().meta({ description: 'backing-off: when the retry comes due (epoch ms)' }),
    since: z.number().optional().meta({ description: 'stuck: since when the sandbox was stopping (epoch ms)' }),
    by: z.string().optional(),
    code: z.string().optional(),
    message: z.string().optional(),
    state: z.string().optional().meta({ description: 'observed: the state kind (running, stopped, transitioning, ...)' }),
    providerState: z.string().optional().meta({ description: "observed: the provider's own word for it" }),
    sandbox: z.string().optional(),
  })
  .meta({ id: 'HistoryEvent' });

export const LeaseTimelineSchema = LeaseViewSchema.extend({
  now: z.number().meta({ description: "Redis' clock when read (epoch ms)" }),
  events: z.array(HistoryEventSchema).meta({ description: "the lease's last 200 history entries, oldest first, kept a week past the last one (an attempt's start and end are one entry, so up to 400 events)" }),
  historyFull: z.boolean().meta({ description: 'the history holds as many entries as it keeps (200): older events were dropped' }),
  operations: z.array(OperationViewSchema).meta({ description: 'the operations the events name, while BullMQ keeps them' }),
}).meta({ id: 'LeaseTimeline' });

const CapabilitiesSchema = z
  .object({
    stop: z.boolean(),
    pause: z.boolean(),
    forceStop: z.boolean().meta({ description: 'can kill a sandbox (the watchdog forces stuck stops; cancelActiveWork is taken)' }),
    expiry: z.boolean().optional().meta({ description: "bounds a sandbox at an acquire's requestedExpiresAt, answering the service's own expiry" }),
    resources: z.boolean().optional().meta({ description: "takes an acquire's resources" }),
    archive: z.boolean().optional().meta({ description: 'takes the archive release disposition' }),
    exec: z.boolean().optional().meta({ description: 'runs commands in its sandboxes (POST .../exec)' }),
  })
  .meta({ id: 'ProviderCapabilities' });

export const ProbeSchema = z
  .object({
    ok: z.boolean(),
    code: z.string().meta({ description: 'ok, nothing_to_check, or why not: unauthorized, forbidden, network, unknown_provider, probe_timeout, ...' }),
    message: z.string(),
    at: z.number().meta({ description: 'epoch ms the worker asked the service (answers are shared for 30 s)' }),
  })
  .meta({ id: 'ProviderProbe' });

export const ProviderSchema = z
  .object({
    name: z.string(),
    lastSeenAt: z.number().meta({ description: 'epoch ms a worker last said it serves it' }),
    capabilities: CapabilitiesSchema.nullable().meta({ description: 'null when its workers did not say (older versions)' }),
    probe: ProbeSchema.optional().meta({ description: 'with ?probe=true: whether the service takes the credentials, asked by a worker now' }),
  })
  .meta({ id: 'Provider' });
export const ProviderInstanceSchema = z
  .object({
    name: z.string(),
    type: z.enum(INSTANCE_TYPES),
    companyId: z.string(),
    environmentIds: z.array(z.string()).nullable().meta({ description: 'the environments whose leases may use it; null: every environment of the company' }),
    source: z.literal('instance'),
    config: z.record(z.string(), z.unknown()).meta({ description: 'its settings, as saved' }),
    credentials: z.object({ fingerprint: z.string().meta({ description: 'sha256: and the first 8 hex digits of SHA-256 of the API key; the key itself is never returned' }) }),
    rev: z.number().meta({ description: 'changes with every save; send it as If-Match to refuse a lost update' }),
    createdAt: z.string(),
    updatedAt: z.string(),
    updatedBy: z.string(),
    capabilities: CapabilitiesSchema.optional(),
    probe: ProbeSchema.optional().meta({ description: 'what the service answered when a worker tried the credentials (on save, or with ?probe=true)' }),
  })
  .meta({ id: 'ProviderInstance' });
export const ProviderListSchema = z
  .object({
    providers: z.array(ProviderSchema).meta({ description: "the workers' configured providers this token may use (on the first page only)" }),
    instances: z.array(ProviderInstanceSchema).meta({ description: 'provider instances saved at run time, by company then name, within the token scope' }),
    nextCursor: z.string().nullable().meta({ description: 'pass as ?cursor= for the next page of instances; null on the last' }),
  })
  .meta({ id: 'ProviderList' });
export const ProviderListQuerySchema = z.strictObject({
  companyId: z.string().min(1).max(256).optional().meta({ description: "admin tokens: one company's instances (all companies' if left out); a scoped token's own company always" }),
  cursor: z.string().min(1).max(600).optional(),
  limit: z.coerce.number().int().min(1).max(500).optional().meta({ description: 'instances per page (default 100)' }),
});
export const ProviderPathSchema = z.strictObject({ name: LeaseIdentitySchema.shape.provider.meta({ description: 'the provider key, as in a lease path' }) });
export const ProbeQuerySchema = z.strictObject({
  probe: z.enum(['true', 'false']).optional().meta({ description: 'true: have a worker ask the service whether it takes the credentials (bounded, paced, shared for 30 s)' }),
  companyId: z.string().min(1).max(256).optional().meta({ description: "admin tokens: the company whose instance this names (a scoped token's own company always)" }),
});
export const InstanceSaveQuerySchema = z.strictObject({
  probe: z.enum(['true', 'false']).optional().meta({ description: 'false: save without having a worker try the credentials first (default true: refused credentials are not saved)' }),
  companyId: z.string().min(1).max(256).optional().meta({ description: "admin tokens: the company whose instance this names (a scoped token's own company always)" }),
});
export const InstanceDeleteQuerySchema = z.strictObject({
  companyId: z.string().min(1).max(256).optional().meta({ description: "admin tokens: the company whose instance this names (a scoped token's own company always)" }),
});
export const IfMatchHeaderSchema = z.strictObject({
  'if-match': z
    .string()
    .regex(/^(W\/)?"?[0-9]{1,15}"?$/, 'If-Match is an instance revision, e.g. "12"')
    .transform((v) => Number(v.replace(/^W\//, '').replaceAll('"', '')))
    .optional(),
});
export const ExecBodySchema = ExecRequestSchema.meta({ id: 'ExecRequest', description: "a command to run in the lease's sandbox: `command` with `args` (each quoted), or a shell line with none; env and stdin travel sealed with the master key (needed for them)" });
export const ExecResultSchema = z
  .object({
    exitCode: z.number().nullable().meta({ description: "the command's exit code; null if it had not exited 30 s after a cancel or timeout" }),
    signal: z.string().nullable(),
    timedOut: z.boolean().meta({ description: 'ended by its timeoutMs' }),
    cancelled: z.boolean().meta({ description: 'a stop, release or destroy with cancelActiveWork asked it to end (or its activity lapsed)' }),
    stdout: z.string(),
    stderr: z.string(),
  })
  .meta({ id: 'ExecResult' });
export const InstanceCreateBodySchema = InstanceCreateSchema.meta({ id: 'ProviderInstanceCreate', description: "a provider instance: its settings per type (Daytona's or CreateOS' settings without name and key), its credentials, its company and environments" });
export const InstancePatchBodySchema = InstancePatchSchema.meta({ id: 'ProviderInstancePatch', description: 'each field given replaces that field (config as a whole)' });

export const ActivityBodySchema = z
  .strictObject({
    kind: z.string().min(1).max(64).regex(/^[^\p{Cc}]+$/u, 'kind must not contain control characters').meta({ description: 'what runs: exec, sync, ...' }),
    ttlMs: z.number().int().min(1_000).max(3_600_000).meta({ description: 'how long it lives without a heartbeat (1 s to 1 h)' }),
  })
  .meta({ id: 'ActivityRequest' });
export const HeartbeatBodySchema = z
  .strictObject({ ttlMs: z.number().int().min(1_000).max(3_600_000).meta({ description: 'how long from now it lives without another heartbeat' }) })
  .meta({ id: 'HeartbeatRequest' });
export const ActivityPathSchema = z.strictObject({ token: z.string().min(1).max(64).meta({ description: 'the token beginActivity answered' }) });
export const ActivitySchema = z
  .object({
    token: z.string().meta({ description: 'heartbeat it within ttlMs, end it when the work ends' }),
    laneId: z.string(),
    expiresAt: z.number().meta({ description: "epoch ms (Redis' clock) it is gone at without a heartbeat" }),
  })
  .meta({ id: 'Activity' });
export const HeartbeatSchema = z
  .object({
    expiresAt: z.number(),
    cancel: z.boolean().meta({ description: 'a stop, release or destroy with cancelActiveWork asked the work to cancel' }),
  })
  .meta({ id: 'Heartbeat' });

export const CancelResultSchema = z
  .object({
    jobId: z.string(),
    laneId: z.string(),
    cancelled: z.literal(true),
    whileExecuting: z.boolean().meta({ description: 'an executing acquire was asked to stop at its next step (it may complete first); what a cancelled acquire made is destroyed' }),
  })
  .meta({ id: 'Cancelled' });
export const RerunResultSchema = z
  .object({
    jobId: z.string(),
    laneId: z.string(),
    deadlineAt: z.number().meta({ description: 'its new deadline: its original time budget, from now' }),
    location: z.string(),
    overLimit: z.string().optional().meta({ description: 'an admin ran it again past a queue limit (its code); a scoped token is refused there (429)' }),
  })
  .meta({ id: 'RunAgain' });
export const PauseResultSchema = z
  .object({
    laneId: z.string(),
    paused: z.boolean(),
    changed: z.boolean().meta({ description: 'false when the lane already was as asked' }),
    since: z.number().nullable(),
    overLimit: z.literal('company_pauses_full').optional().meta({ description: "an admin paused past the company's limit of paused lanes (a scoped token is refused there: 429 company_pauses_full)" }),
  })
  .meta({ id: 'LanePause' });

export const AcknowledgeResultSchema = z
  .object({
    acknowledged: z.array(z.object({ op: z.string(), jobId: z.string(), at: z.number() })).meta({ description: 'each kind of operation whose failure left the attention list (empty: there was none)' }),
  })
  .meta({ id: 'Acknowledged' });

export const AttentionItemSchema = z
  .object({
    laneId: z.string(),
    lease: LeaseIdentitySchema.nullable(),
    reason: z.enum(['stuck_stopping', 'operation_failed', 'paused', 'blocked']).meta({ description: 'the first of its reasons' }),
    reasons: z.array(z.enum(['stuck_stopping', 'operation_failed', 'paused', 'blocked'])).meta({ description: 'every reason the lease needs someone (one item per lease)' }),
    since: z.number().meta({ description: 'epoch ms since the earliest of its reasons holds' }),
    detail: z.string().meta({ description: "each reason's detail, joined with '; '" }),
  })
  .meta({ id: 'AttentionItem' });

export const AttentionListSchema = z
  .object({
    items: z.array(AttentionItemSchema),
    next: z.number().int().nullable().meta({ description: 'the offset of the next page, null on the last one' }),
  })
  .meta({ id: 'AttentionList' });

/** A whole number in decimal digits only: no `0x10`, no `1e3`, no empty value. */
const decimal = (name: string, max: number) =>
  z
    .string()
    .regex(/^\d{1,9}$/, `${name} is a whole number (decimal digits)`)
    .transform(Number)
    .pipe(z.number().max(max, `${name} is at most ${max}`));

export const AttentionQuerySchema = z.strictObject({
  offset: decimal('offset', 1_000_000).optional().meta({ description: 'where the page starts (next of the previous page); 0 by default' }),
  limit: decimal('limit', 500)
    .pipe(z.number().min(1, 'limit is at least 1'))
    .optional()
    .meta({ description: 'at most this many items (1 to 500; 200 by default)' }),
});

export const OverviewSchema = z
  .object({
    counts: z.record(OperationStateSchema, z.number().int()),
    openLanes: z.number().int(),
    attention: z.array(AttentionItemSchema).meta({ description: 'the first 200 leases needing attention' }),
    attentionLeases: z.number().int().meta({ description: 'leases needing attention, each once whatever its reasons (blocked ones among the first 200 looked at)' }),
    bytesByCompany: z.record(z.string(), z.number().int()).meta({ description: "Redis bytes each company's operations are counted as holding against LEASE_OPS_MAX_BYTES_PER_COMPANY" }),
  })
  .meta({ id: 'Overview' });

export const ErrorBodySchema = z
  .object({
    error: z.object({
      code: z.string().meta({ description: 'stable; branch on it' }),
      message: z.string(),
      details: z.array(z.unknown()).optional().meta({ description: "zod's issues for a request that did not validate" }),
      jobId: z.string().optional().meta({ description: 'idempotency_key_reused: the operation the key names (read or wait for it at /v1/operations/{jobId})' }),
    }),
  })
  .meta({ id: 'Error' });

// Compile-time checks that the views the inspector builds match the published schemas, and
// have no field the schemas leave out (their objects allow no other properties).
type Assignable<T, U extends T> = U;
type SameKeys<A, B> = [Exclude<keyof A, keyof B> | Exclude<keyof B, keyof A>] extends [never] ? true : false;
type Holds<T extends true> = T;
export type ViewsHaveNoOtherFields = [
  Holds<SameKeys<z.input<typeof OperationViewSchema>, OperationView>>,
  Holds<SameKeys<z.input<typeof LeaseViewSchema>, LeaseView>>,
  Holds<SameKeys<NonNullable<z.input<typeof LeaseViewSchema>['observed']>, NonNullable<LeaseView['observed']>>>,
  Holds<SameKeys<z.input<typeof AttentionItemSchema>, AttentionItem>>,
  Holds<SameKeys<z.input<typeof OverviewSchema>, QueueOverview>>,
  Holds<SameKeys<z.input<typeof LeaseTimelineSchema>, LeaseTimeline>>,
  Holds<SameKeys<z.input<typeof HistoryEventSchema>, HistoryEvent>>,
];
export type ViewsMatchSchemas = [
  Assignable<z.input<typeof OperationViewSchema>, OperationView>,
  Assignable<z.input<typeof LeaseViewSchema>, LeaseView>,
  Assignable<z.input<typeof AttentionItemSchema>, AttentionItem>,
  Assignable<z.input<typeof OverviewSchema>, QueueOverview>,
  Assignable<z.input<typeof LeaseTimelineSchema>, LeaseTimeline>,
];
