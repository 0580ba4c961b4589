// A complete, small lease-ops provider: copy it, replace the Map with your cloud's API.
// Run it with: NODE_OPTIONS='--import tsx' LEASE_OPS_PROVIDERS=./examples/memory-provider.ts node bin/lease-ops.js worker
// Jobs reach it as lease.provider = "memory".
import { randomUUID } from 'node:crypto';
import { PermanentError, SettlingError, type LeaseProvider, type OperationContext, type ProviderFactory } from 'lease-ops';

type State = 'started' | 'starting' | 'stopping' | 'stopped';
interface Sandbox {
  id: string;
  state: State;
  settlesAt: number; // when a transition (starting, stopping) ends
  companyId: string;
  environmentId: string;
}

const createProvider: ProviderFactory = (env) => {
  const transitionMs = Number(env.MEMORY_PROVIDER_TRANSITION_MS ?? 100);
  const sandboxes = new Map<string, Sandbox>();

  // Always read fresh: a transition may have ended since the last call. Report what you
  // saw (ctx.observe): that is how lease-ops finds sandboxes stuck in `stopping`. Another
  // company's or environment's sandbox is refused (lease_environment_mismatch), with nothing
  // of it recorded or returned: a stop of it must never end with a receipt while it runs on.
  const read = (ctx: OperationContext, id: string): Sandbox | undefined => {
    const sb = sandboxes.get(id);
    if (sb && (sb.companyId !== ctx.lease.companyId || sb.environmentId !== ctx.lease.environmentId)) {
      throw new PermanentError('lease_environment_mismatch', `sandbox ${id} is not this environment's`);
    }
    if (sb && Date.now() >= sb.settlesAt) {
      if (sb.state === 'starting') sb.state = 'started';
      if (sb.state === 'stopping') sb.state = 'stopped';
    }
    if (!sb) ctx.observe(id, { kind: 'gone' });
    else if (sb.state === 'started') ctx.observe(id, { kind: 'running' });
    else if (sb.state === 'stopped') ctx.observe(id, { kind: 'stopped', providerState: 'stopped' });
    else ctx.observe(id, { kind: 'transitioning', providerState: sb.state });
    return sb;
  };
  // Never wait for a transition here: raise SettlingError and let lease-ops retry with backoff.
  const begin = (sb: Sandbox, state: 'starting' | 'stopping') => {
    sb.state = state;
    sb.settlesAt = Date.now() + transitionMs;
    throw new SettlingError(`sandbox_${state}`, `sandbox ${sb.id} is ${state}`);
  };
  const busy = (sb: Sandbox) => {
    if (sb.state === 'starting' || sb.state === 'stopping') {
      throw new SettlingError(`sandbox_${sb.state}`, `sandbox ${sb.id} is ${sb.state}`);
    }
  };
  const stop = (ctx: OperationContext, id: string) => {
    const sb = read(ctx, id);
    if (!sb) return { providerLeaseId: id, state: 'destroyed' as const };
    busy(sb);
    if (sb.state === 'started') begin(sb, 'stopping');
    return { providerLeaseId: id, state: 'stopped' as const }; // confirmed by the fresh read
  };

  // Before anything that touches the cloud: refuse if this attempt is stale (its lock was
  // lost, or a newer attempt of the lease started). A real provider calls it before every
  // request and passes ctx.signal to its HTTP client.
  const provider: LeaseProvider = {
    name: 'memory',
    capabilities: { stop: true, pause: false, forceStop: true },
    async acquire(ctx) {
      await ctx.fence();
      const sb: Sandbox = { id: `mem-${randomUUID()}`, state: 'started', settlesAt: 0, companyId: ctx.lease.companyId, environmentId: ctx.lease.environmentId };
      sandboxes.set(sb.id, sb);
      return { providerLeaseId: sb.id, metadata: {}, expiresAt: null };
    },
    async resume(ctx, { providerLeaseId }) {
      await ctx.fence();
      const sb = sandboxes.get(providerLeaseId);
      if (!sb || sb.companyId !== ctx.lease.companyId || sb.environmentId !== ctx.lease.environmentId) {
        return { providerLeaseId: null, metadata: { expired: true } }; // gone or not ours: expired
      }
      read(ctx, providerLeaseId);
      busy(sb);
      if (sb.state === 'stopped') begin(sb, 'starting');
      return { providerLeaseId, metadata: {}, expiresAt: null };
    },
    // A receipt once execution ended (stopped, destroyed); null when nothing ended (keep_running).
    async release(ctx, { providerLeaseId, resourceDisposition }) {
      await ctx.fence();
      if (resourceDisposition === 'keep_running') {
        const sb = read(ctx, providerLeaseId); // left as it is; say truthfully what that is
        if (!sb) return { providerLeaseId, state: 'destroyed' };
        busy(sb);
        return sb.state === 'started' ? null : { providerLeaseId, state: 'stopped' };
      }
      if (resourceDisposition === 'destroy') {
        if (read(ctx, providerLeaseId)) sandboxes.delete(providerLeaseId);
        return { providerLeaseId, state: 'destroyed' };
      }
      // No archive here: lease-ops refuses it (archive_unsupported) for a provider without the capability.
      return stop(ctx, providerLeaseId);
    },
    async stop(ctx, { providerLeaseId }) {
      await ctx.fence();
      return stop(ctx, providerLeaseId);
    },
    async forceStop(ctx, { providerLeaseId }) {
      await ctx.fence();
      const sb = read(ctx, providerLeaseId);
      if (sb) sb.state = 'stopped';
      return { providerLeaseId, state: sb ? 'stopped' : 'destroyed' };
    },
    async destroy(ctx, { providerLeaseId }) {
      await ctx.fence();
      // read() refuses another tenant's sandbox; deleting what is gone is success.
      if (read(ctx, providerLeaseId)) sandboxes.delete(providerLeaseId);
      return { providerLeaseId, state: 'destroyed' };
    },
    async status(ctx, { providerLeaseId }) {
      await ctx.fence();
      const sb = read(ctx, providerLeaseId);
      if (!sb) return { kind: 'gone' };
      if (sb.state === 'started') return { kind: 'running' };
      if (sb.state === 'stopped') return { kind: 'stopped', providerState: 'stopped' };
      return { kind: 'transitioning', providerState: sb.state };
    },
  };
  return provider;
};

export default createProvider;
