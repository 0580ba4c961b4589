import type { OperationJobData } from '../operations.ts';
import type { LeaseProvider, OperationContext } from '../providers/types.ts';
import { abandonAcquire } from './abandon-acquire.ts';
import { acquire } from './acquire.ts';
import { destroy } from './destroy.ts';
import { forceStop } from './force-stop.ts';
import { release } from './release.ts';
import { resume } from './resume.ts';
import { stop } from './stop.ts';

/**
 * Runs one operation against its provider; the lane around it is the worker's business.
 * `spare`: a sandbox an abandon-acquire must not destroy (the lease's, from another acquire).
 */
export function runOperation(provider: LeaseProvider, ctx: OperationContext, data: OperationJobData, spare: string | null = null): Promise<unknown> {
  switch (data.op) {
    case 'acquire':
      return acquire(provider, ctx, data.params);
    case 'resume':
      return resume(provider, ctx, data.params);
    case 'release':
      return release(provider, ctx, data.params);
    case 'stop':
      return stop(provider, ctx, data.params);
    case 'force-stop':
      return forceStop(provider, ctx, data.params);
    case 'destroy':
      return destroy(provider, ctx, data.params);
    case 'abandon-acquire':
      return abandonAcquire(provider, ctx, data.params, spare);
  }
}
