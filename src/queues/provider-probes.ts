import { z } from 'zod';
import type { Logger } from '../logger.ts';
import type { ProviderRegistry } from '../providers/registry.ts';
import type { OperationContext, ProbeResult } from '../providers/types.ts';
import { WaitedQueue } from './queue-events.ts';
import type { RedisClient } from './redis.ts';

/** The maintenance job that probes a provider's credentials on a worker (which holds them). */
export const PROBE_JOB = 'probe';

/** A probe's answer is reused this long: validateConfig and probe hooks do not each ask the service. */
export const PROBE_REUSE_MS = 30_000;

/** How long a probe may take at the service. */
export const PROBE_DEADLINE_MS = 10_000;

export interface ProviderProbe extends ProbeResult {
  /** Epoch ms the worker asked the service. */
  at: number;
}

/** What a probe job names: a configured provider, a company's instance, or a draft being saved. */
export const ProbeTargetSchema = z.object({
  provider: z.string(),
  companyId: z.string().optional(),
  environmentId: z.string().optional(),
  draft: z.string().optional(),
  /** A saved instance's revision when it was asked about: a re-saved instance is probed anew, not answered from its old credentials' probe (helper-56). */
  rev: z.number().int().optional(),
  /** The company's saved instance of that name only, never a configured provider of the same name (as an operation's `instance`). */
  instance: z.literal(true).optional(),
});
export type ProbeTarget = z.infer<typeof ProbeTargetSchema>;

const ProbeSchema = z.object({ ok: z.boolean(), code: z.string(), message: z.string(), at: z.number() });

/**
 * Runs a probe on a worker: one paced read with the provider's own credentials, outside any
 * lane (it touches no sandbox), bounded by its own deadline.
 */
export async function runProbe(providers: ProviderRegistry, target: ProbeTarget, log: Logger, notServedHere: () => Promise<void> = async () => undefined): Promise<ProviderProbe> {
  const at = Date.now();
  const name = target.provider;
  const resolved = target.draft
    ? providers.instances
      ? await providers.instances.resolveDraft(target.draft)
      : ({ code: 'unknown_provider', message: 'this worker serves no saved provider instances', forGood: true } as const)
    : await providers.resolve({ provider: name, companyId: target.companyId ?? '', environmentId: target.environmentId ?? '' }, target.instance === true);
  if (!('provider' in resolved)) {
    // Not served by this worker (another may serve it): it may go back for another to take.
    if (!resolved.forGood) await notServedHere();
    // An unknown name stays unknown_provider; a deleted or unreadable instance says so.
    return { ok: false, code: resolved.code, message: resolved.code === 'unknown_provider' && !target.companyId ? `this worker serves no provider named "${name}"` : resolved.message, at };
  }
  const provider = resolved.provider;
  if (!provider.probe) return { ok: true, code: 'nothing_to_check', message: `${name} has no credentials to check`, at };
  let saved: Record<string, unknown> = {};
  const ctx: OperationContext = {
    lease: { provider: name, companyId: 'lease-ops', environmentId: 'probe', leaseId: 'probe' },
    jobId: `probe.${name}`,
    attempt: 1,
    attemptId: `probe.${name}:${at}`,
    signal: AbortSignal.timeout(PROBE_DEADLINE_MS),
    deadlineAt: at + PROBE_DEADLINE_MS,
    // No lane: a probe reads nothing of any sandbox, so nothing can go stale.
    fence: async () => undefined,
    fenceIsFresh: () => true,
    observe: () => undefined,
    log: log.child({ provider: name, op: 'probe' }),
    checkpoint: { read: async () => saved, write: async (values) => void (saved = { ...saved, ...values }) },
  };
  return { ...(await provider.probe(ctx)), at };
}

/**
 * Asks a worker to probe a provider (the maintenance queue of the deployment's first
 * partition; a replica that does not serve an announced provider passes it on, within the
 * probe's deadline: see pass-on.ts) and waits for the answer. One probe
 * per provider per PROBE_REUSE_MS: concurrent and repeated asks share it (its job id).
 */
export class ProviderProbes {
  private readonly waited: WaitedQueue;

  constructor(
    private readonly connection: RedisClient,
    private readonly settings: { REDIS_URL: string; LEASE_OPS_QUEUE: string; LEASE_OPS_PREFIX: string },
  ) {
    this.waited = new WaitedQueue(connection, settings, `${settings.LEASE_OPS_QUEUE}-maintenance`, 'lease-ops-client-probes');
  }

  async probe(target: string | ProbeTarget, timeoutMs = PROBE_DEADLINE_MS + 2_000): Promise<ProviderProbe> {
    const probe: ProbeTarget = typeof target === 'string' ? { provider: target } : target;
    const name = probe.provider;
    const { queue, events } = await this.waited.open();
    // Shared for a while per provider (per instance); a draft's probe is its own.
    const subject = probe.draft ? `draft.${probe.draft}` : Buffer.from(JSON.stringify([name, probe.companyId ?? null, probe.environmentId ?? null, probe.rev ?? null, probe.instance ?? null])).toString('base64url');
    // The probe of the last PROBE_REUSE_MS from its first ask, named under a key that lives as
    // long: with the time cut in fixed slices, an ask just after a slice's end ran a new probe
    // (a CI run: "asked again at once" got another answer).
    const candidate = `${PROBE_JOB}.${subject}.${Date.now()}`;
    const sharedKey = `${this.settings.LEASE_OPS_PREFIX}:probe-shared:${subject}`;
    const taken = await this.connection.set(sharedKey, candidate, 'PX', PROBE_REUSE_MS, 'NX');
    const jobId = taken === 'OK' ? candidate : ((await this.connection.get(sharedKey)) ?? candidate);
    await queue.add(PROBE_JOB, probe, { jobId, attempts: 1, removeOnComplete: { age: 120 }, removeOnFail: { age: 120 } });
    try {
      const result = ProbeSchema.safeParse(await this.waited.waitFor(jobId, events, timeoutMs));
      if (result.success) return result.data;
      return { ok: false, code: 'probe_failed', message: 'the worker answered the probe with something this version cannot read', at: Date.now() };
    } catch (err) {
      const message = (err as Error).message ?? '';
      if (/timed out/i.test(message)) return { ok: false, code: 'probe_timeout', message: `no worker answered the probe within ${timeoutMs} ms (is one running that serves ${name}?)`, at: Date.now() };
      return { ok: false, code: 'probe_failed', message, at: Date.now() };
    }
  }

  close(): Promise<void> {
    return this.waited.close();
  }
}
