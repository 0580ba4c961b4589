import { z } from 'zod';
import { LeaseIdentitySchema } from '../lease.ts';
import { ResourceDispositionSchema } from '../operations.ts';

/**
 * A paperclip environment's driver config for lease-ops: which lease-ops, as whom, and which
 * of its providers. Each environment has its own (its company's token, its provider).
 */
export const LeaseOpsDriverConfigSchema = z.object({
  /** The lease-ops API (`http://host:3000`); not needed when the plugin runs lease-ops in-process. */
  leaseOpsUrl: z.url({ protocol: /^https?$/ }).optional(),
  /** A lease-ops API token (a paperclip secret-ref resolves to it): scoped to the company it serves. */
  token: z.string().min(1).max(1_024).optional(),
  /** The lease-ops provider the environment's sandboxes come from, as GET /v1/providers lists it. */
  provider: LeaseIdentitySchema.shape.provider,
  /** Stop and keep the sandbox on release (resumed by the next run) instead of destroying it. */
  reuseLease: z.boolean().default(false),
  /** What a release does; by default stop_and_retain with reuseLease, else destroy. */
  releaseDisposition: ResourceDispositionSchema.optional(),
  /** Refuse an acquire whose requestedExpiresAt the provider cannot bound (instead of a lease with no expiry). */
  requireExpiry: z.boolean().default(false),
  /** How long a hook waits for its operation before it gives up (and cancels an acquire). */
  hookTimeoutMs: z.number().int().min(1_000).max(3_600_000).default(300_000),
});
export type LeaseOpsDriverConfig = z.infer<typeof LeaseOpsDriverConfigSchema>;

/** The disposition a release uses: the host's when it says one, else the config's. */
export function releaseDispositionOf(config: LeaseOpsDriverConfig, asked: unknown): z.infer<typeof ResourceDispositionSchema> {
  const parsed = ResourceDispositionSchema.safeParse(asked);
  if (parsed.success) return parsed.data;
  return config.releaseDisposition ?? (config.reuseLease ? 'stop_and_retain' : 'destroy');
}

/** The config's JSON Schema for paperclip's environment form (the token as a secret reference). */
export function driverConfigJsonSchema(): Record<string, unknown> {
  const schema = z.toJSONSchema(LeaseOpsDriverConfigSchema, { io: 'input' }) as { properties: Record<string, Record<string, unknown>> } & Record<string, unknown>;
  schema.properties.token = { ...schema.properties.token, format: 'secret-ref' };
  delete schema.$schema;
  return schema;
}
