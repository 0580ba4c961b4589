import { ConfigError } from '../../config.ts';
import { createCreateosProvider } from '../createos/index.ts';
import { createDaytonaProvider } from '../daytona/index.ts';
import type { LeaseProvider, ProviderCapabilities, ProviderServices } from '../types.ts';
import type { RateLimiterFactory } from '../pacing.ts';
import { instanceAad, type MasterKeys, UnsealError, unseal } from './sealing.ts';
import { apiUrlAllowed, type InstanceType, PUBLIC_API_URLS } from './schemas.ts';
import type { InstanceRecord, ProviderInstanceStore } from './store.ts';

/** Why a lease's provider could not be had; `forGood` failures end the operation at once. */
export interface Unresolved {
  code: 'unknown_provider' | 'provider_deleted' | 'provider_credentials_unreadable' | 'secrets_key_missing' | 'provider_address_not_allowed';
  message: string;
  forGood: boolean;
}

export type Resolution = { provider: LeaseProvider } | Unresolved;

/** How many built instance providers a worker keeps (least recently used go first). */
export const DEFAULT_INSTANCE_CACHE = 1_000;

/**
 * A worker's view of the provider registry: it builds an instance's provider from its record
 * (credentials opened with the master key) and keeps it while the instance's revision stays
 * the same. Each attempt reads the revision (one HGET), so an update or a deletion applies to
 * the next attempt of every operation, on every replica, without a restart.
 */
export class InstanceProviders {
  private readonly built = new Map<string, { rev: number; provider: LeaseProvider; environmentIds: string[] | null }>();

  constructor(
    readonly store: ProviderInstanceStore,
    private readonly services: ProviderServices,
    private readonly allowedApiUrls: readonly string[],
    private readonly maxBuilt = DEFAULT_INSTANCE_CACHE,
  ) {}

  /**
   * The provider of a company's instance, for a lease in `environmentId`. `pinned`: the
   * operation was accepted for this instance, so one that is gone is deleted for it, tombstone
   * or not (a save taken back, Redis' data lost).
   */
  async resolve(companyId: string, environmentId: string, name: string, opts: { pinned?: boolean } = {}): Promise<Resolution> {
    const cacheKey = `${companyId}\0${name}`;
    const deleted = { code: 'provider_deleted', message: `the provider instance "${name}" of company ${companyId} was deleted`, forGood: true } as const;
    const rev = await this.store.rev(companyId, name);
    if (rev === null) {
      this.retire(cacheKey);
      return opts.pinned || (await this.store.wasDeleted(companyId, name))
        ? deleted
        : { code: 'unknown_provider', message: `no provider named "${name}" is configured on this worker, nor saved for company ${companyId}`, forGood: false };
    }
    let entry = this.built.get(cacheKey);
    if (entry?.rev !== rev) {
      const record = await this.store.record(companyId, name);
      if (record === null) return deleted;
      const built = this.build(record);
      if ('code' in built) return built;
      this.retire(cacheKey);
      entry = { rev: (record as InstanceRecord).rev, provider: built.provider, environmentIds: (record as InstanceRecord).environmentIds };
    }
    // Least recently used first out: re-inserting moves an entry to the end.
    this.built.delete(cacheKey);
    this.built.set(cacheKey, entry);
    while (this.built.size > this.maxBuilt) this.retire(this.built.keys().next().value!);
    if (entry.environmentIds && !entry.environmentIds.includes(environmentId)) {
      return { code: 'unknown_provider', message: `the provider instance "${name}" of company ${companyId} is not for environment ${environmentId}`, forGood: true };
    }
    return { provider: entry.provider };
  }

  /**
   * A built provider leaves the cache (its instance changed or went, or it was used least
   * lately): it is closed, so what it holds open (a Daytona gateway socket) goes with it. An
   * attempt still using it finishes its calls; a wait of it for a push ends, and backs off.
   */
  private retire(cacheKey: string): void {
    const entry = this.built.get(cacheKey);
    if (!entry) return;
    this.built.delete(cacheKey);
    void Promise.resolve(entry.provider.close?.()).catch(() => undefined);
  }

  /** A draft's provider (an instance probed before it is saved). */
  async resolveDraft(id: string): Promise<Resolution> {
    const record = await this.store.draft(id);
    if (record === null) return { code: 'unknown_provider', message: 'the instance to probe is gone (its draft lapsed)', forGood: true };
    return this.build(record);
  }

  /** How many instance providers this worker holds built. */
  get size(): number {
    return this.built.size;
  }

  private build(record: InstanceRecord | 'unreadable'): Resolution {
    if (record === 'unreadable') return { code: 'provider_credentials_unreadable', message: 'the provider instance\'s record is not readable: it was altered', forGood: true };
    const keys = this.store.keys;
    const where = `the provider instance "${record.name}" of company ${record.companyId}`;
    if (!keys) return { code: 'secrets_key_missing', message: `${where} has sealed credentials and this worker holds no master key (LEASE_OPS_SECRETS_KEY)`, forGood: false };
    let credentials: Record<string, string>;
    try {
      credentials = unseal(keys, instanceAad(record.companyId, record.name, record.fingerprint), record.sealed);
    } catch (err) {
      if (!(err instanceof UnsealError)) throw err;
      return { code: 'provider_credentials_unreadable', message: `${where}: ${err.message}`, forGood: err.reason === 'tampered' };
    }
    const apiUrl = typeof record.config.apiUrl === 'string' ? record.config.apiUrl : PUBLIC_API_URLS[record.type];
    if (!apiUrlAllowed(record.type, apiUrl, this.allowedApiUrls)) {
      return { code: 'provider_address_not_allowed', message: `${where} names an address this worker may not send to (LEASE_OPS_INSTANCE_API_URLS)`, forGood: true };
    }
    const apiKey = credentials.apiKey ?? '';
    // A company's instances pace in budgets of that company's own: settings a tenant chose
    // (an organization id, a pace) can never reach another company's or the operator's budget.
    const limiters: RateLimiterFactory = (bucket, limits) => this.services.rateLimiters(`company:${encodeURIComponent(record.companyId)}:${bucket}`, limits);
    try {
      const provider =
        record.type === 'daytona'
          ? createDaytonaProvider({ ...(record.config as object), apiUrl, name: record.name, apiKey }, limiters)
          : createCreateosProvider({ ...(record.config as object), apiUrl, name: record.name, apiKey }, limiters);
      return { provider };
    } catch {
      // Settings that this version no longer takes (they were checked when saved).
      return { code: 'provider_credentials_unreadable', message: `${where} has settings this version cannot use: save it again`, forGood: true };
    }
  }
}

const capabilitiesByType = new Map<InstanceType, ProviderCapabilities>();

/** What an instance of a type can do (its provider's capabilities: the same for every instance of it). */
export function instanceCapabilities(type: InstanceType): ProviderCapabilities {
  let found = capabilitiesByType.get(type);
  if (!found) {
    const settings = { name: 'capabilities', apiUrl: PUBLIC_API_URLS[type], apiKey: 'unused' };
    found = (type === 'daytona' ? createDaytonaProvider(settings) : createCreateosProvider(settings)).capabilities;
    capabilitiesByType.set(type, found);
  }
  return found;
}

/**
 * At start: the registry's instances must open with the keys this process holds. A key id in
 * use that is neither the current nor the previous key means a wrong master key: refused at
 * once (nothing is decrypted to find out), as is a registry with instances and no key at all.
 */
export async function checkMasterKeys(store: ProviderInstanceStore): Promise<void> {
  const inUse = await store.keysInUse();
  const kids = Object.keys(inUse);
  if (kids.length === 0) return;
  const keys = store.keys;
  const count = Object.values(inUse).reduce((a, b) => a + b, 0);
  if (!keys) throw new ConfigError(`the provider registry holds ${count} instance(s) with sealed credentials: set LEASE_OPS_SECRETS_KEY (or LEASE_OPS_SECRETS_KEY_FILE) to the deployment's master key`);
  const foreign = kids.filter((kid) => !keys.holds(kid));
  if (foreign.length > 0) {
    throw new ConfigError(
      `LEASE_OPS_SECRETS_KEY does not open the provider registry: ${foreign.map((kid) => `${inUse[kid]} instance(s) wrapped by key ${kid}`).join(', ')}; this process holds ${[keys.currentKid, keys.previousKid].filter(Boolean).join(' and ')} (during a rotation set the old key as LEASE_OPS_SECRETS_KEY_PREVIOUS)`,
    );
  }
}
