import { DaytonaFake } from '../../fakes/daytona-fake.ts';
import { createDaytonaProvider } from '../daytona/index.ts';
import type { LeaseProvider } from '../types.ts';

const SIMULATED_KEY = 'simulated-cloud-key';
/** The simulated cloud's one organization: its notification gateway pushes state changes to it. */
const SIMULATED_ORG = 'simulated-organization';

/**
 * The simulated cloud: a Daytona fake whose transitions take a fraction of a second. With
 * LEASE_OPS_SIMULATED_EXEC=true its sandboxes run commands (exec) as real processes on the
 * machine it runs on: for a laptop or a test, never for a shared host.
 */
const simulatedCloud = (env: NodeJS.ProcessEnv = process.env) =>
  new DaytonaFake({
    apiKey: SIMULATED_KEY,
    organizationId: SIMULATED_ORG,
    // Its gateway pushes state changes, as Daytona's does: an operation goes on when a transition ends.
    notifications: true,
    timings: { create: 50, start: 200, stop: 200, forceStop: 0, destroy: 50 },
    execOnThisMachine: env.LEASE_OPS_SIMULATED_EXEC === 'true',
  });

/**
 * The embedded default: the Daytona provider (the real client code path) against a local
 * fake of Daytona's API, so lease lifecycles run without any account. One process runs its
 * own fake; several worker processes share one when LEASE_OPS_SIMULATED_URL points at a
 * `lease-ops simulated-cloud`.
 */
export async function createSimulatedProvider(env: NodeJS.ProcessEnv): Promise<LeaseProvider> {
  const shared = env.LEASE_OPS_SIMULATED_URL;
  let fake: DaytonaFake | null = null;
  let apiUrl = shared;
  if (!apiUrl) {
    fake = simulatedCloud(env);
    apiUrl = await fake.listen();
  }
  // The simulated cloud has no rate limits to pace under.
  const unpaced = { 'sandbox-create': null, 'sandbox-lifecycle': null, authenticated: null };
  const provider = createDaytonaProvider({ name: 'simulated', apiUrl, apiKey: SIMULATED_KEY, organizationId: SIMULATED_ORG, timeoutMs: 10_000, rateLimits: unpaced });
  // Commands only when asked for (a shared cloud is started with the same setting).
  const exec = env.LEASE_OPS_SIMULATED_EXEC === 'true';
  const close = async () => {
    await provider.close?.();
    await fake?.close();
  };
  return { ...provider, capabilities: { ...provider.capabilities, exec }, ...(exec ? {} : { exec: undefined }), close };
}

/** Runs the simulated cloud on its own, for several worker processes to share. */
export async function runSimulatedCloud(port: number, host?: string): Promise<DaytonaFake> {
  const fake = simulatedCloud();
  await fake.listen(port, host);
  return fake;
}
