// lease-ops/paperclip: lease-ops as a paperclip environment-driver plugin (needs
// @paperclipai/plugin-sdk, an optional peer dependency of lease-ops).
export { clientBackend, httpBackend, LeaseOpsHookError, type LeaseOpsBackend } from './backend.ts';
export { LeaseOpsDriverConfigSchema, type LeaseOpsDriverConfig } from './config.ts';
export { leaseOpsDriverHooks, type LeaseOpsDriverHooks } from './driver.ts';
export { DRIVER_KEY, manifest } from './manifest.ts';
export { createLeaseOpsPlugin, type LeaseOpsPluginOptions } from './plugin.ts';
