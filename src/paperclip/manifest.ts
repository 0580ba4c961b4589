import type { PaperclipPluginManifestV1 } from '@paperclipai/plugin-sdk';
import { VERSION } from '../version.ts';
import { driverConfigJsonSchema } from './config.ts';

/** The driver key paperclip environments name (`driver: "sandbox"`, provider `lease-ops`). */
export const DRIVER_KEY = 'lease-ops';

/** The plugin's manifest: one sandbox-provider environment driver, served by lease-ops. */
export const manifest: PaperclipPluginManifestV1 = {
  id: 'lease-ops.sandbox-provider',
  apiVersion: 1,
  version: VERSION,
  displayName: 'lease-ops',
  description: 'Sandbox leases run by lease-ops: each lease one lane from acquire to destroy, across replicas and crashes, on Daytona, CreateOS or any lease-ops provider.',
  author: 'lease-ops',
  categories: ['automation'],
  capabilities: ['environment.drivers.register'],
  entrypoints: { worker: './dist/paperclip/worker.js' },
  environmentDrivers: [
    {
      driverKey: DRIVER_KEY,
      kind: 'sandbox_provider',
      displayName: 'lease-ops',
      description: 'Acquire, resume, release and destroy through a lease-ops deployment (its HTTP API, or in-process).',
      supportsReusableLeases: true,
      configSchema: driverConfigJsonSchema(),
    },
  ],
};
export default manifest;
