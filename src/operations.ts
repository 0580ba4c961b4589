import { z } from 'zod';
import { jsonDepthWithin, MAX_JSON_DEPTH } from './json-limits.ts';
import { LeaseIdentitySchema } from './lease.ts';

export const OPERATIONS = ['acquire', 'resume', 'release', 'stop', 'force-stop', 'destroy'] as const;
export const OperationNameSchema = z.enum(OPERATIONS);
export type OperationName = z.infer<typeof OperationNameSchema>;

/** A sandbox's id, as callers send it and as providers must return it. */
export const ProviderLeaseIdSchema = z
  .string()
  .min(1)
  .max(256)
  .regex(/^[^\p{Cc}]+$/u, 'providerLeaseId must not contain control characters');
const providerLeaseId = ProviderLeaseIdSchema;
/**
 * Opaque metadata a provider returned with a lease; bounded so a job stays small and no
 * parser, logger or Lua script meets a structure deeper than it can handle.
 */
export const LEASE_METADATA_MAX_BYTES = 16_384;
/** Bytes of a value's JSON in UTF-8 (what Redis holds: a character may take up to four). */
export const jsonBytes = (value: unknown): number => Buffer.byteLength(JSON.stringify(value));
export const LeaseMetadataSchema = z.record(z.string().max(128), z.unknown()).superRefine((m, ctx) => {
  if (!jsonDepthWithin(m, MAX_JSON_DEPTH)) ctx.addIssue({ code: 'custom', message: `leaseMetadata must nest at most ${MAX_JSON_DEPTH} levels deep` });
  else if (jsonBytes(m) > LEASE_METADATA_MAX_BYTES) ctx.addIssue({ code: 'custom', message: 'leaseMetadata must serialise to at most 16 KiB of UTF-8' });
});
const leaseMetadata = LeaseMetadataSchema.meta({
  description: 'opaque; at most 16 KiB serialised as JSON in UTF-8 and 32 levels deep (past either: 400 invalid_request)',
});

/**
 * What a release leaves behind: paperclip's three (keep_running, stop_and_retain, destroy),
 * and `archive` where the service has it (Daytona: stopped, its files moved to cheaper storage).
 */
export const ResourceDispositionSchema = z.enum(['keep_running', 'stop_and_retain', 'archive', 'destroy']);
export type ResourceDisposition = z.infer<typeof ResourceDispositionSchema>;

/** A short text of the host's (an agent's id, an adapter's name): bounded, no control characters. */
const hostText = (max: number) => z.string().max(max).regex(/^[^\p{Cc}]*$/u, 'must not contain control characters');

/** Settings the host attaches to an execution workspace: opaque, bounded like lease metadata. */
const HostSettingsSchema = z.record(z.string().max(128), z.unknown()).superRefine((m, ctx) => {
  if (!jsonDepthWithin(m, MAX_JSON_DEPTH)) ctx.addIssue({ code: 'custom', message: `must nest at most ${MAX_JSON_DEPTH} levels deep` });
  else if (jsonBytes(m) > LEASE_METADATA_MAX_BYTES) ctx.addIssue({ code: 'custom', message: 'must serialise to at most 16 KiB of UTF-8' });
});

/**
 * An acquire's parameters: the run, and what the host (paperclip's acquire hook) says of it.
 * The host's fields are handed to the provider (as labels, and `adapterType` may pick the
 * image or snapshot in the provider's configuration); lease-ops decides nothing by them.
 */
export const AcquireParamsSchema = z.strictObject({
  runId: z.string().min(1).max(256),
  /**
   * The latest time the sandbox may live (RFC 3339, any offset). A provider that can bound the
   * sandbox by then does, and the lease's `expiresAt` is the service's own expiry; one that
   * cannot completes with `expiresAt: null` (the host then releases it), unless `requireExpiry`.
   */
  requestedExpiresAt: z.iso.datetime({ offset: true }).nullable().optional(),
  /** Refuse (`expiry_unsupported`, before anything is made) rather than complete without an expiry. */
  requireExpiry: z.boolean().optional(),
  agentId: hostText(256).optional(),
  adapterType: hostText(128).optional(),
  workspaceMode: hostText(64).optional(),
  requestedCwd: hostText(4096).optional(),
  issueId: hostText(256).nullable().optional(),
  executionWorkspaceId: hostText(256).nullable().optional(),
  executionWorkspaceSettings: HostSettingsSchema.nullable().optional(),
  resources: z
    .strictObject({
      cpu: z.number().positive().max(1024).optional(),
      memoryGiB: z.number().positive().max(4096).optional(),
      diskGiB: z.number().positive().max(65536).optional(),
    })
    .optional(),
});
export const ResumeParamsSchema = z.strictObject({ providerLeaseId, leaseMetadata: leaseMetadata.default({}) });
export const ReleaseParamsSchema = z
  .strictObject({
    providerLeaseId,
    leaseMetadata: leaseMetadata.default({}),
    /**
     * Terminate the work in the sandbox instead of letting it finish: the stop is a kill where
     * the provider can force one (a destroy ends it anyway). A receipt still comes only once
     * the service confirms that execution ended.
     */
    cancelActiveWork: z.boolean().default(false),
    resourceDisposition: ResourceDispositionSchema,
  })
  .refine((p) => !(p.cancelActiveWork && p.resourceDisposition === 'keep_running'), {
    path: ['cancelActiveWork'],
    message: 'cancelActiveWork ends the work in the sandbox: it needs a disposition that ends it (stop_and_retain, archive or destroy), not keep_running',
  });
/**
 * A stop or destroy. Either waits, in its lane, for the work open in the sandbox (activity
 * gates) to end; with `cancelActiveWork` it first asks that work to cancel.
 */
export const TargetParamsSchema = z.strictObject({ providerLeaseId, cancelActiveWork: z.boolean().optional() });
/**
 * A force-stop may be conditional: `ifStoppingSince` (epoch ms, as the watchdog saw it) makes
 * it read the sandbox inside its lane first and force only if it is still on its way to
 * stopped; a sandbox that stopped by itself, or runs again, is left alone.
 */
export const ForceStopParamsSchema = z.strictObject({ providerLeaseId, ifStoppingSince: z.number().int().nonnegative().optional() });

/** What an acquire's clean-up carries of its checkpoint: string values, keys and values bounded. */
export const CHECKPOINT_KEY_MAX = 128;
export const CHECKPOINT_VALUE_MAX = 256;

/**
 * An acquire that failed for good left a sandbox behind (or may have): find it the way a
 * retry of that acquire would, and destroy it. Queued by lease-ops itself, never by callers.
 */
export const AbandonAcquireParamsSchema = z.strictObject({
  acquireJobId: z.string().min(1).max(256),
  /** What the acquire's attempts checkpointed (a sandbox id, a name asked for); null when its job was gone. */
  checkpoint: z.record(z.string().max(CHECKPOINT_KEY_MAX), z.string().max(CHECKPOINT_VALUE_MAX)).nullable(),
});

/** The params each operation takes, keyed by operation name. */
export const OperationParamsSchemas = {
  acquire: AcquireParamsSchema,
  resume: ResumeParamsSchema,
  release: ReleaseParamsSchema,
  stop: TargetParamsSchema,
  'force-stop': ForceStopParamsSchema,
  destroy: TargetParamsSchema,
} as const satisfies Record<OperationName, z.ZodType>;

export type OperationParams = {
  [K in OperationName]: z.infer<(typeof OperationParamsSchemas)[K]>;
} & { 'abandon-acquire': z.infer<typeof AbandonAcquireParamsSchema> };

const common = {
  lease: LeaseIdentitySchema,
  /** Epoch ms when lease-ops accepted the operation. */
  acceptedAt: z.number().int().nonnegative(),
  /** Epoch ms after which no attempt starts and no retry is scheduled. */
  deadlineAt: z.number().int().nonnegative(),
  /**
   * Accepted for the lease's company's provider instance of that name: it runs with that
   * instance or fails (provider_deleted when it is gone), never with a configured provider of
   * the same name. Decided when accepted, so no later change of instances or configuration
   * hands it to another provider. Absent: a configured provider of the name first.
   */
  instance: z.literal(true).optional(),
};

/**
 * The data of every lease-ops job, as stored in BullMQ. Validated when enqueued and again
 * when a worker picks the job up, since anything can be written into Redis in between.
 */
export const OperationJobDataSchema = z.discriminatedUnion('op', [
  z.strictObject({ op: z.literal('acquire'), params: AcquireParamsSchema, ...common }),
  z.strictObject({ op: z.literal('resume'), params: ResumeParamsSchema, ...common }),
  z.strictObject({ op: z.literal('release'), params: ReleaseParamsSchema, ...common }),
  z.strictObject({ op: z.literal('stop'), params: TargetParamsSchema, ...common }),
  z.strictObject({ op: z.literal('force-stop'), params: ForceStopParamsSchema, ...common }),
  z.strictObject({ op: z.literal('destroy'), params: TargetParamsSchema, ...common }),
  z.strictObject({ op: z.literal('abandon-acquire'), params: AbandonAcquireParamsSchema, ...common }),
]);
export type OperationJobData = z.infer<typeof OperationJobDataSchema>;

/** Operations lease-ops queues itself; callers cannot enqueue them. */
export type InternalOperationName = 'abandon-acquire';
export type JobOperationName = OperationName | InternalOperationName;

/**
 * Default deadlines per operation (brief: acquire/start 300 s, resume budget 60 s). Cleaning
 * up after a failed acquire may have to wait for a sandbox that is still being created.
 */
export const DEFAULT_DEADLINE_MS: Record<JobOperationName, number> = {
  'abandon-acquire': 30 * 60_000,
  acquire: 300_000,
  resume: 60_000,
  release: 120_000,
  stop: 120_000,
  'force-stop': 120_000,
  destroy: 120_000,
};
