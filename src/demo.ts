import { randomBytes } from 'node:crypto';
import { writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { esc, timelineSvg } from './api/pages.ts';
import { timelineText } from './charts.ts';
import { LeaseOpsClient } from './client.ts';
import { loadConfig, type Config } from './config.ts';
import { DaytonaFake } from './fakes/daytona-fake.ts';
import type { LeaseIdentity } from './lease.ts';
import type { LeaseTimeline } from './queues/inspect.ts';
import { createLogger } from './logger.ts';
import { createDaytonaProvider } from './providers/daytona/index.ts';
import { ProviderRegistry } from './providers/registry.ts';
import { createRedis, deleteKeysUnder } from './queues/redis.ts';
import { LeaseWorker } from './queues/worker.ts';
import { redisOrPrivate } from './redis-server.ts';
import { maskUrl } from './secrets.ts';

const out = (line: string) => process.stdout.write(`${line}\n`);

export interface Timing {
  stuckMs: number;
  scanMs: number;
  deadlineMs: number;
  /** How long the fake's start, stop and force-stop take. */
  transitionMs: number;
}

/**
 * Replays the incident from the brief against the local Daytona fake: a sandbox whose stop
 * ignores SIGTERM, a resume queued behind the stop. With the watchdog the stop is forced
 * after the graceful budget and the resume completes; without it, the resume waits until
 * the deadline. Prints a timeline of each.
 */
export async function runDemo(opts: { quick: boolean; out?: string }): Promise<{ withWatchdogS: number; withoutWatchdog: string; file: string }> {
  // The real defaults (30 s budget, 5 s scans, 60 s resume deadline), or a tenth of them.
  const t: Timing = opts.quick
    ? { stuckMs: 3_000, scanMs: 500, deadlineMs: 6_000, transitionMs: 100 }
    : REAL_TIMING;
  const base = loadConfig({ LEASE_OPS_LOG_LEVEL: 'silent', ...process.env });
  const { url, privateRedis } = await redisOrPrivate(base.REDIS_URL, (u) => out(`(no Redis at ${maskUrl(base.REDIS_URL)}; using a private one at ${u})`));
  const config = { ...base, REDIS_URL: url };
  try {
    out(`The incident: a stop whose process ignores SIGTERM leaves the sandbox "stopping"; a resume waits behind it.`);
    out(`Graceful-stop budget ${t.stuckMs / 1000} s, watchdog scan every ${t.scanMs / 1000} s, resume deadline ${t.deadlineMs / 1000} s.\n`);
    out('With the stuck-stop watchdog:');
    const on = await scenario(config, t, true);
    out(`\nWithout it (the same, watchdog off):`);
    const off = await scenario(config, t, false);
    out(`\nResume with the watchdog: ${on.summary}. Without: ${off.summary}.`);
    const file = resolve(opts.out ?? join(tmpdir(), 'lease-ops-demo.html'));
    writeFileSync(file, demoPage(t, [['With the stuck-stop watchdog', on], ['Without it', off]]));
    out(`The two timelines, drawn: ${file}`);
    return { withWatchdogS: on.seconds, withoutWatchdog: off.summary, file };
  } finally {
    privateRedis?.stop();
  }
}

export const REAL_TIMING: Timing = { stuckMs: 30_000, scanMs: 5_000, deadlineMs: 60_000, transitionMs: 1_000 };

/** Prefixes of scenarios running now: an interrupted run (the bench on Ctrl-C) deletes their keys. */
export const runningScenarioPrefixes = new Set<string>();

export async function scenario(base: Config, t: Timing, watchdog: boolean, print = true): Promise<{ seconds: number; summary: string; prefix: string; timeline: LeaseTimeline | null }> {
  const out = print ? (line: string) => process.stdout.write(`${line}\n`) : () => undefined;
  const prefix = `{lease-ops-demo-${randomBytes(3).toString('hex')}}`;
  runningScenarioPrefixes.add(prefix);
  const config: Config = {
    ...base,
    LEASE_OPS_PREFIX: prefix,
    LEASE_OPS_WATCHDOG: watchdog,
    LEASE_OPS_STUCK_STOPPING_MS: t.stuckMs,
    LEASE_OPS_WATCHDOG_INTERVAL_MS: t.scanMs,
    LEASE_OPS_KEEP_COMPLETED_S: 3_600,
  };
  const tr = t.transitionMs;
  const fake = new DaytonaFake({ apiKey: 'demo', timings: { create: tr / 5, start: tr, stop: tr, forceStop: tr / 2, destroy: tr / 5 } });
  const provider = createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'demo' });
  const worker = new LeaseWorker(config, new ProviderRegistry([provider]), createLogger({ level: 'silent' }));
  await worker.start();
  const client = new LeaseOpsClient(config);
  const started = Date.now();
  const at = () => `t+${((Date.now() - started) / 1000).toFixed(1).padStart(5)}s`;
  const names = new Map<string, string>();
  const events = await client.queueEventStream();
  const say = (jobId: string, what: string) => {
    const line = (name: string) => out(`  ${at()}  ${name.padEnd(22)} ${what}`);
    const known = names.get(jobId);
    if (known) return line(known);
    // Not enqueued by the demo (the watchdog's force-stop), or its event came first.
    void client.ops.queue.getJob(jobId).then((job) => line(job?.name === 'force-stop' ? 'force-stop (watchdog)' : (job?.name ?? '?')));
  };
  events.on('active', ({ jobId }) => say(jobId, 'picked up'));
  events.on('delayed', ({ jobId }) => say(jobId, 'waits: settling retry, or not its turn'));
  events.on('completed', ({ jobId }) => say(jobId, 'completed'));
  events.on('failed', ({ jobId, failedReason }) => say(jobId, `failed: ${failedReason}`));
  try {
    const lease: LeaseIdentity = { provider: 'daytona', companyId: 'demo', environmentId: 'demo', leaseId: 'new' };
    const acquired = await client.enqueue('acquire', lease, { runId: 'demo' });
    names.set(acquired.jobId, 'acquire');
    const sandbox = ((await client.waitForResult(acquired.jobId, 30_000)).result as { providerLeaseId: string }).providerLeaseId;
    fake.control(sandbox, { stuckStoppingMs: 30 * 60_000 }); // SIGTERM ignored: "stopping" for half an hour
    const lane = { ...lease, leaseId: sandbox };
    const stop = await client.enqueue('stop', lane, { providerLeaseId: sandbox }, { deadlineMs: t.deadlineMs });
    names.set(stop.jobId, 'stop');
    const resumeAt = Date.now();
    const resume = await client.enqueue('resume', lane, { providerLeaseId: sandbox, leaseMetadata: {} }, { deadlineMs: t.deadlineMs });
    names.set(resume.jobId, 'resume');
    const result = await client.waitForResult(resume.jobId, t.deadlineMs * 3);
    const seconds = (Date.now() - resumeAt) / 1000;
    out(`  ${at()}  sandbox is ${fake.stateOf(sandbox)}`);
    // The lease's own record of it, as the timeline page draws it.
    const timeline = await client.getLeaseTimeline(lane);
    out(`\n${timelineText(timeline)
      .split('\n')
      .map((line) => `  ${line}`)
      .join('\n')}`);
    return {
      timeline,
      seconds,
      prefix: config.LEASE_OPS_PREFIX,
      summary: result.state === 'completed' ? `completed ${seconds.toFixed(1)} s after it was queued` : `failed after ${seconds.toFixed(1)} s (${result.error ? `${result.error.code}: ${result.error.message}` : 'failed'})`,
    };
  } finally {
    await client.close();
    await worker.close();
    await fake.close();
    // The demo's keys go with it: a run leaves nothing in the Redis it used.
    const redis = createRedis(config.REDIS_URL);
    await deleteKeysUnder(redis, config.LEASE_OPS_PREFIX).finally(() => redis.disconnect());
    runningScenarioPrefixes.delete(prefix);
  }
}

/** The demo's two timelines in one page of its own (no server needed to look at it). */
function demoPage(t: Timing, runs: [string, { summary: string; timeline: LeaseTimeline | null }][]): string {
  const sections = runs
    .map(([title, run]) => `<h2>${esc(title)}</h2><p>Resume ${esc(run.summary)}.</p>${run.timeline ? timelineSvg(run.timeline) : '<p>(no timeline)</p>'}`)
    .join('');
  return `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>lease-ops demo: the stuck stop</title>
<style>body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d2430}svg{border:1px solid #dde1e7;border-radius:6px}</style></head>
<body><h1>The stuck-stop incident</h1><p>A stop whose process ignores SIGTERM leaves the sandbox "stopping"; a resume waits behind it. Graceful-stop budget ${t.stuckMs / 1000} s, watchdog scan every ${t.scanMs / 1000} s, resume deadline ${t.deadlineMs / 1000} s.
Grey: waiting in the lane; amber: attempts that ended for a retry, then backoffs; green: completed; red: failed; purple diamond: the watchdog's force-stop. Top row: the sandbox's state as lease-ops observed it.</p>${sections}</body></html>
`;
}
