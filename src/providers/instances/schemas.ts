import { z } from 'zod';
import { CreateosSettingsSchema } from '../createos/index.ts';
import { DaytonaSettingsSchema } from '../daytona/index.ts';

/**
 * Provider instances saved at run time: what a caller sends, checked per provider type.
 * Settings are the built-in providers' own (DaytonaSettingsSchema, CreateosSettingsSchema)
 * without the name and the key: the name is the instance's, the key is in `credentials`.
 */

export const INSTANCE_TYPES = ['daytona', 'createos'] as const;
export type InstanceType = (typeof INSTANCE_TYPES)[number];

/** The services' public addresses: always allowed; others only if LEASE_OPS_INSTANCE_API_URLS lists them. */
export const PUBLIC_API_URLS: Record<InstanceType, string> = {
  daytona: 'https://app.daytona.io/api',
  createos: 'https://api.sb.createos.sh',
};

export const InstanceNameSchema = z
  .string()
  .regex(/^[a-z0-9][a-z0-9._-]{0,62}$/, 'a name is 1 to 63 of a-z, 0-9, ".", "_" and "-", starting with a letter or digit');

const EnvironmentIdsSchema = z.array(z.string().min(1).max(256)).min(1).max(100);

export const INSTANCE_CONFIG_SCHEMAS = {
  daytona: DaytonaSettingsSchema.omit({ name: true, apiKey: true }).extend({ apiUrl: z.url().optional() }),
  createos: CreateosSettingsSchema.omit({ name: true, apiKey: true }).extend({ apiUrl: z.url().optional() }),
} as const;

/** Credentials: the service's API key (never returned, logged or put in job data). */
export const CredentialsSchema = z.strictObject({ apiKey: z.string().min(1).max(4_096) });
export type Credentials = z.infer<typeof CredentialsSchema>;

/** A settings object: checked against its type's schema where the type is known (checkConfig). */
const ConfigObjectSchema = z.record(z.string(), z.unknown());

/** POST /v1/providers. */
export const InstanceCreateSchema = z
  .strictObject({
    name: InstanceNameSchema,
    type: z.enum(INSTANCE_TYPES),
    /** Required of an admin; a scoped token's own company if left out (another is refused). */
    companyId: z.string().min(1).max(256).optional(),
    /** The environments whose leases may use it; every environment of the company if left out. */
    environmentIds: EnvironmentIdsSchema.optional(),
    config: ConfigObjectSchema.optional(),
    credentials: CredentialsSchema,
  })
  .superRefine((body, ctx) => checkConfig(body.type, body.config ?? {}, ctx));
export type InstanceCreate = z.infer<typeof InstanceCreateSchema>;

/**
 * Checks settings against their type's schema, adding each issue under `config.<path>`. The
 * settings are kept as given (not with defaults filled in): an instance saved today follows
 * a later version's defaults.
 */
export function checkConfig(type: InstanceType, config: Record<string, unknown>, ctx: z.RefinementCtx): void {
  const parsed = INSTANCE_CONFIG_SCHEMAS[type].safeParse(config);
  if (parsed.success) return;
  for (const issue of parsed.error.issues) ctx.addIssue({ ...issue, path: ['config', ...issue.path] } as never);
}

/** PATCH /v1/providers/{name}: each field given replaces that field (config as a whole). */
export const InstancePatchSchema = z
  .strictObject({
    environmentIds: EnvironmentIdsSchema.nullable().optional(),
    config: ConfigObjectSchema.optional(),
    credentials: CredentialsSchema.optional(),
  })
  .refine((patch) => Object.keys(patch).length > 0, 'an update names at least one of environmentIds, config, credentials');
export type InstancePatch = z.infer<typeof InstancePatchSchema>;

/** What reads show of an instance: never its credentials, only their fingerprint. */
export interface InstanceView {
  name: string;
  type: InstanceType;
  companyId: string;
  environmentIds: string[] | null;
  source: 'instance';
  config: Record<string, unknown>;
  credentials: { fingerprint: string };
  /** Changes with every save; an update may name it (If-Match) to refuse a lost update. */
  rev: number;
  createdAt: string;
  updatedAt: string;
  updatedBy: string;
}

/**
 * Whether an instance may send requests to `apiUrl`: the service's public address, or an
 * address the operator listed (LEASE_OPS_INSTANCE_API_URLS, comma-separated prefixes). A
 * tenant cannot point the workers at an address of their network.
 */
export function apiUrlAllowed(type: InstanceType, apiUrl: string, allowed: readonly string[]): boolean {
  const url = normalUrl(apiUrl);
  if (!url) return false;
  return [PUBLIC_API_URLS[type], ...allowed].some((text) => {
    const prefix = normalUrl(text);
    return prefix !== null && url.origin === prefix.origin && (url.path === prefix.path || url.path.startsWith(`${prefix.path.replace(/\/$/, '')}/`) || prefix.path === '/');
  });
}

/**
 * An address as requests will use it: http(s) only, no user, query or fragment, its path
 * with `..` and `%2e%2e` resolved (as the URL parser resolves them before sending) and no
 * trailing slash, so a prefix check sees the path that is really sent to.
 */
function normalUrl(text: string): { origin: string; path: string } | null {
  let url: URL;
  try {
    url = new URL(text);
  } catch {
    return null;
  }
  if ((url.protocol !== 'https:' && url.protocol !== 'http:') || url.username || url.password || url.search || url.hash) return null;
  // %2e%2e is not resolved by the parser but is by many servers: no dot segments in any form.
  if (/%2e/i.test(url.pathname)) return null;
  return { origin: url.origin, path: url.pathname.replace(/\/+$/, '') || '/' };
}

/** LEASE_OPS_INSTANCE_API_URLS: comma-separated URL prefixes. */
export function parseAllowedApiUrls(text: string | undefined): string[] {
  return (text ?? '')
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
}
