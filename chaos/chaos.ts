// The chaos campaign: several `lease-ops worker` processes against the Daytona and CreateOS
// fakes side by side (their real reply shapes), which inject settling and transient errors;
// some Daytona stops hang. Meanwhile the campaign kills workers (SIGKILL), stops them
// (SIGTERM), pauses them past their lock (SIGSTOP, SIGCONT) and restarts them, and acquires
// more sandboxes while it does. An independent checker then reads the fakes' own call logs and
// sandboxes and BullMQ's job records and counts every violation. `npm run chaos` runs it;
// test/chaos.test.ts a short one.
import { randomBytes } from 'node:crypto';
import { QueueEvents } from 'bullmq';
import { loadConfig, type Config } from '../src/config.ts';
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import type { DaytonaFaults, SandboxControls } from '../src/fakes/daytona-fake.ts';
import { seededRandom } from '../src/fakes/seeded-random.ts';
import type { FakeCall } from '../src/fakes/http-fake.ts';
import type { WireCall } from './cloud.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import type { OperationName } from '../src/operations.ts';
import { OperationsQueue } from '../src/queues/operations-queue.ts';
import { createRedis } from '../src/queues/redis.ts';
import { QUICK_RECOVERY, scanKeys, waitForJobs } from '../test/helpers/env.ts';
import { WorkerProcess } from '../test/helpers/worker-process.ts';

export interface ChaosOptions {
  workers: number;
  leases: number;
  /** Operations per lease after its acquire. */
  opsPerLease: number;
  /** Leases acquired while the chaos goes on (then used and destroyed), where a killed acquire could leak. */
  lateLeases: number;
  seed: number;
  faults: Omit<DaytonaFaults, 'seed'>;
  /** Share of sandboxes whose graceful stops hang (the watchdog must force them). */
  stuckShare: number;
  /** Time between two chaos actions. */
  actionEveryMs: number;
  /** Give up waiting for operations to end after this long. */
  timeoutMs: number;
  progress?: (line: string) => void;
}

export const SHORT: ChaosOptions = {
  workers: 4,
  leases: 60,
  opsPerLease: 15,
  lateLeases: 20,
  seed: 1130,
  faults: { settling: 0.1, transient: 0.05 },
  stuckShare: 0.1,
  actionEveryMs: 700,
  timeoutMs: 180_000,
};

export const FULL: ChaosOptions = { ...SHORT, workers: 5, leases: 400, opsPerLease: 25, lateLeases: 100, actionEveryMs: 1_000, timeoutMs: 900_000 };

export interface ChaosReport {
  accepted: number;
  completed: number;
  failed: number;
  failed_by_reason: Record<string, number>;
  /** The same, by operation and provider: `<op> <provider>: <code>`. */
  failed_by_op: Record<string, number>;
  overlaps: number;
  order_violations: number;
  lost: number;
  stale_calls: number;
  blocked_lanes: number;
  leftover_keys: number;
  /** Sandboxes still running (or being made) at the end that no completed acquire handed out. */
  orphaned_sandboxes: number;
  kills: number;
  sigkill: number;
  sigterm: number;
  sigstop: number;
  provider_calls: number;
  /** Of which to CreateOS (the rest to Daytona). */
  createos_calls: number;
  injected_faults: number;
  forced_stops: number;
  seconds: number;
  /** The first few violations, described, for whoever has to look into them. */
  examples: string[];
}

const LOCK_MS = 2_000;
/**
 * Each lease gets its operations in one burst, and on two shared cores a long lane can take
 * longer than the default resume deadline (60 s) to reach its last ones: the campaign is
 * about the invariants, so its operations get room; deadlines have tests of their own.
 */
const OP_DEADLINE_MS = 300_000;

/** Settings of the campaign's workers: short lock, sweep and watchdog times, so recovery shows within a run. */
function chaosEnv(prefix: string, redisUrl: string, daytonaUrl: string, createosUrl: string): Record<string, string> {
  return {
    REDIS_URL: redisUrl,
    LEASE_OPS_PREFIX: prefix,
    LEASE_OPS_PROVIDERS: 'daytona,createos',
    DAYTONA_API_URL: daytonaUrl,
    DAYTONA_API_KEY: 'chaos-key',
    CREATEOS_API_URL: createosUrl,
    CREATEOS_API_KEY: 'chaos-key',
    // Paced through Redis like production, at a rate the campaign does not reach.
    CREATEOS_REQUESTS_PER_MINUTE: '60000',
    CREATEOS_BURST: '100',
    ...QUICK_RECOVERY,
    LEASE_OPS_CONCURRENCY: '20',
    LEASE_OPS_LOCK_MS: String(LOCK_MS),
    LEASE_OPS_MAX_STALLED: '5',
    LEASE_OPS_BACKOFF_CAP_MS: '300',
    LEASE_OPS_STUCK_STOPPING_MS: '1500',
    LEASE_OPS_WATCHDOG_INTERVAL_MS: '500',
  };
}

type Step = { op: OperationName; params: (id: string) => unknown };
const MIX: [number, Step][] = [
  [0.25, { op: 'stop', params: (id) => ({ providerLeaseId: id }) }],
  [0.25, { op: 'resume', params: (id) => ({ providerLeaseId: id, leaseMetadata: {} }) }],
  [0.17, { op: 'release', params: (id) => ({ providerLeaseId: id, leaseMetadata: {}, resourceDisposition: 'keep_running' }) }],
  [0.17, { op: 'release', params: (id) => ({ providerLeaseId: id, leaseMetadata: {}, resourceDisposition: 'stop_and_retain' }) }],
  [0.06, { op: 'force-stop', params: (id) => ({ providerLeaseId: id }) }],
  [0.1, { op: 'destroy', params: (id) => ({ providerLeaseId: id }) }],
];
const DESTROY: Step = { op: 'destroy', params: (id) => ({ providerLeaseId: id }) };
function pick(r: number): Step {
  let acc = 0;
  for (const [share, step] of MIX) if (r < (acc += share)) return step;
  return MIX[0]![1];
}

export async function runChaos(opts: ChaosOptions, redisUrl = loadConfig().REDIS_URL): Promise<ChaosReport> {
  const say = opts.progress ?? (() => undefined);
  const rand = seededRandom(opts.seed);
  const prefix = `{lease-ops-chaos-${randomBytes(3).toString('hex')}}`;
  const config: Config = loadConfig({ ...process.env, REDIS_URL: redisUrl, LEASE_OPS_PREFIX: prefix, LEASE_OPS_LOG_LEVEL: 'silent' });
  const redis = createRedis(redisUrl);
  const ops = new OperationsQueue(redis, config);
  const eventsConnection = createRedis(redisUrl);
  const events = new QueueEvents(config.LEASE_OPS_QUEUE, { connection: eventsConnection, prefix });
  events.setMaxListeners(0); // every late lease waits on its own acquire
  await events.waitUntilReady();
  const cloud = await startCloud(opts.seed, opts.faults);
  const env = chaosEnv(prefix, redisUrl, cloud.daytonaUrl, cloud.createosUrl);
  /** Workers that are up and may be picked for the next action; `all` for the clean-up. */
  const workers: WorkerProcess[] = [];
  const all: WorkerProcess[] = [];
  const startWorker = async () => {
    const w = new WorkerProcess(env);
    all.push(w);
    await w.ready;
    workers.push(w);
  };
  const counts = { sigkill: 0, sigterm: 0, sigstop: 0 };
  const started = Date.now();

  // Until every operation ended (BullMQ's events), or the timeout; the checker then counts
  // what did not end as lost.
  const waitEnded = (ids: string[], timeoutMs: number) =>
    waitForJobs(events, ops.queue, ids, timeoutMs).then(
      () => undefined,
      () => undefined,
    );

  let stopChaos = false;
  let chaos: Promise<void> = Promise.resolve();
  try {
    await Promise.all(Array.from({ length: opts.workers }, startWorker));
    say(`chaos: ${opts.workers} workers, Daytona and CreateOS fakes (settling ${opts.faults.settling}, transient ${opts.faults.transient}), prefix ${prefix}`);

    // Acquire every sandbox first, half on each cloud: later operations name the sandbox
    // the acquire created.
    const providerOf = (i: number) => (i % 2 === 0 ? 'daytona' : 'createos');
    const identity = (provider: string, leaseId: string): LeaseIdentity => ({ provider, companyId: 'chaos', environmentId: 'env', leaseId });
    const acquires = await Promise.all(
      Array.from({ length: opts.leases }, (_, i) => ops.enqueue({ op: 'acquire', lease: identity(providerOf(i), `chaos-${i}`), params: { runId: `chaos-${i}` } })),
    );
    const acceptedAll = acquires.map((a) => a.jobId);
    await waitEnded(acceptedAll, opts.timeoutMs);
    const acquiredSandbox = async (jobId: string) => ((await ops.queue.getJob(jobId))?.returnvalue as { providerLeaseId?: string } | null)?.providerLeaseId;
    const sandboxes: [provider: string, id: string][] = [];
    for (const [i, a] of acquires.entries()) {
      const id = await acquiredSandbox(a.jobId);
      if (id) sandboxes.push([providerOf(i), id]);
    }
    // Some Daytona stops hang until the watchdog forces them (CreateOS cannot force a stop).
    for (const [provider, id] of sandboxes) if (provider === 'daytona' && rand() < opts.stuckShare) await cloud.control(id, { stuckStoppingMs: 4_000 });
    say(`chaos: ${sandboxes.length} sandboxes acquired; ${opts.leases * opts.opsPerLease} operations and ${opts.lateLeases} more acquires follow, with chaos`);

    // Chaos runs while the operations do.
    // Actions overlap: a paused worker may still be asleep when the next one is killed.
    const inFlight: Promise<void>[] = [];
    chaos = (async () => {
      while (!stopChaos) {
        await new Promise((r) => setTimeout(r, opts.actionEveryMs));
        if (stopChaos || workers.length < 2) continue;
        const victim = workers.splice(Math.floor(rand() * workers.length), 1)[0]!;
        // Each kind of trouble in turn: a crash, a pause past the lock, a graceful stop.
        const action = (counts.sigkill + counts.sigterm + counts.sigstop) % 3;
        if (action === 0) {
          counts.sigkill++;
          inFlight.push(victim.kill().then(startWorker));
        } else if (action === 2) {
          counts.sigterm++;
          inFlight.push(startWorker().then(() => victim.terminate().then(() => undefined)));
        } else {
          // Paused past its lock: its jobs are re-run elsewhere, then it wakes up stale.
          counts.sigstop++;
          victim.child.kill('SIGSTOP');
          inFlight.push(
            new Promise<void>((r) => setTimeout(r, LOCK_MS + 1_500)).then(() => {
              victim.child.kill('SIGCONT');
              workers.push(victim);
            }),
          );
        }
      }
      await Promise.all(inFlight);
    })();

    // The operations, enqueued per lease in order (so each lease's accepted order is known).
    const acceptedOrder = new Map<string, string[]>();
    const seen = new Set<string>();
    const run = async (provider: string, id: string, steps: Step[]) => {
      const order: string[] = [];
      for (const [i, step] of steps.entries()) {
        const { jobId } = await ops.enqueue({ op: step.op, lease: identity(provider, id), params: step.params(id), deadlineMs: OP_DEADLINE_MS });
        if (!seen.has(jobId)) {
          seen.add(jobId);
          order.push(jobId);
          acceptedAll.push(jobId);
        }
        // A little spacing, so operations keep arriving while the chaos goes on.
        if (i % 3 === 2) await new Promise((r) => setTimeout(r, Math.floor(rand() * 200)));
      }
      acceptedOrder.set(id, order);
    };
    // Late leases are acquired while workers die: an acquire cut short must not leak.
    const late = async (i: number) => {
      await new Promise((r) => setTimeout(r, Math.floor(rand() * opts.actionEveryMs * 6)));
      const { jobId } = await ops.enqueue({ op: 'acquire', lease: identity(providerOf(i), `late-${i}`), params: { runId: `late-${i}` } });
      acceptedAll.push(jobId);
      await waitEnded([jobId], opts.timeoutMs);
      const id = await acquiredSandbox(jobId);
      if (id) await run(providerOf(i), id, [pick(rand()), pick(rand()), DESTROY]);
    };
    await Promise.all([
      ...sandboxes.map(([provider, id]) => run(provider, id, Array.from({ length: opts.opsPerLease }, () => pick(rand())))),
      ...Array.from({ length: opts.lateLeases }, (_, i) => late(i)),
    ]);
    await waitEnded(acceptedAll, opts.timeoutMs);
    stopChaos = true;
    await chaos;
    say(`chaos: operations ended after ${((Date.now() - started) / 1000).toFixed(1)} s; checking`);

    // Lanes drain once every operation ended; a lane whose last job ended without a release
    // (failed after too many stalls) is repaired by the sweep within its bound.
    const drainDeadline = Date.now() + 3 * (1_000 + 500) + 2_000;
    while ((await ops.lanes.openLaneCount()) > 0 && Date.now() < drainDeadline) await new Promise((r) => setTimeout(r, 100));

    const { calls, live } = await cloud.report();
    return await check({ ops, calls, live, redis, prefix, acceptedAll, acceptedOrder, counts, seconds: (Date.now() - started) / 1000 });
  } finally {
    stopChaos = true;
    await chaos.catch(() => undefined);
    for (const w of all) w.child.kill('SIGCONT');
    await Promise.all(all.map((w) => (w.child.exitCode === null && w.child.signalCode === null ? w.terminate() : null)));
    await events.close();
    await ops.close();
    await cloud.close();
    await clearPrefix(redis, prefix);
    eventsConnection.disconnect();
    redis.disconnect();
  }
}

/** The independent checker: the fakes' own call logs and sandboxes and BullMQ's job records, nothing else. */
async function check(input: {
  ops: OperationsQueue;
  /** Every call the clouds served, on the shared clock. */
  calls: (FakeCall & { cloud: 'daytona' | 'createos' })[];
  /** Sandboxes the fakes still run (or are making). */
  live: string[];
  redis: ReturnType<typeof createRedis>;
  prefix: string;
  acceptedAll: string[];
  acceptedOrder: Map<string, string[]>;
  counts: { sigkill: number; sigterm: number; sigstop: number };
  seconds: number;
}): Promise<ChaosReport> {
  const { ops, calls, acceptedAll, acceptedOrder, counts } = input;
  const examples: string[] = [];
  const note = (line: string) => examples.length < 20 && examples.push(line);

  // Calls made by lane attempts, per sandbox (the watchdog's own reads are not in a lane).
  const laneCalls = calls.filter((c): c is FakeCall & { cloud: 'daytona' | 'createos'; attempt: string; sandboxId: string } => !!c.attempt && !!c.sandboxId && !c.attempt.startsWith('watchdog.'));
  const bySandbox = new Map<string, (FakeCall & { attempt: string })[]>();
  for (const c of laneCalls) bySandbox.set(c.sandboxId, [...(bySandbox.get(c.sandboxId) ?? []), c]);
  const jobOf = (attempt: string) => attempt.slice(0, attempt.lastIndexOf(':'));
  const fenceOf = (attempt: string) => Number(attempt.slice(attempt.lastIndexOf(':') + 1));

  let overlaps = 0;
  let stale = 0;
  const staleFound: { jobId: string; text: string }[] = [];
  const firstCall = new Map<string, bigint>();
  for (const [sandbox, calls] of bySandbox) {
    calls.sort((a, b) => (a.start < b.start ? -1 : a.start > b.start ? 1 : 0));
    let highestFence = 0;
    let highestAttempt = '';
    for (let i = 0; i < calls.length; i++) {
      const c = calls[i]!;
      const prev = calls[i - 1];
      if (prev && prev.attempt !== c.attempt && c.start < prev.end) {
        overlaps++;
        note(`overlap on ${sandbox}: ${c.method} ${c.path} (${c.attempt}) while ${prev.method} ${prev.path} (${prev.attempt}) ran`);
      }
      // Fencing tokens only grow: a call from a lower one after a higher one called is stale.
      const fence = fenceOf(c.attempt);
      if (fence < highestFence) {
        stale++;
        const successorFirst = calls.find((x) => x.attempt === highestAttempt)!;
        const ownPrevious = calls.slice(0, i).filter((x) => x.attempt === c.attempt).at(-1);
        const ms = (a: bigint, b: bigint) => Number((a - b) / 1_000_000n);
        staleFound.push({
          jobId: jobOf(c.attempt),
          text:
            `stale call on ${sandbox}: ${c.method} ${c.path} by ${c.attempt} after ${highestAttempt} had called ` +
            `(${ms(c.start, successorFirst.start)} ms after the successor's first call; its own previous call ended ${ownPrevious ? `${ms(successorFirst.start, ownPrevious.end)} ms before that` : 'never'})`,
        });
      } else {
        highestFence = fence;
        highestAttempt = c.attempt;
      }
      const job = jobOf(c.attempt);
      if (!firstCall.has(job)) firstCall.set(job, c.start);
    }
  }

  // What each stale call's job was, for whoever looks into it.
  for (const { jobId, text } of staleFound.slice(0, 10)) {
    const job = await ops.queue.getJob(jobId);
    note(`${text}; job: ${job?.name} started ${job?.attemptsStarted} times, made ${job?.attemptsMade}, stalled ${job?.stalledCounter}, now ${await ops.queue.getJobState(jobId)}`);
  }

  // Order: the operations of a lease first reached the cloud in accepted order. Force-stops
  // may go ahead by design, so they are left out of the comparison.
  let orderViolations = 0;
  for (const [sandbox, order] of acceptedOrder) {
    const ranked: string[] = [];
    for (const id of order) {
      const job = await ops.queue.getJob(id);
      if (job?.name !== 'force-stop' && firstCall.has(id)) ranked.push(id);
    }
    for (let i = 1; i < ranked.length; i++) {
      if (firstCall.get(ranked[i]!)! < firstCall.get(ranked[i - 1]!)!) {
        orderViolations++;
        note(`order on ${sandbox}: ${ranked[i]} reached the cloud before ${ranked[i - 1]}, accepted earlier`);
      }
    }
  }

  // Outcomes, from the job records; the sandboxes completed acquires handed out are owned.
  const owned = new Set<string>();
  const failedByReason: Record<string, number> = {};
  const failedByOp: Record<string, number> = {};
  let completed = 0;
  let failed = 0;
  let lost = 0;
  for (const id of acceptedAll) {
    const state = await ops.queue.getJobState(id);
    if (state === 'completed') {
      completed++;
      const job = await ops.queue.getJob(id);
      const sandbox = (job?.returnvalue as { providerLeaseId?: unknown } | null)?.providerLeaseId;
      if (job?.name === 'acquire' && typeof sandbox === 'string') owned.add(sandbox);
    }
    else if (state === 'failed') {
      failed++;
      const job = await ops.queue.getJob(id);
      const reason = job?.failedReason ?? '';
      const code = /^([a-z_]+):/.exec(reason)?.[1] ?? reason.slice(0, 40);
      failedByReason[code] = (failedByReason[code] ?? 0) + 1;
      const byOp = `${job?.name ?? '?'} ${(job?.data as { lease?: { provider?: string } } | undefined)?.lease?.provider ?? '?'}: ${code}`;
      failedByOp[byOp] = (failedByOp[byOp] ?? 0) + 1;
    } else {
      lost++;
      note(`lost: ${id} is still ${state}`);
    }
  }
  const blocked = await ops.lanes.openLaneCount();
  // Keys of lanes that stay for good; a watchdog claim expires by itself (its TTL), so it
  // is not left behind.
  let leftover = 0;
  for (const key of await scanKeys(input.redis, `${input.prefix}:lane:*`)) {
    if ((await input.redis.pttl(key)) >= 0) continue;
    leftover++;
    note(`left behind: ${key}`);
  }
  const orphans = input.live.filter((id) => !owned.has(id));
  for (const id of orphans) note(`orphaned sandbox: ${id} runs, and no completed acquire handed it out`);
  return {
    accepted: acceptedAll.length,
    completed,
    failed,
    failed_by_reason: failedByReason,
    failed_by_op: failedByOp,
    overlaps,
    order_violations: orderViolations,
    lost,
    stale_calls: stale,
    blocked_lanes: blocked,
    leftover_keys: leftover,
    orphaned_sandboxes: orphans.length,
    kills: counts.sigkill + counts.sigterm + counts.sigstop,
    ...counts,
    provider_calls: calls.length,
    createos_calls: calls.filter((c) => c.cloud === 'createos').length,
    injected_faults: calls.filter((c) => c.injected).length,
    forced_stops: calls.filter((c) => c.cloud === 'daytona').filter((c) => c.method === 'POST' && c.path.endsWith('/stop') && c.query.includes('force=true') && c.status === 200).length,
    seconds: Number(input.seconds.toFixed(1)),
    examples,
  };
}

/** The clouds' process (chaos/cloud.ts) and a small request/answer channel to it. */
async function startCloud(seed: number, faults: Omit<DaytonaFaults, 'seed'>) {
  const child: ChildProcess = fork(fileURLToPath(new URL('./cloud.ts', import.meta.url)), [String(seed), String(faults.settling), String(faults.transient)], {
    execArgv: ['--import', 'tsx'],
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
  });
  const urls = await new Promise<{ daytonaUrl: string; createosUrl: string }>((resolve, reject) => {
    child.once('message', (m: { ready: { daytonaUrl: string; createosUrl: string } }) => resolve(m.ready));
    child.once('exit', (code) => reject(new Error(`the chaos cloud exited (${code}) before it listened`)));
  });
  let seq = 0;
  const ask = <T>(req: Record<string, unknown>): Promise<T> =>
    new Promise((resolve) => {
      const id = ++seq;
      const on = (m: { id?: number; body: T }) => {
        if (m.id !== id) return;
        child.off('message', on);
        resolve(m.body);
      };
      child.on('message', on);
      child.send({ ...req, id });
    });
  return {
    ...urls,
    control: (id: string, controls: SandboxControls) => ask<null>({ type: 'control', id2: id, controls }),
    report: async () => {
      const r = await ask<{ calls: WireCall[]; live: string[] }>({ type: 'report' });
      return { calls: r.calls.map((c) => ({ ...c, start: BigInt(c.start), end: BigInt(c.end) })), live: r.live };
    },
    close: async () => {
      if (child.connected) await ask<null>({ type: 'close' });
      if (child.exitCode === null) child.kill();
    },
  };
}

async function clearPrefix(redis: ReturnType<typeof createRedis>, prefix: string): Promise<void> {
  for (const key of await scanKeys(redis, `${prefix}*`)) await redis.unlink(key);
}

/** The report as a table, violations first. */
export function formatReport(r: ChaosReport): string {
  const rows: [string, string][] = [
    ['operations accepted', String(r.accepted)],
    ['completed', String(r.completed)],
    ['failed', `${r.failed}${Object.keys(r.failed_by_reason).length ? ` (${Object.entries(r.failed_by_reason).map(([k, v]) => `${k} ${v}`).join(', ')})` : ''}`],
    ['overlaps (two attempts on one sandbox at once)', String(r.overlaps)],
    ['order violations', String(r.order_violations)],
    ['lost operations', String(r.lost)],
    ['calls by stale attempts after fencing', String(r.stale_calls)],
    ['lanes left blocked', String(r.blocked_lanes)],
    ['lane keys left behind', String(r.leftover_keys)],
    ['orphaned sandboxes (running, owned by no lease)', String(r.orphaned_sandboxes)],
    ['worker kills (SIGKILL / SIGTERM / SIGSTOP past the lock)', `${r.kills} (${r.sigkill} / ${r.sigterm} / ${r.sigstop})`],
    ['provider calls: Daytona / CreateOS (injected faults)', `${r.provider_calls - r.createos_calls} / ${r.createos_calls} (${r.injected_faults})`],
    ['stuck stops forced', String(r.forced_stops)],
    ['duration', `${r.seconds} s`],
  ];
  const w = Math.max(...rows.map(([k]) => k.length));
  return [...rows.map(([k, v]) => `${k.padEnd(w)}  ${v}`), ...r.examples.map((e) => `  ! ${e}`)].join('\n');
}

/** Violations that must be zero. */
export function violations(r: ChaosReport): number {
  return r.overlaps + r.order_violations + r.lost + r.stale_calls + r.blocked_lanes + r.leftover_keys + r.orphaned_sandboxes;
}
