import { definePlugin, type PaperclipPlugin } from '@paperclipai/plugin-sdk';
import type { LeaseOpsClient } from '../client.ts';
import { clientBackend, httpBackend, LeaseOpsHookError, type LeaseOpsBackend } from './backend.ts';
import type { LeaseOpsDriverConfig } from './config.ts';
import { leaseOpsDriverHooks } from './driver.ts';

export interface LeaseOpsPluginOptions {
  /** An in-process lease-ops: the hooks use its typed client (no URL, no token). */
  client?: LeaseOpsClient;
  /** For the HTTP API (tests, proxies): the fetch to use. */
  fetch?: typeof fetch;
}

/**
 * The paperclip plugin: its environment-driver hooks (validateConfig, probe, acquire,
 * resume, release, destroy, execute), each served by lease-ops. With `client`, by an in-process
 * lease-ops; otherwise by the HTTP API at each environment's `leaseOpsUrl`, with its `token`.
 */
export function createLeaseOpsPlugin(options: LeaseOpsPluginOptions = {}): PaperclipPlugin {
  const inProcess = options.client ? clientBackend(options.client) : null;
  const backendFor = (config: LeaseOpsDriverConfig): LeaseOpsBackend => {
    if (inProcess) return inProcess;
    if (!config.leaseOpsUrl) throw new LeaseOpsHookError('invalid_config', 'leaseOpsUrl: the lease-ops API this environment uses is required');
    return httpBackend(config.leaseOpsUrl, config.token, options.fetch);
  };
  const hooks = leaseOpsDriverHooks(backendFor);
  return definePlugin({
    async setup() {
      // Nothing to register: the environment driver is the whole plugin.
    },
    onEnvironmentValidateConfig: hooks.onValidateConfig,
    onEnvironmentProbe: hooks.onProbe,
    onEnvironmentAcquireLease: hooks.onAcquireLease,
    onEnvironmentResumeLease: hooks.onResumeLease,
    // paperclip's newer SDKs take the receipt these return; older ones ignore it.
    onEnvironmentReleaseLease: hooks.onReleaseLease as (params: Parameters<typeof hooks.onReleaseLease>[0]) => Promise<void>,
    onEnvironmentDestroyLease: hooks.onDestroyLease as (params: Parameters<typeof hooks.onDestroyLease>[0]) => Promise<void>,
    onEnvironmentExecute: hooks.onExecute,
  });
}
