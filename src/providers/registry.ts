import { ConfigError, secretSetting } from '../config.ts';
import { isAbsolute, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { z } from 'zod';
import { createCreateosProvider } from './createos/index.ts';
import { createDaytonaProvider, DAYTONA_THROTTLERS } from './daytona/index.ts';
import { localRateLimiters } from './pacing.ts';
import { createSimulatedProvider } from './simulated/index.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { InstanceProviders, Resolution } from './instances/resolver.ts';
import type { LeaseProvider, ProviderFactory, ProviderServices } from './types.ts';

/** The providers a worker serves, by the key jobs name in `lease.provider`. */
export class ProviderRegistry {
  private readonly byName = new Map<string, LeaseProvider>();
  private readonly closers: (() => void | Promise<void>)[] = [];
  /** The instances saved at run time (the provider registry in Redis), if this worker serves them. */
  instances: InstanceProviders | null = null;

  constructor(
    providers: LeaseProvider[] = [],
    /** Whether close() closes the providers (a shared view leaves that to its owner). */
    private readonly owns = true,
  ) {
    for (const p of providers) this.add(p);
  }

  /** The same providers for one of several users (a partition's worker): its close() leaves them open. */
  shared(): ProviderRegistry {
    const view = new ProviderRegistry([...this.byName.values()], false);
    view.instances = this.instances;
    return view;
  }

  /**
   * The provider of a lease: a configured one by its name, else the lease's company's
   * instance of that name (read from Redis, built once per revision); only the instance for
   * an operation accepted for it (`companyInstance`).
   */
  async resolve(lease: Pick<LeaseIdentity, 'provider' | 'companyId' | 'environmentId'>, companyInstance = false): Promise<Resolution> {
    // Accepted for the company's instance (operation data's `instance`): that instance or
    // nothing, whatever configured provider bears its name now (helper-58, helper-59, helper-60).
    if (companyInstance) {
      return this.instances
        ? this.instances.resolve(lease.companyId, lease.environmentId, lease.provider, { pinned: true })
        : { code: 'unknown_provider', message: `this worker serves no provider instances (the operation is for company ${lease.companyId}'s instance "${lease.provider}")`, forGood: false };
    }
    const configured = this.byName.get(lease.provider);
    if (configured) return { provider: configured };
    if (this.instances) return this.instances.resolve(lease.companyId, lease.environmentId, lease.provider);
    return { code: 'unknown_provider', message: `no provider named "${lease.provider}" is configured on this worker`, forGood: false };
  }

  add(provider: LeaseProvider): void {
    if (this.byName.has(provider.name)) throw new ConfigError(`two providers are named "${provider.name}"`);
    this.byName.set(provider.name, provider);
  }

  get(name: string): LeaseProvider | undefined {
    return this.byName.get(name);
  }

  names(): string[] {
    return [...this.byName.keys()];
  }

  /** Something the providers use that goes when they do (the pacing's Redis connection). */
  onClose(fn: () => void | Promise<void>): void {
    this.closers.push(fn);
  }

  async close(): Promise<void> {
    if (!this.owns) return;
    await Promise.all([...this.byName.values()].map((p) => p.close?.()));
    await Promise.all(this.closers.map((fn) => fn()));
  }
}

/** A required environment variable (or its `_FILE`), with an error that names it (and never its value). */
function required(env: NodeJS.ProcessEnv, variable: string, forWhat: string): string {
  const value = secretSetting(env, variable);
  if (!value) throw new ConfigError(`${forWhat} needs ${variable} (or ${variable}_FILE) to be set`);
  return value;
}

/** An optional environment variable parsed by `schema`; the error names the variable, not its value. */
function optional<T extends z.ZodType>(env: NodeJS.ProcessEnv, variable: string, schema: T): z.infer<T> | undefined {
  const value = env[variable];
  if (value === undefined || value === '') return undefined;
  const parsed = schema.safeParse(value);
  if (!parsed.success) throw new ConfigError(`${variable}: ${parsed.error.issues.map((i) => i.message).join('; ')}`);
  return parsed.data;
}
const positiveInt = z.coerce.number().int().positive();
const booleanFlag = z.enum(['true', 'false', '1', '0']).transform((v) => v === 'true' || v === '1');
const jsonObject = z.string().transform((text, ctx) => {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    ctx.addIssue({ code: 'custom', message: 'must be JSON' });
    return z.NEVER;
  }
});
/** `{"sandbox-create":{"perMinute":480,"burst":120}}`, or null for a throttler not to pace. */
const DaytonaRateLimitsSchema = z.partialRecord(
  z.enum(DAYTONA_THROTTLERS),
  z.strictObject({ perMinute: z.number().positive(), burst: z.number().int().positive().optional() }).nullable(),
);

/** Every setting a built-in provider reads from the environment besides its credentials. */
function daytonaFromEnv(env: NodeJS.ProcessEnv) {
  const timeoutMs = optional(env, 'DAYTONA_TIMEOUT_MS', positiveInt);
  const createTimeoutMs = optional(env, 'DAYTONA_CREATE_TIMEOUT_MS', positiveInt);
  const rateLimits = optional(env, 'DAYTONA_RATE_LIMITS', jsonObject.pipe(DaytonaRateLimitsSchema));
  const notifications = optional(env, 'DAYTONA_NOTIFICATIONS', booleanFlag);
  return {
    ...(env.DAYTONA_ORGANIZATION_ID ? { organizationId: env.DAYTONA_ORGANIZATION_ID } : {}),
    ...(timeoutMs ? { timeoutMs } : {}),
    ...(createTimeoutMs ? { createTimeoutMs } : {}),
    ...(rateLimits ? { rateLimits } : {}),
    ...(notifications === undefined ? {} : { notifications }),
  };
}
function createosFromEnv(env: NodeJS.ProcessEnv) {
  const numbers = {
    timeoutMs: optional(env, 'CREATEOS_TIMEOUT_MS', positiveInt),
    requestsPerMinute: optional(env, 'CREATEOS_REQUESTS_PER_MINUTE', z.coerce.number().positive()),
    burst: optional(env, 'CREATEOS_BURST', positiveInt),
    autoPauseAfterSeconds: optional(env, 'CREATEOS_AUTO_PAUSE_AFTER_S', z.coerce.number().int().min(60).max(86_400)),
  };
  return {
    ...Object.fromEntries(Object.entries(numbers).filter(([, v]) => v !== undefined)),
    ...(env.CREATEOS_SHAPE ? { shape: env.CREATEOS_SHAPE } : {}),
    ...(env.CREATEOS_ROOTFS ? { rootfs: env.CREATEOS_ROOTFS } : {}),
    ...(env.CREATEOS_REGION ? { region: env.CREATEOS_REGION } : {}),
  };
}

/** Pacing shared through the worker's Redis when a worker builds the providers; per process otherwise. */
const limitersOf = (services?: ProviderServices) => services?.rateLimiters ?? localRateLimiters;

/** The built-in providers' names: an instance saved at run time may not take one (a worker would pick the configured one). */
export const BUILT_IN_PROVIDER_NAMES = ['simulated', 'daytona', 'createos'] as const;

/** Built-in providers, configured from the environment (credentials by variable name). */
const BUILT_IN: Record<string, ProviderFactory> = {
  simulated: (env) => createSimulatedProvider(env),
  daytona: (env, services) =>
    createDaytonaProvider(
      {
        name: 'daytona',
        apiUrl: env.DAYTONA_API_URL ?? 'https://app.daytona.io/api',
        apiKey: required(env, 'DAYTONA_API_KEY', 'the daytona provider'),
        ...daytonaFromEnv(env),
      },
      limitersOf(services),
    ),
  createos: (env, services) =>
    createCreateosProvider(
      {
        name: 'createos',
        apiUrl: env.CREATEOS_API_URL ?? 'https://api.sb.createos.sh',
        apiKey: required(env, 'CREATEOS_API_KEY', 'the createos provider'),
        ...createosFromEnv(env),
      },
      limitersOf(services),
    ),
};

/**
 * LEASE_OPS_PROVIDERS_FILE: named provider instances, e.g. two Daytona organisations.
 * Keys are never written in the file, only the names of the variables that hold them.
 */
const remote = {
  name: z.string().regex(/^[a-z0-9][a-z0-9._-]*$/),
  apiUrl: z.url(),
  apiKeyEnv: z.string().regex(/^[A-Z_][A-Z0-9_]*$/, 'apiKeyEnv names an environment variable'),
  timeoutMs: z.number().int().positive().optional(),
};
const ProvidersFileSchema = z.array(
  z.discriminatedUnion('type', [
    z.strictObject({
      type: z.literal('daytona'),
      ...remote,
      organizationId: z.string().optional(),
      createTimeoutMs: z.number().int().positive().optional(),
      rateLimits: DaytonaRateLimitsSchema.optional(),
    }),
    z.strictObject({
      type: z.literal('createos'),
      ...remote,
      shape: z.string().optional(),
      region: z.string().optional(),
      rootfs: z.string().optional(),
      requestsPerMinute: z.number().positive().optional(),
      burst: z.number().int().positive().optional(),
      autoPauseAfterSeconds: z.number().int().min(60).max(86_400).optional(),
    }),
    z.strictObject({ type: z.literal('module'), path: z.string().min(1) }),
  ]),
);

/**
 * Builds the registry from a comma-separated list: built-in names (`simulated`) and paths
 * to modules whose default export (or `createProvider` export) is a ProviderFactory.
 */
export async function loadProviders(spec: string, env: NodeJS.ProcessEnv = process.env, services?: ProviderServices): Promise<ProviderRegistry> {
  const registry = new ProviderRegistry();
  if (env.LEASE_OPS_PROVIDERS_FILE) {
    const entries = await readProvidersFile(env.LEASE_OPS_PROVIDERS_FILE);
    for (const entry of entries) {
      if (entry.type === 'module') {
        registry.add(await loadProviderModule(entry.path, env, services));
        continue;
      }
      const apiKey = required(env, entry.apiKeyEnv, `provider ${entry.name}`);
      const { type, apiKeyEnv: _env, ...rest } = entry;
      registry.add(type === 'createos' ? createCreateosProvider({ ...rest, apiKey }, limitersOf(services)) : createDaytonaProvider({ ...rest, apiKey }, limitersOf(services)));
    }
  }
  // A providers file replaces the default list (simulated); LEASE_OPS_PROVIDERS set as well adds to it.
  const listed = env.LEASE_OPS_PROVIDERS_FILE && env.LEASE_OPS_PROVIDERS === undefined ? '' : spec;
  for (const entry of listed.split(',').map((s) => s.trim()).filter(Boolean)) {
    const builtIn = BUILT_IN[entry];
    if (builtIn) {
      registry.add(await builtIn(env, services));
      continue;
    }
    registry.add(await loadProviderModule(entry, env, services));
  }
  return registry;
}

/** The providers file, read and checked; what is wrong with it is a ConfigError naming the file. */
async function readProvidersFile(path: string): Promise<z.infer<typeof ProvidersFileSchema>> {
  const { readFile } = await import('node:fs/promises');
  let text: string;
  try {
    text = await readFile(path, 'utf8');
  } catch (err) {
    throw new ConfigError(`LEASE_OPS_PROVIDERS_FILE=${path}: cannot read it (${(err as NodeJS.ErrnoException).code ?? 'error'})`);
  }
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch {
    throw new ConfigError(`LEASE_OPS_PROVIDERS_FILE=${path}: not JSON`);
  }
  const parsed = ProvidersFileSchema.safeParse(json);
  if (!parsed.success) throw new ConfigError(`LEASE_OPS_PROVIDERS_FILE=${path}: ${parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`);
  return parsed.data;
}

export async function loadProviderModule(path: string, env: NodeJS.ProcessEnv, services?: ProviderServices): Promise<LeaseProvider> {
  const url = pathToFileURL(isAbsolute(path) ? path : resolve(process.cwd(), path)).href;
  let mod: Record<string, unknown>;
  try {
    mod = (await import(url)) as Record<string, unknown>;
  } catch (err) {
    throw new ConfigError(`cannot load provider module ${path}: ${(err as Error).message}`, { cause: err });
  }
  const factory = (mod.default ?? mod.createProvider) as ProviderFactory | undefined;
  if (typeof factory !== 'function') {
    throw new ConfigError(`provider module ${path} must export a factory as default or as createProvider`);
  }
  const provider = await factory(env, services ?? { rateLimiters: localRateLimiters });
  for (const method of ['acquire', 'resume', 'release', 'stop', 'forceStop', 'destroy', 'status'] as const) {
    if (typeof provider?.[method] !== 'function') throw new ConfigError(`provider from ${path} lacks ${method}()`);
  }
  if (typeof provider.name !== 'string' || !provider.name) throw new ConfigError(`provider from ${path} has no name`);
  return provider;
}
