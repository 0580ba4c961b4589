import { randomUUID } from 'node:crypto';
import { PermanentError, SettlingError } from '../errors.ts';
import type {
  ExpiredLease,
  Lease,
  LeaseProvider,
  OperationContext,
  ReleaseReceipt,
  SandboxState,
  TerminationReceipt,
} from '../types.ts';
import type { OperationParams } from '../../operations.ts';

type SimState = 'started' | 'stopping' | 'stopped' | 'starting';

interface SimSandbox {
  id: string;
  state: SimState;
  /** When a transition (starting/stopping) completes, epoch ms. */
  settlesAt: number;
  companyId: string;
  environmentId: string;
}

export interface SimulatedOptions {
  /** How long start and stop transitions take, in ms. */
  transitionMs?: number;
}

/**
 * An in-memory cloud: sandboxes with a small state machine and transitions that take
 * time, so the lane's settling retries are exercised without any account or network.
 */
export function createSimulatedProvider(opts: SimulatedOptions = {}): LeaseProvider {
  const transitionMs = opts.transitionMs ?? 200;
  const sandboxes = new Map<string, SimSandbox>();

  const settle = (sb: SimSandbox) => {
    if (Date.now() < sb.settlesAt) return;
    if (sb.state === 'starting') sb.state = 'started';
    if (sb.state === 'stopping') sb.state = 'stopped';
  };
  const find = (ctx: OperationContext, id: string): SimSandbox | undefined => {
    const sb = sandboxes.get(id);
    if (sb) settle(sb);
    if (sb && (sb.companyId !== ctx.lease.companyId || sb.environmentId !== ctx.lease.environmentId)) {
      throw new PermanentError('lease_environment_mismatch', `sandbox ${id} belongs to another environment`);
    }
    return sb;
  };
  const transitional = (sb: SimSandbox) => {
    if (sb.state === 'starting' || sb.state === 'stopping') {
      throw new SettlingError('state_change_in_progress', `sandbox ${sb.id} is ${sb.state}`);
    }
  };
  const lease = (sb: SimSandbox): Lease => ({ providerLeaseId: sb.id, metadata: { provider: 'simulated' }, expiresAt: null });
  const stopOf = (ctx: OperationContext, id: string): TerminationReceipt => {
    const sb = find(ctx, id);
    if (!sb) return { providerLeaseId: id, state: 'stopped' };
    transitional(sb);
    if (sb.state === 'started') {
      sb.state = 'stopping';
      sb.settlesAt = Date.now() + transitionMs;
      throw new SettlingError('stop_in_progress', `sandbox ${id} is stopping`);
    }
    return { providerLeaseId: id, state: 'stopped' };
  };

  return {
    name: 'simulated',
    capabilities: { stop: true, pause: false, forceStop: true },
    async acquire(ctx, _params: OperationParams['acquire']): Promise<Lease> {
      const sb: SimSandbox = {
        id: `sim-${randomUUID()}`,
        state: 'started',
        settlesAt: 0,
        companyId: ctx.lease.companyId,
        environmentId: ctx.lease.environmentId,
      };
      sandboxes.set(sb.id, sb);
      return lease(sb);
    },
    async resume(ctx, params): Promise<Lease | ExpiredLease> {
      const sb = find(ctx, params.providerLeaseId);
      if (!sb) return { providerLeaseId: null, metadata: { expired: true } };
      transitional(sb);
      if (sb.state === 'stopped') {
        sb.state = 'starting';
        sb.settlesAt = Date.now() + transitionMs;
        throw new SettlingError('start_in_progress', `sandbox ${sb.id} is starting`);
      }
      return lease(sb);
    },
    async release(ctx, params): Promise<ReleaseReceipt> {
      const id = params.providerLeaseId;
      if (params.resourceDisposition === 'keep_running') return { providerLeaseId: id, disposition: 'keep_running', state: 'running' };
      if (params.resourceDisposition === 'destroy') {
        find(ctx, id);
        sandboxes.delete(id);
        return { providerLeaseId: id, disposition: 'destroy', state: 'destroyed' };
      }
      stopOf(ctx, id);
      return { providerLeaseId: id, disposition: 'stop_and_retain', state: 'stopped' };
    },
    async stop(ctx, params) {
      return stopOf(ctx, params.providerLeaseId);
    },
    async forceStop(ctx, params) {
      const sb = find(ctx, params.providerLeaseId);
      if (sb) sb.state = 'stopped';
      return { providerLeaseId: params.providerLeaseId, state: 'stopped' };
    },
    async destroy(ctx, params) {
      find(ctx, params.providerLeaseId);
      sandboxes.delete(params.providerLeaseId);
      return { providerLeaseId: params.providerLeaseId, state: 'destroyed' };
    },
    async status(ctx, params): Promise<SandboxState> {
      const sb = find(ctx, params.providerLeaseId);
      if (!sb) return { kind: 'gone' };
      if (sb.state === 'started') return { kind: 'running' };
      if (sb.state === 'stopped') return { kind: 'stopped', providerState: 'stopped' };
      return { kind: 'transitioning', providerState: sb.state };
    },
  };
}
