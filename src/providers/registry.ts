import { isAbsolute, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
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

const BUILT_IN: Record<string, ProviderFactory> = {
  simulated: () => createSimulatedProvider(),
};

/**
 * Builds the registry from a comma-separated list: built-in names (`simulated`) and paths
 * to modules whose default export (or `createProvider` export) is a ProviderFactory.
 */
export async function loadProviders(spec: string, env: NodeJS.ProcessEnv = process.env): Promise<ProviderRegistry> {
  const registry = new ProviderRegistry();
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
