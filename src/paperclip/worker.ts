// The plugin's worker entrypoint, as paperclip's host runs it (manifest.entrypoints.worker):
// the HTTP API of the lease-ops each environment's config names.
import { runWorker } from '@paperclipai/plugin-sdk';
import { createLeaseOpsPlugin } from './plugin.ts';

const plugin = createLeaseOpsPlugin();
export default plugin;
runWorker(plugin, import.meta.url);
