import { isAbsolute, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { z } from 'zod';
import { createCreateosProvider } from './createos/index.ts';
import { createDaytonaProvider } from './daytona/index.ts';
import { createSimulatedProvider } from './simulated/index.ts';
import type { LeaseProvider, ProviderFactory } from './types.ts';

/** The providers a worker serves, by the key jobs name in `lease.provider`. */
export class ProviderRegistry {
  private readonly byName = new Map<string, LeaseProvider>();

  constructor(providers: LeaseProvider[] = []) {
    for (const p of providers) this.add(p);
  }

  add(provider: LeaseProvider): void {
    if (this.byName.has(provider.name)) throw new Error(`two providers are named "${provider.name}"`);
    this.byName.set(provider.name, provider);
  }

  get(name: string): LeaseProvider | undefined {
    return this.byName.get(name);
  }

  names(): string[] {
    return [...this.byName.keys()];
  }

  async close(): Promise<void> {
    await Promise.all([...this.byName.values()].map((p) => p.close?.()));
  }
}

/** A required environment variable, with an error that names it (and never its value). */
function required(env: NodeJS.ProcessEnv, variable: string, forWhat: string): string {
  const value = env[variable];
  if (!value) throw new Error(`${forWhat} needs ${variable} to be set`);
  return value;
}

/** Built-in providers, configured from the environment (credentials by variable name). */
const BUILT_IN: Record<string, ProviderFactory> = {
  simulated: (env) => createSimulatedProvider(env),
  daytona: (env) =>
    createDaytonaProvider({
      name: 'daytona',
      apiUrl: env.DAYTONA_API_URL ?? 'https://app.daytona.io/api',
      apiKey: required(env, 'DAYTONA_API_KEY', 'the daytona provider'),
      ...(env.DAYTONA_ORGANIZATION_ID ? { organizationId: env.DAYTONA_ORGANIZATION_ID } : {}),
    }),
  createos: (env) =>
    createCreateosProvider({
      name: 'createos',
      apiUrl: required(env, 'CREATEOS_API_URL', 'the createos provider'),
      apiKey: required(env, 'CREATEOS_API_KEY', 'the createos provider'),
      ...(env.CREATEOS_SHAPE ? { shape: env.CREATEOS_SHAPE } : {}),
    }),
};

/**
 * LEASE_OPS_PROVIDERS_FILE: named provider instances, e.g. two Daytona organisations.
 * Keys are never written in the file, only the names of the variables that hold them.
 */
const remote = {
  name: z.string().regex(/^[a-z0-9][a-z0-9._-]*$/),
  apiUrl: z.url(),
  apiKeyEnv: z.string().regex(/^[A-Z_][A-Z0-9_]*$/, 'apiKeyEnv names an environment variable'),
};
const ProvidersFileSchema = z.array(
  z.discriminatedUnion('type', [
    z.strictObject({ type: z.literal('daytona'), ...remote, organizationId: z.string().optional() }),
    z.strictObject({
      type: z.literal('createos'),
      ...remote,
      shape: z.string().optional(),
      region: z.string().optional(),
      rootfs: z.string().optional(),
    }),
    z.strictObject({ type: z.literal('module'), path: z.string().min(1) }),
  ]),
);

/**
 * Builds the registry from a comma-separated list: built-in names (`simulated`) and paths
 * to modules whose default export (or `createProvider` export) is a ProviderFactory.
 */
export async function loadProviders(spec: string, env: NodeJS.ProcessEnv = process.env): Promise<ProviderRegistry> {
  const registry = new ProviderRegistry();
  if (env.LEASE_OPS_PROVIDERS_FILE) {
    const { readFile } = await import('node:fs/promises');
    const entries = ProvidersFileSchema.parse(JSON.parse(await readFile(env.LEASE_OPS_PROVIDERS_FILE, 'utf8')));
    for (const entry of entries) {
      if (entry.type === 'module') {
        registry.add(await loadProviderModule(entry.path, env));
        continue;
      }
      const apiKey = required(env, entry.apiKeyEnv, `provider ${entry.name}`);
      if (entry.type === 'createos') {
        const { type: _type, apiKeyEnv: _env, ...rest } = entry;
        registry.add(createCreateosProvider({ ...rest, apiKey }));
        continue;
      }
      registry.add(
        createDaytonaProvider({
          name: entry.name,
          apiUrl: entry.apiUrl,
          apiKey,
          ...(entry.organizationId ? { organizationId: entry.organizationId } : {}),
        }),
      );
    }
  }
  for (const entry of spec.split(',').map((s) => s.trim()).filter(Boolean)) {
    const builtIn = BUILT_IN[entry];
    if (builtIn) {
      registry.add(await builtIn(env));
      continue;
    }
    registry.add(await loadProviderModule(entry, env));
  }
  return registry;
}

export async function loadProviderModule(path: string, env: NodeJS.ProcessEnv): Promise<LeaseProvider> {
  const url = pathToFileURL(isAbsolute(path) ? path : resolve(process.cwd(), path)).href;
  let mod: Record<string, unknown>;
  try {
    mod = (await import(url)) as Record<string, unknown>;
  } catch (err) {
    throw new Error(`cannot load provider module ${path}: ${(err as Error).message}`, { cause: err });
  }
  const factory = (mod.default ?? mod.createProvider) as ProviderFactory | undefined;
  if (typeof factory !== 'function') {
    throw new Error(`provider module ${path} must export a factory as default or as createProvider`);
  }
  const provider = await factory(env);
  for (const method of ['acquire', 'resume', 'release', 'stop', 'forceStop', 'destroy', 'status'] as const) {
    if (typeof provider?.[method] !== 'function') throw new Error(`provider from ${path} lacks ${method}()`);
  }
  if (typeof provider.name !== 'string' || !provider.name) throw new Error(`provider from ${path} has no name`);
  return provider;
}
