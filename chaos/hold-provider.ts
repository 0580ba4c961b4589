// A provider for the chaos campaign's scale phase (LEASE_OPS_PROVIDERS names this file): its
// operations wait as long as the file HOLD_FILE exists, each answering "still settling, try
// again in 10 minutes", so that many lanes stay open and quiet, their heads backing off, as
// the sweep must look past. Once the file is gone they complete.
import { existsSync } from 'node:fs';
import { SettlingError } from '../src/providers/errors.ts';
import type { LeaseProvider } from '../src/providers/types.ts';

export default function createProvider(env: NodeJS.ProcessEnv): LeaseProvider {
  const holdFile = env.HOLD_FILE;
  if (!holdFile) throw new Error('HOLD_FILE is not set');
  const held = () => existsSync(holdFile);
  const hold = (id: string) => new SettlingError('held', `hold: ${id} is held by the campaign`, { retryAfterMs: 600_000 });
  return {
    name: 'hold',
    capabilities: { stop: true, pause: false, forceStop: false },
    async acquire(ctx) {
      if (held()) throw hold(ctx.lease.leaseId);
      return { providerLeaseId: ctx.lease.leaseId, metadata: {}, expiresAt: null };
    },
    async resume(ctx, p) {
      if (held()) throw hold(p.providerLeaseId);
      return { providerLeaseId: p.providerLeaseId, metadata: {}, expiresAt: null };
    },
    async release() {
      return null;
    },
    async stop(_ctx, p) {
      return { providerLeaseId: p.providerLeaseId, state: 'stopped' };
    },
    async forceStop(_ctx, p) {
      return { providerLeaseId: p.providerLeaseId, state: 'stopped' };
    },
    async destroy(_ctx, p) {
      return { providerLeaseId: p.providerLeaseId, state: 'destroyed' };
    },
    async status() {
      return { kind: 'running' };
    },
  };
}
