import type { Config } from '../../config.ts';
import type { RedisClient } from '../../queues/redis.ts';
import type { ProviderServices } from '../types.ts';
import { checkMasterKeys, InstanceProviders } from './resolver.ts';
import { parseAllowedApiUrls } from './schemas.ts';
import { loadMasterKeys } from './sealing.ts';
import { ProviderInstanceStore } from './store.ts';

export { InstanceProviders, checkMasterKeys, type Resolution, type Unresolved } from './resolver.ts';
export { ProviderInstanceError, ProviderInstanceStore } from './store.ts';
export { type InstanceCreate, type InstancePatch, type InstanceView, INSTANCE_TYPES } from './schemas.ts';
export { loadMasterKeys, MasterKeys } from './sealing.ts';

/**
 * The provider registry as a process of this deployment sees it: the store under the
 * deployment's prefix, with the master keys from the environment, checked against what the
 * registry holds (a wrong key is a ConfigError: exit 2, nothing decrypted).
 */
export async function openInstanceStore(redis: RedisClient, config: Pick<Config, 'LEASE_OPS_PREFIX' | 'LEASE_OPS_INSTANCE_API_URLS'>, env: NodeJS.ProcessEnv = process.env): Promise<ProviderInstanceStore> {
  const store = new ProviderInstanceStore(redis, config.LEASE_OPS_PREFIX, { keys: loadMasterKeys(env), allowedApiUrls: parseAllowedApiUrls(config.LEASE_OPS_INSTANCE_API_URLS) });
  await checkMasterKeys(store);
  return store;
}

/** A worker's instance providers, built with its shared pacing. */
export function instanceProviders(store: ProviderInstanceStore, config: Pick<Config, 'LEASE_OPS_INSTANCE_API_URLS' | 'LEASE_OPS_INSTANCE_CACHE'>, services: ProviderServices): InstanceProviders {
  return new InstanceProviders(store, services, parseAllowedApiUrls(config.LEASE_OPS_INSTANCE_API_URLS), config.LEASE_OPS_INSTANCE_CACHE);
}
