import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { LeaseOpsClient } from './client.ts';
import type { OperationState } from './queues/inspect.ts';

/**
 * Prometheus metrics (prom-client). Each process has one registry: a worker replica counts
 * the attempts it ran; the API process adds gauges read from Redis at scrape time (queue
 * depth by state, leases needing attention) and BullMQ's own queue metrics. Scrape every
 * replica, as Prometheus does; `lease-ops start` has it all in one process.
 */
export const registry = new Registry();

let processMetrics = false;
/**
 * Adds the process metrics (CPU, memory, event-loop delay, GC) to the registry. Called by
 * whatever serves /metrics: their observers cost a little on every GC and every few ms,
 * which a worker that nobody scrapes should not pay.
 */
export function enableProcessMetrics(): void {
  if (processMetrics) return;
  processMetrics = true;
  collectDefaultMetrics({ register: registry, prefix: 'lease_ops_process_' });
}

export type AttemptOutcome = 'completed' | 'failed' | 'retry' | 'stale';

const operations = new Counter({
  name: 'lease_ops_operations_total',
  help: 'Operations that ended, by type and outcome (completed or failed)',
  labelNames: ['op', 'outcome'] as const,
  registers: [registry],
});
const attemptSeconds = new Histogram({
  name: 'lease_ops_attempt_duration_seconds',
  help: 'Duration of one attempt of an operation, by type and how it ended (completed, failed, retry, stale)',
  labelNames: ['op', 'outcome'] as const,
  buckets: [0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300],
  registers: [registry],
});
const retries = new Counter({
  name: 'lease_ops_retries_total',
  help: 'Attempts that ended in a delayed retry, by type and error kind (settling or transient)',
  labelNames: ['op', 'kind'] as const,
  registers: [registry],
});

const settleWaits = new Counter({
  name: 'lease_ops_settle_waits_total',
  help: 'Waits of an attempt for a settling sandbox\'s pushed state change, by how they ended: changed (the attempt went on), timed_out (it backed off), stopped (lock lost or worker closing)',
  labelNames: ['op', 'outcome'] as const,
  registers: [registry],
});

const settleWaiting = new Gauge({
  name: 'lease_ops_settle_waits_in_progress',
  help: 'Attempts of this process waiting now for a settling sandbox\'s pushed state change (each holds its lane and a worker slot)',
  registers: [registry],
});

/** An attempt begins to wait for a pushed state change. */
export function settleWaitBegan(): void {
  settleWaiting.inc();
}

/** An attempt's wait for a pushed state change ended (`cannot_push`: it never began: not counted). */
export function settleWaitEnded(op: string, outcome: 'changed' | 'timed_out' | 'stopped' | 'cannot_push'): void {
  settleWaiting.dec();
  if (outcome !== 'cannot_push') settleWaits.inc({ op, outcome });
}

const forceStops = new Counter({
  name: 'lease_ops_force_stops_total',
  help: "Force-stops by outcome: queued by the watchdog, succeeded, or refused by the provider (state_change_in_progress)",
  labelNames: ['provider', 'outcome'] as const,
  registers: [registry],
});
const stuckStopping = new Histogram({
  name: 'lease_ops_stuck_stopping_seconds',
  help: 'How long a sandbox had been stopping when the watchdog queued a force-stop for it',
  labelNames: ['provider'] as const,
  buckets: [5, 15, 30, 60, 120, 300, 600, 1800, 3600],
  registers: [registry],
});

/** A force-stop was queued by the watchdog, succeeded, or was refused (see telemetry.forceStop). */
export function forceStopCounted(provider: string, outcome: 'queued' | 'succeeded' | 'refused'): void {
  forceStops.inc({ provider, outcome });
}

/** The watchdog queued a force-stop for a sandbox stopping this long. */
export function stuckStoppingObserved(provider: string, seconds: number): void {
  stuckStopping.observe({ provider }, seconds);
}

/** Called by the worker when an attempt ends. */
export function attemptEnded(op: string, outcome: AttemptOutcome, seconds: number, retryKind?: string): void {
  attemptSeconds.observe({ op, outcome }, seconds);
  if (outcome === 'completed' || outcome === 'failed') operations.inc({ op, outcome });
  if (outcome === 'retry') retries.inc({ op, kind: retryKind ?? 'unknown' });
}

/**
 * Gauges read from Redis when scraped, plus BullMQ's own metrics (bullmq_job_count by state,
 * and with LEASE_OPS_BULLMQ_METRICS its completed and failed totals). Returns the function
 * that renders the whole exposition.
 */
/** What the API's wait budget reports (src/api/wait-budget.ts). */
export interface WaitUsage {
  usage(): { total: number; busiestCompany: number };
  readonly refused: { company: number; server: number };
}

export function queueMetrics(
  client: LeaseOpsClient,
  opts: { bullmqTotals: boolean; waits?: WaitUsage; rates?: { readonly refused: number }; turns?: { usage(): { inProgress: number; waiting: number } }; connections?: { readonly size: number; readonly evicted: number; readonly overPipelined: number }; walks?: { readonly commandsByCompany: ReadonlyMap<string, number>; readonly walksByThread: { readonly foreground: number; readonly background: number } } },
): () => Promise<string> {
  enableProcessMetrics();
  const queueRegistry = new Registry();
  const depth = new Gauge({
    name: 'lease_ops_operations',
    help: 'Operations by state: queued (waiting in a lane), ready, running, backing-off, paused (waiting in a lane an operator paused), completed, failed (retained)',
    labelNames: ['state'] as const,
    registers: [queueRegistry],
  });
  const lanes = new Gauge({ name: 'lease_ops_lanes_open', help: 'Leases with operations in their lane', registers: [queueRegistry] });
  const attention = new Gauge({
    name: 'lease_ops_leases_needing_attention',
    help: 'Leases with each reason: stuck stopping, an operation failed and not made good, lane paused (exact), lane blocked (among the first 200 quiet lanes and running jobs); a lease with two reasons counts under both (lease_ops_attention_leases counts each once)',
    labelNames: ['reason'] as const,
    registers: [queueRegistry],
  });
  const attentionLeases = new Gauge({
    name: 'lease_ops_attention_leases',
    help: 'Leases needing attention, each once whatever its reasons (the count status and the attention page say); blocked ones among the first 200 looked at',
    registers: [queueRegistry],
  });
  const blocked = new Gauge({ name: 'lease_ops_leases_blocked', help: 'Leases whose lane head has not moved for too long', registers: [queueRegistry] });
  const waitsHeld = new Gauge({ name: 'lease_ops_api_waits', help: 'Requests holding their connection while they wait (long polls, Prefer: wait, exec): in all, and of the company holding the most', labelNames: ['of'] as const, registers: [queueRegistry] });
  const waitsRefused = new Gauge({ name: 'lease_ops_api_waits_refused_total', help: 'Waits refused because a budget was full: a company (company_waits_full) or the server (server_waits_full)', labelNames: ['budget'] as const, registers: [queueRegistry] });
  const rateLimited = new Gauge({ name: 'lease_ops_api_rate_limited_total', help: 'Requests refused because their company was past its rate (company_rate_limited)', registers: [queueRegistry] });
  const bytesHeld = new Gauge({ name: 'lease_ops_company_bytes', help: "Redis bytes a company's operations are counted as holding (data plus an allowance each), against LEASE_OPS_MAX_BYTES_PER_COMPANY", labelNames: ['company'] as const, registers: [queueRegistry] });
  const requests = new Gauge({ name: 'lease_ops_api_requests', help: "Companies' requests in this API process: in progress (with a turn, LEASE_OPS_API_REQUESTS_PER_COMPANY) and waiting for one", labelNames: ['state'] as const, registers: [queueRegistry] });
  const connections = new Gauge({ name: 'lease_ops_api_connections', help: 'Connections open to this API process (at most LEASE_OPS_API_MAX_CONNECTIONS)', registers: [queueRegistry] });
  const closedConnections = new Gauge({
    name: 'lease_ops_api_connections_closed_total',
    help: 'Connections the API closed: idle ones to let a new one in at LEASE_OPS_API_MAX_CONNECTIONS (evicted), and ones with more than 16 pipelined requests unanswered (over_pipelined)',
    labelNames: ['reason'] as const,
    registers: [queueRegistry],
  });
  const walkCommands = new Gauge({
    name: 'lease_ops_api_walk_commands_total',
    help: "Redis commands each company's walks (attention, timelines) sent from the API's walk threads, which its walk rate holds to a budget (LEASE_OPS_API_COMPANY_RATES: a token for each 500)",
    labelNames: ['company'] as const,
    registers: [queueRegistry],
  });
  const walksByThread = new Gauge({
    name: 'lease_ops_api_walks_total',
    help: "Walks (attention, timelines, the overview, their pages) sent to the API's walk threads, by thread: background ones run at nice 10 and take only the walks of a company and kind that sent over 2,000 Redis commands in one walk in the last 10 minutes, foreground ones all others",
    labelNames: ['thread'] as const,
    registers: [queueRegistry],
  });
  return async () => {
    if (opts.rates) rateLimited.set(opts.rates.refused);
    if (opts.walks) {
      for (const [company, commands] of opts.walks.commandsByCompany) walkCommands.set({ company }, commands);
      walksByThread.set({ thread: 'foreground' }, opts.walks.walksByThread.foreground);
      walksByThread.set({ thread: 'background' }, opts.walks.walksByThread.background);
    }
    if (opts.connections) {
      connections.set(opts.connections.size);
      closedConnections.set({ reason: 'evicted' }, opts.connections.evicted);
      closedConnections.set({ reason: 'over_pipelined' }, opts.connections.overPipelined);
    }
    if (opts.turns) {
      const { inProgress, waiting } = opts.turns.usage();
      requests.set({ state: 'in_progress' }, inProgress);
      requests.set({ state: 'waiting' }, waiting);
    }
    if (opts.waits) {
      const { total, busiestCompany } = opts.waits.usage();
      waitsHeld.set({ of: 'all' }, total);
      waitsHeld.set({ of: 'busiest_company' }, busiestCompany);
      waitsRefused.set({ budget: 'company' }, opts.waits.refused.company);
      waitsRefused.set({ budget: 'server' }, opts.waits.refused.server);
    }
    const gauges = await client.gauges();
    for (const [state, n] of Object.entries(gauges.counts) as [OperationState, number][]) depth.set({ state }, n);
    lanes.set(gauges.openLanes);
    attentionLeases.set(gauges.attentionLeases);
    bytesHeld.reset();
    for (const [company, bytes] of Object.entries(gauges.bytesByCompany)) bytesHeld.set({ company }, bytes);
    for (const [reason, n] of Object.entries(gauges.attentionByReason)) attention.set({ reason }, n);
    blocked.set(gauges.attentionByReason.blocked);
    const [own, queue, bullmq] = await Promise.all([
      registry.metrics(),
      queueRegistry.metrics(),
      client.partitions.length === 1
        ? client.ops.queue.exportPrometheusMetrics()
        : Promise.all(client.partitions.map((p) => p.ops.queue.exportPrometheusMetrics({ partition: String(p.index) }))).then(mergeExpositions),
    ]);
    // Without LEASE_OPS_BULLMQ_METRICS the workers keep no totals, and a counter stuck at 0
    // would mislead: leave those two out (lease_ops_operations_total has the same counts).
    const bullmqLines = opts.bullmqTotals ? bullmq : bullmq.split('\n').filter((l) => !/^(# (HELP|TYPE) )?bullmq_job_(completed|failed)_total/.test(l)).join('\n');
    return `${own}\n${queue}\n${bullmqLines}\n`;
  };
}

/**
 * Several Prometheus expositions of the same metrics (one per partition, each sample labelled
 * with its partition) as one: each metric's HELP and TYPE once, its samples together.
 */
export function mergeExpositions(texts: string[]): string {
  const families = new Map<string, { meta: string[]; samples: string[] }>();
  const family = (name: string) => {
    let f = families.get(name);
    if (!f) families.set(name, (f = { meta: [], samples: [] }));
    return f;
  };
  for (const text of texts) {
    for (const line of text.split('\n')) {
      if (!line.trim()) continue;
      const meta = /^# (HELP|TYPE) (\S+)/.exec(line);
      if (meta) {
        const f = family(meta[2]!);
        if (!f.meta.some((m) => m.startsWith(`# ${meta[1]} `))) f.meta.push(line);
      } else {
        family(/^[^{\s]+/.exec(line)![0]).samples.push(line);
      }
    }
  }
  return [...families.values()].flatMap((f) => [...f.meta, ...f.samples]).join('\n');
}
