import { createLogger } from '../../src/logger.ts';
import { SettlingError } from '../../src/providers/errors.ts';
import type { OperationContext, SandboxState } from '../../src/providers/types.ts';

const log = createLogger({ level: 'silent' });
let jobSeq = 0;

/**
 * A provider call's context outside a worker: always fenced in, a checkpoint in memory.
 * One context per operation (its retries keep the job id, as the lane's retries do).
 */
export function providerContext(leaseId: string, environmentId = 'env-a', overrides: Partial<OperationContext> = {}): OperationContext & { observed: [string, SandboxState][] } {
  let saved: Record<string, unknown> = {};
  const observed: [string, SandboxState][] = [];
  jobSeq++;
  return {
    lease: { provider: 'x', companyId: 'co', environmentId, leaseId },
    jobId: `contract.${jobSeq}`,
    attempt: 1,
    attemptId: `contract.${jobSeq}:1`,
    signal: new AbortController().signal,
    deadlineAt: Date.now() + 60_000,
    fence: async () => undefined,
    fenceIsFresh: () => true,
    observe: (id, state) => void observed.push([id, state]),
    log,
    checkpoint: { read: async () => saved, write: async (v) => void (saved = { ...saved, ...v }) },
    observed,
    ...overrides,
  };
}

/** What the lane does for a settling error, in small: try again until it settles. */
export async function settled<T>(fn: () => Promise<T>, timeoutMs = 5_000): Promise<T> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    try {
      return await fn();
    } catch (err) {
      if (!(err instanceof SettlingError) || Date.now() > until) throw err;
      await new Promise((r) => setTimeout(r, 10));
    }
  }
}
