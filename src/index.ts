// The package's public surface for control planes written in TypeScript.
export { LeaseOpsClient, WaitTimeoutError, type OperationResult } from './client.ts';
export { loadConfig, ConfigError, type Config } from './config.ts';
export { laneIdOf, LeaseIdentitySchema, type LeaseIdentity } from './lease.ts';
export { OPERATIONS, OperationJobDataSchema, type OperationName, type OperationParams } from './operations.ts';
export { PermanentError, ProviderError, SettlingError, TransientError } from './providers/errors.ts';
export type * from './providers/types.ts';
export { LeaseWorker } from './queues/worker.ts';
export { OperationsQueue } from './queues/operations-queue.ts';
