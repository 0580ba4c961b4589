// The chaos campaign: several `lease-ops worker` processes against the Daytona and CreateOS
// fakes side by side (their real reply shapes), which inject settling and transient errors;
// some Daytona stops hang. Meanwhile the campaign kills workers (SIGKILL), stops them
// (SIGTERM), pauses them past their lock (SIGSTOP, SIGCONT) and restarts them, and acquires
// more sandboxes while it does. An independent checker then reads the fakes' own call logs and
// sandboxes and BullMQ's job records and counts every violation. Jobs stall twice (all
// workers but one paused past their lock, then that one as it takes their jobs). Then, on the campaign's own
// redis-server, the phases of chaos/phases.ts: Redis loses its data mid-run, sandboxes stuck
// for good beside a newly stuck one, many open lanes beside a blocked one. `npm run chaos`
// runs it; test/chaos.test.ts a short one. With CHAOS_LOGS=<dir>, a campaign that found any
// violation writes its workers' logs there.
import { randomBytes } from 'node:crypto';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { QueueEvents } from 'bullmq';
import { startApiServer, type ApiServer } from '../src/api/server.ts';
import { loadConfig, type Config } from '../src/config.ts';
import { createLogger } from '../src/logger.ts';
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import type { CreateosControls } from '../src/fakes/createos-fake.ts';
import type { DaytonaFaults, SandboxControls } from '../src/fakes/daytona-fake.ts';
import { seededRandom } from '../src/fakes/seeded-random.ts';
import type { FakeCall } from '../src/fakes/http-fake.ts';
import type { WireCall } from './cloud.ts';
import type { OperationName } from '../src/operations.ts';
import { OperationsQueue } from '../src/queues/operations-queue.ts';
import { laneIdOfJobId } from '../src/lease.ts';
import { createRedis } from '../src/queues/redis.ts';
import { QUICK_RECOVERY, scanKeys, waitForJobs } from '../test/helpers/env.ts';
import { RedisProcess } from '../test/helpers/redis-process.ts';
import { WorkerProcess } from '../test/helpers/worker-process.ts';
import { dataLossPhase, identity, scalePhase, stuckPhase, type DataLossReport, type PhaseContext, type ScaleReport, type StuckReport } from './phases.ts';

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
  /** Data-loss phase: fresh leases, and operations on each, Redis losing its data halfway. */
  lossLeases: number;
  lossOpsPerLease: number;
  /** Stuck phase: CreateOS sandboxes stuck pausing for good, beside one newly stuck Daytona sandbox. */
  stuckForGood: number;
  /** Scale phase: open, quiet lanes beside the blocked one. */
  openLanes: number;
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
  lossLeases: 20,
  lossOpsPerLease: 6,
  stuckForGood: 50,
  openLanes: 5_000,
};

export const FULL: ChaosOptions = {
  ...SHORT,
  workers: 5,
  leases: 400,
  opsPerLease: 25,
  lateLeases: 100,
  actionEveryMs: 1_000,
  timeoutMs: 900_000,
  lossLeases: 100,
  lossOpsPerLease: 10,
  stuckForGood: 500,
  openLanes: 100_000,
};

export interface ChaosReport {
  accepted: number;
  completed: number;
  failed: number;
  failed_by_reason: Record<string, number>;
  /** The same, by operation and provider: `<op> <provider>: <code>`. */
  failed_by_op: Record<string, number>;
  overlaps: number;
  /** Calls to one sandbox in flight at once, any two, reads included (over every phase). */
  sandbox_call_overlaps: number;
  /** Of those, pairs where one call began before Redis lost its data and one after (reported, not a violation). */
  overlaps_across_data_loss: number;
  order_violations: number;
  lost: number;
  /** Failures whose reason starts with no code: every failure must carry a documented one. */
  uncoded_failures: number;
  stale_calls: number;
  /**
   * Calls by stale attempts that arrived as a paused worker woke: the transport checked the
   * fence, then the worker was paused before the bytes left (a documented limit; not counted).
   */
  stale_calls_sent_before_freeze: number;
  blocked_lanes: number;
  leftover_keys: number;
  /** Sandboxes still running (or being made) at the end that no completed acquire handed out. */
  orphaned_sandboxes: number;
  kills: number;
  sigkill: number;
  sigterm: number;
  sigstop: number;
  /** Double stalls: all workers but one paused past their lock, then that one. */
  double_stalls: number;
  /** Jobs BullMQ reported stalled, and of those, twice or more. */
  stalled: number;
  stalled_twice: number;
  data_loss: Omit<DataLossReport, 'lostAt' | 'backAt'>;
  /** Sandboxes stuck for good (their provider cannot force a stop) while one more got stuck. */
  stuck_for_good: number;
  /** How long the newly stuck sandbox stayed stopping past its budget before it was forced. */
  max_stuck_unforced_s: number;
  /** The bound for it: the watchdog's interval plus 1.5 s for the force to be queued and sent. */
  stuck_unforced_bound_s: number;
  open_lanes: number;
  /** How long a blocked lane stayed so, with `open_lanes` open: the longer of the two below. */
  max_blocked_lane_s: number;
  /** Its head removed by an operator in Bull Board (repaired at once). */
  blocked_by_removal_s: number;
  /** Its head's job deleted by hand and its progress long ago, as a lost hand-off leaves it (the sweep's case). */
  blocked_unannounced_s: number;
  /** LEASE_OPS_SWEEP_STALE_MS + LEASE_OPS_SWEEP_INTERVAL_MS + 3 s for the pass over every quiet lane. */
  blocked_lane_bound_s: number;
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
const DOUBLE_STALL_SLOW_MS = 500;
/** How soon after a SIGCONT a request sent before the pause reaches the fake (it leaves as the worker wakes). */
const RESUMED_WITHIN_NS = 250_000_000n;
/**
 * Each lease gets its operations in one burst, and on two shared cores a long lane can take
 * longer than the default resume deadline (60 s) to reach its last ones: the campaign is
 * about the invariants, so its operations get room; deadlines have tests of their own.
 */
const OP_DEADLINE_MS = 300_000;

/** Settings of the campaign's workers: short lock, sweep and watchdog times, so recovery shows within a run. */
function chaosEnv(prefix: string, redisUrl: string, daytonaUrl: string, createosUrl: string, holdFile: string): Record<string, string> {
  return {
    REDIS_URL: redisUrl,
    LEASE_OPS_PREFIX: prefix,
    LEASE_OPS_PROVIDERS: `daytona,createos,${HOLD_PROVIDER}`,
    HOLD_FILE: holdFile,
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
    LEASE_OPS_STUCK_STOPPING_MS: String(STUCK_MS),
    LEASE_OPS_WATCHDOG_INTERVAL_MS: String(WATCHDOG_INTERVAL_MS),
  };
}

const HOLD_PROVIDER = fileURLToPath(new URL('./hold-provider.ts', import.meta.url));
const STUCK_MS = 1_500;
const WATCHDOG_INTERVAL_MS = 500;
const STUCK_UNFORCED_BOUND_S = WATCHDOG_INTERVAL_MS / 1000 + 1.5;
const BLOCKED_LANE_BOUND_S = (Number(QUICK_RECOVERY.LEASE_OPS_SWEEP_STALE_MS) + Number(QUICK_RECOVERY.LEASE_OPS_SWEEP_INTERVAL_MS)) / 1000 + 3;

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

/** Runs the campaign on a redis-server of its own (it loses its data on purpose). */
export async function runChaos(opts: ChaosOptions): Promise<ChaosReport> {
  const say = opts.progress ?? (() => undefined);
  const rand = seededRandom(opts.seed);
  // No persistence, as the shared Redis here; noeviction, as BullMQ requires.
  const server = await RedisProcess.start(['--appendonly', 'no', '--maxmemory-policy', 'noeviction']);
  const redisUrl = server.url;
  const holdDir = mkdtempSync(join(tmpdir(), 'lease-ops-chaos-'));
  const holdFile = join(holdDir, 'hold');
  const prefix = `{lease-ops-chaos-${randomBytes(3).toString('hex')}}`;
  // One company holds every lease here, and the open-lanes phase queues 100,000 operations
  // beside the others: the per-company limit (100,000 by default) is not what is measured.
  const config: Config = loadConfig({ ...process.env, REDIS_URL: redisUrl, LEASE_OPS_PREFIX: prefix, LEASE_OPS_LOG_LEVEL: 'silent', LEASE_OPS_MAX_QUEUED_PER_COMPANY: '0' });
  const redis = createRedis(redisUrl);
  const ops = new OperationsQueue(redis, config);
  const eventsConnection = createRedis(redisUrl);
  const events = new QueueEvents(config.LEASE_OPS_QUEUE, { connection: eventsConnection, prefix });
  events.setMaxListeners(0); // every late lease waits on its own acquire
  // Redis goes away on purpose (the data loss): the clients reconnect by themselves.
  const expected = () => undefined;
  events.on('error', expected);
  ops.queue.on('error', expected);
  redis.on('error', expected);
  eventsConnection.on('error', expected);
  await events.waitUntilReady();
  const stalls = new Map<string, number>();
  const someJobStalledTwice = () => [...stalls.values()].some((n) => n >= 2);
  events.on('stalled', ({ jobId }) => stalls.set(jobId, (stalls.get(jobId) ?? 0) + 1));
  const cloud = await startCloud(opts.seed, opts.faults);
  const env = chaosEnv(prefix, redisUrl, cloud.daytonaUrl, cloud.createosUrl, holdFile);
  /** Workers that are up and may be picked for the next action; `all` for the clean-up. */
  const workers: WorkerProcess[] = [];
  const all: WorkerProcess[] = [];
  const startWorker = async () => {
    const w = new WorkerProcess(env);
    all.push(w);
    await w.ready;
    workers.push(w);
  };
  const counts = { sigkill: 0, sigterm: 0, sigstop: 0, double_stalls: 0 };
  /** When the campaign woke a paused worker (SIGCONT), on the fakes' clock. */
  const resumedAt: bigint[] = [];
  const resume = (w: WorkerProcess) => {
    w.child.kill('SIGCONT');
    resumedAt.push(process.hrtime.bigint());
  };
  const started = Date.now();
  const pastLock = () => new Promise<void>((r) => setTimeout(r, LOCK_MS + 1_500));

  // Until every operation ended (BullMQ's events), or the timeout; the checker then counts
  // what did not end as lost.
  const waitEnded = (ids: string[], timeoutMs: number) =>
    waitForJobs(events, ops.queue, ids, timeoutMs).then(
      () => undefined,
      () => undefined,
    );

  let stopChaos = false;
  let chaos: Promise<void> = Promise.resolve();
  let api: ApiServer | null = null;
  try {
    await Promise.all(Array.from({ length: opts.workers }, startWorker));
    say(`chaos: ${opts.workers} workers, Daytona and CreateOS fakes (settling ${opts.faults.settling}, transient ${opts.faults.transient}), prefix ${prefix}`);

    // Acquire every sandbox first, half on each cloud: later operations name the sandbox
    // the acquire created.
    const providerOf = (i: number) => (i % 2 === 0 ? 'daytona' : 'createos');
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
    for (const [provider, id] of sandboxes) if (provider === 'daytona' && rand() < opts.stuckShare) await cloud.control('daytona', id, { stuckStoppingMs: 4_000 });
    say(`chaos: ${sandboxes.length} sandboxes acquired; ${opts.leases * opts.opsPerLease} operations and ${opts.lateLeases} more acquires follow, with chaos`);

    // Chaos runs while the operations do.
    // Actions overlap: a paused worker may still be asleep when the next one is killed.
    const inFlight: Promise<void>[] = [];
    chaos = (async () => {
      let action = 0;
      while (!stopChaos) {
        await new Promise((r) => setTimeout(r, opts.actionEveryMs));
        if (stopChaos || workers.length < 2) continue;
        // Each kind of trouble in turn: a crash, a double stall, a pause past the lock, a graceful
        // stop. Until a double stall has caught a job, another one follows each round (each
        // takes every worker for seconds, so the others still come first).
        const order = someJobStalledTwice() ? [0, 3, 1, 2] : [0, 3, 1, 2, 3];
        const kind = order[action++ % order.length]!;
        if (kind === 3) {
          // Every available worker but one paused past its lock: their jobs stall and move
          // to the one left. The moment it starts one of them, it is paused too (the others
          // wake), and that job stalls a second time. The clouds answer half a second late
          // meanwhile, so the paused workers are caught with jobs in hand and the last one is
          // paused before its stalled job could end (with 30 ms calls, a run sometimes had no
          // double stall); a delay past the lock would let a paused worker's call overlap its
          // job's re-run.
          counts.double_stalls++;
          await cloud.slow(DOUBLE_STALL_SLOW_MS);
          const paused = workers.splice(1);
          const last = workers.splice(0)[0]!;
          for (const w of paused) w.child.kill('SIGSTOP');
          const tookStalled = new Promise<void>((resolve) => {
            const onActive = ({ jobId }: { jobId: string }) => {
              if (!stalls.has(jobId)) return;
              events.off('active', onActive);
              resolve();
            };
            events.on('active', onActive);
            setTimeout(() => {
              events.off('active', onActive);
              resolve();
            }, LOCK_MS + 5_000);
          });
          inFlight.push(
            tookStalled.then(async () => {
              last.child.kill('SIGSTOP');
              await cloud.slow(0);
              for (const w of paused) resume(w);
              workers.push(...paused);
              await pastLock();
              resume(last);
              workers.push(last);
            }),
          );
          continue;
        }
        const victim = workers.splice(Math.floor(rand() * workers.length), 1)[0]!;
        if (kind === 0) {
          counts.sigkill++;
          inFlight.push(victim.kill().then(startWorker));
        } else if (kind === 2) {
          counts.sigterm++;
          inFlight.push(startWorker().then(() => victim.terminate().then(() => undefined)));
        } else {
          // Paused past its lock: its jobs are re-run elsewhere, then it wakes up stale.
          counts.sigstop++;
          victim.child.kill('SIGSTOP');
          inFlight.push(
            pastLock().then(() => {
              resume(victim);
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
      acceptedOrder.set(id, [...(acceptedOrder.get(id) ?? []), ...order]);
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
    const round = () => sandboxes.map(([provider, id]) => run(provider, id, Array.from({ length: opts.opsPerLease }, () => pick(rand()))));
    await Promise.all([...round(), ...Array.from({ length: opts.lateLeases }, (_, i) => late(i))]);
    await waitEnded(acceptedAll, opts.timeoutMs);
    // On a quiet machine the operations can end before the chaos did what the campaign is for
    // (three kills, a job stalled twice; runs here once ended after 23 s with neither): another
    // round of operations on the same sandboxes follows, twice at most.
    const enoughChaos = () => counts.sigkill + counts.sigterm + counts.sigstop >= 3 && someJobStalledTwice();
    for (let extra = 0; extra < 2 && !enoughChaos(); extra++) {
      say(`chaos: operations ended before the chaos did enough; another ${opts.leases * opts.opsPerLease} follow`);
      await Promise.all(round());
      await waitEnded(acceptedAll, opts.timeoutMs);
    }
    stopChaos = true;
    await chaos;
    say(`chaos: operations ended after ${((Date.now() - started) / 1000).toFixed(1)} s; checking`);

    // Lanes drain once every operation ended; a lane whose last job ended without a release
    // (failed after too many stalls) is repaired by the sweep within its bound.
    const drainBoundMs = 3 * (1_000 + 500) + 2_000;
    const drainDeadline = Date.now() + drainBoundMs;
    while ((await ops.lanes.openLaneCount()) > 0 && Date.now() < drainDeadline) await new Promise((r) => setTimeout(r, 100));
    // The main campaign is checked from BullMQ's job records now: the data loss takes them.
    const main = await checkRecords({ ops, redis, prefix, acceptedAll, acceptedOrder });

    // The API, for Bull Board: operators remove jobs there.
    const admin = randomBytes(18).toString('base64url');
    api = await startApiServer(
      { ...config, LEASE_OPS_API_PORT: 0, LEASE_OPS_API_TOKENS: [{ token: admin }], LEASE_OPS_BOARD_READ_ONLY: false },
      createLogger({ level: 'silent' }),
    );
    const boardUrl = api.url;
    const boardRemove = async (jobId: string) => {
      const res = await fetch(`${boardUrl}/board/api/queues/${encodeURIComponent(config.LEASE_OPS_QUEUE)}/${encodeURIComponent(jobId)}/clean`, {
        method: 'PUT',
        headers: { authorization: `Basic ${Buffer.from(`operator:${admin}`).toString('base64')}` },
      });
      await res.arrayBuffer();
      return res.status;
    };
    const ctx: PhaseContext = { ops, events, redis, rand, say, timeoutMs: opts.timeoutMs, control: cloud.control, owned: main.owned, boardRemove };
    say(`chaos: main campaign checked; Redis loses its data with operations on ${opts.lossLeases} more leases in flight`);
    const loss = await dataLossPhase(ctx, server, opts.lossLeases, opts.lossOpsPerLease);
    const stuck = await stuckPhase(ctx, opts.stuckForGood);
    say(`chaos: ${opts.openLanes} lanes open while one is blocked`);
    const scale = await scalePhase(ctx, holdFile, opts.openLanes, drainBoundMs);

    const { calls, live } = await cloud.report();
    const { lostAt, backAt, ...dataLoss } = loss;
    const seconds = (Date.now() - started) / 1000;
    const report = checkCalls({ calls, live, main, lostAt, backAt, counts, resumedAt, stalls, dataLoss, stuck, scale, seconds });
    // Where to keep the workers' logs of a campaign with any violation (for whoever looks into it).
    const logsDir = process.env.CHAOS_LOGS;
    if (logsDir && violations(report) > 0) {
      mkdirSync(logsDir, { recursive: true });
      for (const [i, w] of all.entries()) writeFileSync(join(logsDir, `worker-${i}.log`), w.logs.join('\n'));
      say(`chaos: the campaign found violations; the workers' logs are in ${logsDir}`);
    }
    return report;
  } finally {
    stopChaos = true;
    await chaos.catch(() => undefined);
    for (const w of all) w.child.kill('SIGCONT');
    await Promise.all(all.map((w) => (w.child.exitCode === null && w.child.signalCode === null ? w.terminate() : null)));
    await api?.close();
    await events.close();
    await ops.close();
    await cloud.close();
    eventsConnection.disconnect();
    redis.disconnect();
    await server.stop();
    rmSync(holdDir, { recursive: true, force: true });
  }
}

/** What the main campaign's job records said, read before the data loss takes them. */
interface MainRecords {
  accepted: number;
  completed: number;
  failed: number;
  failed_by_reason: Record<string, number>;
  failed_by_op: Record<string, number>;
  lost: number;
  /** Failures whose reason starts with no code (every failure must carry a documented one). */
  uncoded_failures: number;
  blocked_lanes: number;
  leftover_keys: number;
  /** Sandboxes completed acquires handed out (the phases add theirs). */
  owned: Set<string>;
  /** Each accepted job as it ended, for the call checks and their examples. */
  jobs: Map<string, string>;
  acceptedOrder: Map<string, string[]>;
  examples: string[];
}

/** The independent checker, part one: BullMQ's job records and the lane keys, nothing else. */
async function checkRecords(input: {
  ops: OperationsQueue;
  redis: ReturnType<typeof createRedis>;
  prefix: string;
  acceptedAll: string[];
  acceptedOrder: Map<string, string[]>;
}): Promise<MainRecords> {
  const { ops, acceptedAll } = input;
  const examples: string[] = [];
  const note = (line: string) => examples.length < 40 && examples.push(line);
  // Each lane left behind or holding a lost operation, described once.
  const described = new Set<string>();
  const describe = async (laneId: string) => {
    if (described.has(laneId)) return;
    described.add(laneId);
    for (const line of await describeLane(input, laneId)) note(`  ${line}`);
  };
  const owned = new Set<string>();
  const jobs = new Map<string, string>();
  const failedByReason: Record<string, number> = {};
  const failedByOp: Record<string, number> = {};
  let completed = 0;
  let failed = 0;
  let lost = 0;
  let uncoded = 0;
  for (const id of acceptedAll) {
    const state = await ops.queue.getJobState(id);
    const job = await ops.queue.getJob(id);
    jobs.set(id, `${job?.name} started ${job?.attemptsStarted} times, made ${job?.attemptsMade}, stalled ${job?.stalledCounter}, ${state}`);
    if (state === 'completed') {
      completed++;
      const sandbox = (job?.returnvalue as { providerLeaseId?: unknown } | null)?.providerLeaseId;
      if (job?.name === 'acquire' && typeof sandbox === 'string') owned.add(sandbox);
    } else if (state === 'failed') {
      failed++;
      const reason = job?.failedReason ?? '';
      const coded = /^([a-z_]+):/.exec(reason)?.[1];
      if (!coded) {
        uncoded++;
        note(`failed without a code: ${id} (${job?.name}, started ${job?.attemptsStarted} times, made ${job?.attemptsMade}, stalled ${job?.stalledCounter}): ${reason}`);
      }
      const code = coded ?? reason.slice(0, 40);
      failedByReason[code] = (failedByReason[code] ?? 0) + 1;
      const byOp = `${job?.name ?? '?'} ${(job?.data as { lease?: { provider?: string } } | undefined)?.lease?.provider ?? '?'}: ${code}`;
      failedByOp[byOp] = (failedByOp[byOp] ?? 0) + 1;
    } else {
      lost++;
      note(`lost: ${id} is still ${state}`);
      await describe(laneIdOfJobId(id) ?? id);
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
    // lane:<id>, or one of its keys (lane:<id>:x, lane:<id>:c).
    await describe(key.slice(`${input.prefix}:lane:`.length).split(':')[0]!);
  }
  return {
    accepted: acceptedAll.length,
    completed,
    failed,
    failed_by_reason: failedByReason,
    failed_by_op: failedByOp,
    lost,
    uncoded_failures: uncoded,
    blocked_lanes: blocked,
    leftover_keys: leftover,
    owned,
    jobs,
    acceptedOrder: input.acceptedOrder,
    examples,
  };
}

/**
 * A lane as Redis holds it, for whoever has to find out why it did not move: its list, its
 * holder, its progress, and each of its first jobs' own fields and queue state.
 */
async function describeLane(input: { ops: OperationsQueue; redis: ReturnType<typeof createRedis> }, laneId: string): Promise<string[]> {
  const { ops, redis } = input;
  const now = Date.now();
  const { jobs, holder } = await ops.lanes.view(laneId);
  const lines = [
    `lane ${laneId}: ${jobs.length} jobs, holder ${JSON.stringify(holder)}, progress ${Number(await redis.zscore(ops.lanes.lanesKey, laneId)) - now} ms from now, paused ${await redis.hexists(ops.lanes.pausedKey, laneId)}`,
  ];
  for (const id of jobs.slice(0, 6)) {
    const fields = ['name', 'delay', 'timestamp', 'processedOn', 'finishedOn', 'atm', 'ats', 'stc', 'progress', 'lo:parked', 'lo:front', 'lo:released-atm'];
    const values = await redis.hmget(ops.queue.toKey(id), ...fields);
    const own = fields.map((f, i) => (values[i] === null ? '' : `${f}=${/On$|^timestamp$/.test(f) ? Number(values[i]) - now : values[i]}`)).filter(Boolean).join(' ');
    const delayed = await redis.zscore(ops.queue.toKey('delayed'), id);
    const backingOff = await redis.zscore(ops.lanes.backingOffKey, id);
    lines.push(
      `${id}: ${await ops.queue.getJobState(id)}; ${own || 'no hash'}${delayed === null ? '' : `; due ${Math.floor(Number(delayed) / 4096) - now} ms from now`}${backingOff === null ? '' : `; backing off till ${Number(backingOff) - now} ms from now`}`,
    );
  }
  return lines;
}

type CloudCall = FakeCall & { cloud: 'daytona' | 'createos' };

/** Lane attempts' calls of one period: overlaps between attempts, stale calls, each job's first call. */
function laneCallChecks(calls: CloudCall[], note: (line: string) => void, jobs: Map<string, string>, resumedAt: bigint[], earlierAttempts = new Set<string>()) {
  const laneCalls = calls.filter((c): c is CloudCall & { attempt: string; sandboxId: string } => !!c.attempt && !!c.sandboxId);
  // An attempt of the Redis that lost its data has a token from a counter that started
  // again: no call of its may start once Redis is back (its confirmation went with the loss).
  let stale = 0;
  for (const c of laneCalls.filter((x) => earlierAttempts.has(x.attempt))) {
    stale++;
    note(`stale call on ${c.sandboxId}: ${c.method} ${c.path} by ${c.attempt}, an attempt from before the data loss, after Redis was back`);
  }
  const bySandbox = new Map<string, (FakeCall & { attempt: string })[]>();
  for (const c of laneCalls) if (!earlierAttempts.has(c.attempt)) bySandbox.set(c.sandboxId, [...(bySandbox.get(c.sandboxId) ?? []), c]);
  const jobOf = (attempt: string) => attempt.slice(0, attempt.lastIndexOf(':'));
  const fenceOf = (attempt: string) => Number(attempt.slice(attempt.lastIndexOf(':') + 1));
  let overlaps = 0;
  // A request whose worker was paused between the transport's last fence check and the write
  // system call leaves when the worker wakes: it arrives within moments of a SIGCONT. That
  // window is a documented limit (docs/reliability.md, "Limits"); such calls are counted
  // apart. Any other stale call is a violation.
  let sentBeforeFreeze = 0;
  const justResumed = (at: bigint) => resumedAt.some((r) => at >= r && at - r <= RESUMED_WITHIN_NS);
  const firstCall = new Map<string, bigint>();
  const ms = (a: bigint, b: bigint) => Number((a - b) / 1_000_000n);
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
        const frozenInSend = justResumed(c.start);
        if (frozenInSend) sentBeforeFreeze++;
        else stale++;
        const successorFirst = calls.find((x) => x.attempt === highestAttempt)!;
        const ownPrevious = calls.slice(0, i).filter((x) => x.attempt === c.attempt).at(-1);
        note(
          `stale call on ${sandbox}: ${c.method} ${c.path} by ${c.attempt} after ${highestAttempt} had called ` +
            `(${ms(c.start, successorFirst.start)} ms after the successor's first call; its own previous call ended ${ownPrevious ? `${ms(successorFirst.start, ownPrevious.end)} ms before that` : 'never'}); ` +
            `job: ${jobs.get(jobOf(c.attempt)) ?? '?'}` +
            (frozenInSend ? '; it arrived as a paused worker woke: sent in the check-to-write window (not counted)' : ''),
        );
      } else {
        highestFence = fence;
        highestAttempt = c.attempt;
      }
      const job = jobOf(c.attempt);
      if (!firstCall.has(job)) firstCall.set(job, c.start);
    }
  }
  return { overlaps, stale, sentBeforeFreeze, firstCall };
}

/**
 * Any two calls to one sandbox in flight at once, whoever made them (reads included),
 * compared with the call that ends last so far; a pair that spans the data loss is
 * counted apart.
 */
function sandboxCallOverlaps(calls: CloudCall[], lostAt: bigint, backAt: bigint, note: (line: string) => void) {
  const bySandbox = new Map<string, CloudCall[]>();
  for (const c of calls) if (c.sandboxId) bySandbox.set(c.sandboxId, [...(bySandbox.get(c.sandboxId) ?? []), c]);
  let overlaps = 0;
  let acrossLoss = 0;
  for (const [sandbox, list] of bySandbox) {
    list.sort((a, b) => (a.start < b.start ? -1 : a.start > b.start ? 1 : 0));
    let longest = list[0]!;
    for (const c of list.slice(1)) {
      if (c.start < longest.end) {
        if (longest.start < lostAt && c.start >= backAt) acrossLoss++;
        else {
          overlaps++;
          note(`calls overlap on ${sandbox}: ${c.method} ${c.path} (${c.attempt ?? 'no attempt'}) while ${longest.method} ${longest.path} (${longest.attempt ?? 'no attempt'}) ran`);
        }
      }
      if (c.end > longest.end) longest = c;
    }
  }
  return { overlaps, acrossLoss };
}

/** The independent checker, part two: the clouds' own call logs and sandboxes, and the phases' measures. */
function checkCalls(input: {
  /** Every call the clouds served, on the shared clock. */
  calls: CloudCall[];
  /** Sandboxes the fakes still run (or are making). */
  live: string[];
  main: MainRecords;
  lostAt: bigint;
  backAt: bigint;
  counts: { sigkill: number; sigterm: number; sigstop: number; double_stalls: number };
  resumedAt: bigint[];
  stalls: Map<string, number>;
  dataLoss: ChaosReport['data_loss'];
  stuck: StuckReport;
  scale: ScaleReport;
  seconds: number;
}): ChaosReport {
  const { calls, main, lostAt, backAt, counts, resumedAt } = input;
  const examples = [...main.examples];
  const note = (line: string) => examples.length < 20 && examples.push(line);

  // Fencing tokens start again after the data loss: lane checks look at each side apart.
  const before = laneCallChecks(calls.filter((c) => c.start < lostAt), note, main.jobs, resumedAt);
  const earlier = new Set(calls.filter((c) => c.start < lostAt && c.attempt).map((c) => c.attempt!));
  const after = laneCallChecks(calls.filter((c) => c.start >= backAt), note, main.jobs, resumedAt, earlier);
  const all = sandboxCallOverlaps(calls, lostAt, backAt, note);

  // Order: the main campaign's operations of a lease first reached the cloud in accepted
  // order. Force-stops may go ahead by design, so they are left out of the comparison.
  let orderViolations = 0;
  for (const [sandbox, order] of main.acceptedOrder) {
    const ranked = order.filter((id) => !main.jobs.get(id)?.startsWith('force-stop ') && before.firstCall.has(id));
    for (let i = 1; i < ranked.length; i++) {
      if (before.firstCall.get(ranked[i]!)! < before.firstCall.get(ranked[i - 1]!)!) {
        orderViolations++;
        note(`order on ${sandbox}: ${ranked[i]} reached the cloud before ${ranked[i - 1]}, accepted earlier`);
      }
    }
  }

  // The newly stuck sandbox: from its stop reaching the cloud to the force, less the budget.
  let unforced = Number.POSITIVE_INFINITY;
  const newly = input.stuck.newlyStuck;
  if (newly) {
    const own = calls.filter((c) => c.sandboxId === newly && c.method === 'POST' && c.path.endsWith('/stop')).sort((a, b) => (a.start < b.start ? -1 : 1));
    const stop = own.find((c) => !c.query.includes('force=true'));
    const force = own.find((c) => c.query.includes('force=true'));
    if (stop && force) unforced = Math.max(0, Number(force.start - stop.start) / 1e9 - STUCK_MS / 1000);
    else note(`the newly stuck sandbox ${newly} was ${force ? 'forced without a stop' : 'never forced'}`);
  }
  const maxStuckUnforced = Number(unforced.toFixed(2));
  if (maxStuckUnforced > STUCK_UNFORCED_BOUND_S) note(`the newly stuck sandbox stayed unforced ${maxStuckUnforced} s past its budget (bound ${STUCK_UNFORCED_BOUND_S} s)`);
  if (input.scale.max_blocked_lane_s > BLOCKED_LANE_BOUND_S) note(`a blocked lane waited ${input.scale.max_blocked_lane_s} s with ${input.scale.open_lanes} open (bound ${BLOCKED_LANE_BOUND_S} s)`);

  const orphans = input.live.filter((id) => !main.owned.has(id));
  for (const id of orphans.slice(0, 5)) note(`orphaned sandbox: ${id} runs, and no completed acquire handed it out`);
  return {
    accepted: main.accepted,
    completed: main.completed,
    failed: main.failed,
    failed_by_reason: main.failed_by_reason,
    failed_by_op: main.failed_by_op,
    overlaps: before.overlaps + after.overlaps,
    sandbox_call_overlaps: all.overlaps,
    overlaps_across_data_loss: all.acrossLoss,
    order_violations: orderViolations,
    lost: main.lost + input.dataLoss.lost_after + input.scale.lost,
    uncoded_failures: main.uncoded_failures,
    stale_calls: before.stale + after.stale,
    stale_calls_sent_before_freeze: before.sentBeforeFreeze + after.sentBeforeFreeze,
    blocked_lanes: main.blocked_lanes + input.scale.blocked_lanes,
    leftover_keys: main.leftover_keys,
    orphaned_sandboxes: orphans.length,
    kills: counts.sigkill + counts.sigterm + counts.sigstop,
    sigkill: counts.sigkill,
    sigterm: counts.sigterm,
    sigstop: counts.sigstop,
    double_stalls: counts.double_stalls,
    stalled: input.stalls.size,
    stalled_twice: [...input.stalls.values()].filter((n) => n >= 2).length,
    data_loss: input.dataLoss,
    stuck_for_good: input.stuck.stuck_for_good,
    max_stuck_unforced_s: maxStuckUnforced,
    stuck_unforced_bound_s: STUCK_UNFORCED_BOUND_S,
    open_lanes: input.scale.open_lanes,
    max_blocked_lane_s: input.scale.max_blocked_lane_s,
    blocked_by_removal_s: input.scale.blocked_by_removal_s,
    blocked_unannounced_s: input.scale.blocked_unannounced_s,
    blocked_lane_bound_s: BLOCKED_LANE_BOUND_S,
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
    control: ((cloud: 'daytona' | 'createos', id: string, controls: SandboxControls | CreateosControls) => ask<null>({ type: 'control', cloud, id2: id, controls })) as PhaseContext['control'],
    /** Every reply of both clouds this much later, from the next request on (0: as usual). */
    slow: (ms: number) => ask<null>({ type: 'slow', ms }),
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

/** The report as a table, violations first. */
export function formatReport(r: ChaosReport): string {
  const d = r.data_loss;
  const rows: [string, string][] = [
    ['operations accepted', String(r.accepted)],
    ['completed', String(r.completed)],
    ['failed', `${r.failed}${Object.keys(r.failed_by_reason).length ? ` (${Object.entries(r.failed_by_reason).map(([k, v]) => `${k} ${v}`).join(', ')})` : ''}`],
    ['overlaps (two attempts on one sandbox at once)', String(r.overlaps)],
    ['calls to one sandbox at once (any, reads included)', String(r.sandbox_call_overlaps)],
    ['order violations', String(r.order_violations)],
    ['lost operations', String(r.lost)],
    ['failures without a code', String(r.uncoded_failures)],
    ['calls by stale attempts after fencing', String(r.stale_calls)],
    ['  sent before a pause, arriving as the worker woke (a limit; not counted)', String(r.stale_calls_sent_before_freeze)],
    ['lanes left blocked', String(r.blocked_lanes)],
    ['lane keys left behind', String(r.leftover_keys)],
    ['orphaned sandboxes (running, owned by no lease)', String(r.orphaned_sandboxes)],
    ['worker kills (SIGKILL / SIGTERM / SIGSTOP past the lock)', `${r.kills} (${r.sigkill} / ${r.sigterm} / ${r.sigstop})`],
    ['double stalls; jobs stalled, twice or more', `${r.double_stalls}; ${r.stalled}, ${r.stalled_twice}`],
    ['Redis data loss: accepted before / ended before / gone', `${d.accepted_before} / ${d.ended_before} / ${d.lost_to_data_loss}`],
    ['  enqueued across the loss / of those ended', `${d.accepted_during} / ${d.ended_during}`],
    ['  enqueued after / lost after; schedules re-created', `${d.accepted_after} / ${d.lost_after}; ${d.schedules_recreated}`],
    ['  calls overlapping across the loss (not counted)', String(r.overlaps_across_data_loss)],
    ['stuck for good; newly stuck unforced past budget', `${r.stuck_for_good}; ${r.max_stuck_unforced_s} s (bound ${r.stuck_unforced_bound_s} s)`],
    ['open lanes; blocked ones waited: head removed / unannounced', `${r.open_lanes}; ${r.blocked_by_removal_s} s / ${r.blocked_unannounced_s} s (bound ${r.blocked_lane_bound_s} s)`],
    ['provider calls: Daytona / CreateOS (injected faults)', `${r.provider_calls - r.createos_calls} / ${r.createos_calls} (${r.injected_faults})`],
    ['stuck stops forced', String(r.forced_stops)],
    ['duration', `${r.seconds} s`],
  ];
  const w = Math.max(...rows.map(([k]) => k.length));
  return [...rows.map(([k, v]) => `${k.padEnd(w)}  ${v}`), ...r.examples.map((e) => `  ! ${e}`)].join('\n');
}

/** Violations that must be zero: every invariant, and each bound kept. */
export function violations(r: ChaosReport): number {
  return (
    r.overlaps +
    r.sandbox_call_overlaps +
    r.order_violations +
    r.lost +
    r.uncoded_failures +
    r.stale_calls +
    r.blocked_lanes +
    r.leftover_keys +
    r.orphaned_sandboxes +
    (r.data_loss.schedules_recreated ? 0 : 1) +
    (r.max_stuck_unforced_s <= r.stuck_unforced_bound_s ? 0 : 1) +
    (r.max_blocked_lane_s <= r.blocked_lane_bound_s ? 0 : 1)
  );
}
