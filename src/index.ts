// The package's public surface for control planes written in TypeScript.
export { LeaseOpsClient, type EnqueueOptions, type OperationResult } from './client.ts';
export {
  ActivityNotFoundError,
  ClientClosedError,
  ExecError,
  IdempotencyKeyReusedError,
  InvalidRequestError,
  LeaseClosingError,
  LeaseHasSandboxError,
  LeaseOpsError,
  OperationNotFoundError,
  PausesFullError,
  QueueFullError,
  RedisUnavailableError,
  WaitTimeoutError,
} from './errors.ts';
export { CredentialsRefusedError } from './providers/instances/manager.ts';
export { ProviderInstanceError } from './providers/instances/store.ts';
export type { InstanceView } from './providers/instances/schemas.ts';
export type { ExecRequestInput } from './queues/exec-jobs.ts';
export type { AttentionItem, LeaseTimeline, LeaseView, OperationState, OperationView, QueueOverview } from './queues/inspect.ts';
export type { HistoryEvent, HistoryEventKind } from './queues/lease-history.ts';
export { OperatorActionRefusedError, type AcknowledgeResult, type CancelResult, type PauseResult, type RerunResult } from './queues/operator-actions.ts';
export type { Enqueued } from './queues/operations-queue.ts';
export { loadConfig, ConfigError, type Config } from './config.ts';
export { laneIdOf, LeaseIdentitySchema, type LeaseIdentity } from './lease.ts';
export { OPERATIONS, OperationJobDataSchema, type OperationName, type OperationParams } from './operations.ts';
export { PermanentError, ProviderError, SettlingError, TransientError } from './providers/errors.ts';
export type * from './providers/types.ts';
export { LeaseWorker } from './queues/worker.ts';
export { OperationsQueue } from './queues/operations-queue.ts';
