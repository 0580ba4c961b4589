import { existsSync, mkdirSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Queue } from 'bullmq';
import { chromium, type Browser } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { LeaseOpsClient } from '../src/client.ts';
import { DaytonaFake } from '../src/fakes/daytona-fake.ts';
import type { LeaseIdentity } from '../src/lease.ts';
import { createDaytonaProvider } from '../src/providers/daytona/index.ts';
import type { LeaseTimeline } from '../src/queues/inspect.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { cli } from './helpers/cli.ts';
import { readUntil, TestBed, workerEnv } from './helpers/env.ts';

// Debian's chromium, installed by .ci/run (apt-get), driven by playwright-core: no browser download.
const CHROMIUM = process.env.LEASE_OPS_CHROMIUM ?? '/usr/bin/chromium';
const haveChromium = existsSync(CHROMIUM);
if (!haveChromium && process.env.CI) throw new Error(`${CHROMIUM} is missing; .ci/run installs Debian's chromium package`);

// The README shows these pictures: `LEASE_OPS_SCREENSHOTS=docs/images npx vitest run test/pages.test.ts`
// writes them there; otherwise they go to a temporary directory (and are still taken).
const SHOTS = process.env.LEASE_OPS_SCREENSHOTS ?? mkdtempSync(join(tmpdir(), 'lease-ops-shots-'));

const ADMIN = 'pages-admin-token-0123456789';
const ACME = 'pages-acme-token-0123456789';
const GLOBEX = 'pages-globex-token-0123456789';

describe.skipIf(!haveChromium)('the operator pages in a real browser: the stuck-stop incident on a lease timeline', () => {
  let bed: TestBed;
  let client: LeaseOpsClient;
  let api: TestApi;
  let fake: DaytonaFake;
  let browser: Browser;
  let lane: LeaseIdentity;
  let timeline: LeaseTimeline;
  let failedLease: LeaseIdentity;
  let stuckLease: LeaseIdentity;

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: ADMIN }, { token: ACME, companyId: 'acme' }, { token: GLOBEX, companyId: 'globex' }]),
      LEASE_OPS_KEEP_COMPLETED_S: '600',
      LEASE_OPS_STUCK_STOPPING_MS: '1500',
      LEASE_OPS_WATCHDOG_INTERVAL_MS: '250',
    });
    fake = new DaytonaFake({ apiKey: 'pages', timings: { create: 20, start: 150, stop: 150, forceStop: 80, destroy: 20 } });
    await bed.startWorker(createDaytonaProvider({ name: 'daytona', apiUrl: await fake.listen(), apiKey: 'pages' }));
    api = await startTestApi(bed);
    client = api.client;

    // The incident of the brief: a stop whose process ignores SIGTERM, a resume queued behind it.
    const lease: LeaseIdentity = { provider: 'daytona', companyId: 'acme', environmentId: 'prod', leaseId: 'new' };
    const acquired = await client.enqueue('acquire', lease, { runId: 'pages' });
    const sandbox = ((await client.waitForResult(acquired.jobId, 15_000)).result as { providerLeaseId: string }).providerLeaseId;
    fake.control(sandbox, { stuckStoppingMs: 30 * 60_000 });
    lane = { ...lease, leaseId: sandbox };
    await client.enqueue('stop', lane, { providerLeaseId: sandbox }, { deadlineMs: 20_000 });
    const resume = await client.enqueue('resume', lane, { providerLeaseId: sandbox, leaseMetadata: {} }, { deadlineMs: 20_000 });
    expect((await client.waitForResult(resume.jobId, 30_000)).state).toBe('completed');
    timeline = await client.getLeaseTimeline(lane);

    // A lease whose last operation failed, for the attention page.
    const other = await client.enqueue('acquire', { ...lease, leaseId: 'broken' }, { runId: 'pages-broken' });
    const broken = ((await client.waitForResult(other.jobId, 15_000)).result as { providerLeaseId: string }).providerLeaseId;
    fake.control(broken, { error: { recoverable: false, reason: 'disk quota exceeded' } });
    failedLease = { ...lease, leaseId: broken };
    const failed = await client.enqueue('resume', failedLease, { providerLeaseId: broken, leaseMetadata: {} }, { deadlineMs: 5_000 });
    expect((await client.waitForResult(failed.jobId, 15_000)).state).toBe('failed');

    // A lease stuck now: its sandbox stays stopping, the provider refuses every force-stop, so
    // the watchdog's force-stop (which jumps ahead of the stop) retries on and on; then paused.
    const third = await client.enqueue('acquire', { ...lease, leaseId: 'stuck' }, { runId: 'pages-stuck' });
    const stuckId = ((await client.waitForResult(third.jobId, 15_000)).result as { providerLeaseId: string }).providerLeaseId;
    fake.control(stuckId, { stuckStoppingMs: 30 * 60_000, refuseForceStops: 1_000_000 });
    stuckLease = { ...lease, leaseId: stuckId };
    await client.enqueue('stop', stuckLease, { providerLeaseId: stuckId }, { deadlineMs: 120_000 });
    await readUntil(async () => (await client.getLeaseTimeline(stuckLease)).events.filter((e) => e.kind === 'backing-off' && e.op === 'force-stop').length >= 4, 20_000, 'four retries of the force-stop');
    await client.pauseLane(stuckLease, 'pages-test');
    // The stop's retry overdue by more than a worker's pickup (1 s): from then on its bar reads waiting.
    await readUntil(async () => {
      const tl = await client.getLeaseTimeline(stuckLease);
      const until = tl.events.findLast((e) => e.kind === 'backing-off' && e.op === 'stop')?.until;
      return until !== undefined && tl.now - until > 1_200;
    }, 20_000, "the stop's retry to be overdue");

    browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'] });
    mkdirSync(SHOTS, { recursive: true });
  }, 90_000);

  afterAll(async () => {
    await browser?.close();
    await api?.close();
    await bed?.close();
    await fake?.close();
  });

  it('records the incident as events: the stop backing off while stopping, the watchdog, the force-stop, the resume', () => {
    const kinds = timeline.events.map((e) => `${e.kind}${e.op ? ` ${e.op}` : ''}`);
    // One watchdog event for its one force-stop, however many of its checks saw the sandbox stuck.
    expect(kinds.filter((k) => k === 'stuck force-stop')).toHaveLength(1);
    expect(kinds).toContain('accepted stop');
    expect(kinds).toContain('accepted resume');
    expect(kinds).toContain('backing-off stop');
    expect(kinds).toContain('stuck force-stop');
    expect(kinds).toContain('completed force-stop');
    expect(kinds).toContain('completed resume');
    // The resume waited behind the stop; the provider's "stopping" was seen, then "stopped", then "started".
    expect(timeline.events.find((e) => e.kind === 'accepted' && e.op === 'resume')?.ahead).toBeGreaterThanOrEqual(1);
    const states = timeline.events.filter((e) => e.kind === 'observed').map((e) => e.providerState);
    expect(states).toEqual(expect.arrayContaining(['stopping', 'stopped', 'running']));
    expect(states.indexOf('stopping')).toBeLessThan(states.lastIndexOf('running'));
    // Events come in Redis' time order.
    const times = timeline.events.map((e) => e.at);
    expect([...times].sort((a, b) => a - b)).toEqual(times);
  });

  it('draws the timeline with the watchdog force-stop visible, for an admin', async () => {
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ADMIN }, viewport: { width: 1280, height: 900 } });
    const page = await context.newPage();
    const response = await page.goto(`${api.base}/ui/leases/daytona/acme/prod/${encodeURIComponent(lane.leaseId)}`);
    expect(response?.status()).toBe(200);
    expect(response?.headers()['content-security-policy']).toContain("default-src 'none'");
    await page.locator('svg[aria-label="lease timeline"]').waitFor();
    // One row per operation; the force-stop's row carries the watchdog's mark and an attempt that completed.
    // One force-stop: its end saw the sandbox stopped, so the watchdog queues no second one.
    const force = page.locator('svg g[data-op="force-stop"]:has(.mark-stuck)');
    await expect.poll(() => force.count()).toBe(1);
    expect(await page.locator('svg g[data-op="force-stop"]').count()).toBe(1);
    expect(await force.locator('.mark-stuck').count()).toBe(1);
    expect(await force.locator('.mark-completed').count()).toBe(1);
    expect(await page.locator('svg g[data-op="stop"] .span-backoff').count()).toBeGreaterThan(0);
    expect(await page.locator('svg g[data-op="resume"] .span-waiting').count()).toBe(1);
    const body = await page.locator('body').innerText();
    expect(body).toContain('watchdog');
    expect(body).toMatch(/"stopping" for [\d.]+ s \(budget 1\.5 s\): force-stop 1 of at most/);
    expect(body).toContain(lane.leaseId);
    // The events table says the same, row by row.
    expect(await page.locator('tr[data-kind="stuck"]').count()).toBe(1);
    expect(await page.locator('tr[data-kind="observed"]').count()).toBeGreaterThanOrEqual(3);
    await page.screenshot({ path: join(SHOTS, 'timeline.png'), fullPage: true });
    await context.close();
  });

  it('lists what needs attention, linked to each lease timeline', async () => {
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ACME }, viewport: { width: 1280, height: 520 } });
    const page = await context.newPage();
    const response = await page.goto(`${api.base}/ui/`);
    expect(response?.status()).toBe(200);
    expect(new URL(page.url()).pathname).toBe('/ui/attention');
    const row = page.locator('tr:has([data-reason="operation_failed"])');
    await expect.poll(() => row.count()).toBe(1);
    // Each lease by the id it was acquired under, whichever name its operations used.
    expect(await row.innerText()).toContain('broken');
    // One row per lease: the stuck lease is stuck and paused, in one row with both reasons.
    const stuckRow = page.locator('tr:has([data-reason="stuck_stopping"])');
    expect(await stuckRow.count()).toBe(1);
    expect(await stuckRow.getAttribute('data-reasons')).toBe('stuck_stopping paused');
    expect(await stuckRow.innerText()).toContain('stuck');
    expect(await page.locator('tbody tr').count()).toBe(2);
    await page.screenshot({ path: join(SHOTS, 'attention.png'), fullPage: true });
    await row.locator('a').click();
    await page.waitForURL((url) => url.pathname === '/ui/leases/daytona/acme/prod/broken');
    expect(await page.locator('tr[data-kind="failed"]').count()).toBe(1);
    await context.close();
  });

  it('keeps a scoped token to its own company: another company cannot open the lease, nor list it', async () => {
    const path = `/ui/leases/daytona/acme/prod/${encodeURIComponent(lane.leaseId)}`;
    const as = async (token: string, url: string) => {
      const context = await browser.newContext({ httpCredentials: { username: 'operator', password: token } });
      try {
        const page = await context.newPage();
        const response = await page.goto(`${api.base}${url}`);
        return { status: response?.status(), text: await page.locator('body').innerText() };
      } finally {
        await context.close();
      }
    };
    const globex = await as(GLOBEX, path);
    expect(globex.status).toBe(404);
    expect(globex.text).not.toContain(lane.leaseId.slice(3));
    expect((await as(ACME, path)).status).toBe(200);
    const list = await as(GLOBEX, '/ui/attention');
    expect(list.status).toBe(200);
    expect(list.text).not.toContain(failedLease.leaseId);
    expect(list.text).toContain('Nothing needs attention');
    // The JSON behind it keeps the same scope.
    const json = await fetch(`${api.base}/v1/leases/daytona/acme/prod/${encodeURIComponent(lane.leaseId)}/timeline`, { headers: { authorization: `Bearer ${GLOBEX}` } });
    expect(json.status).toBe(404);
  });

  it('pauses and unpauses the lane from its page; refuses a change from another site or without an Origin', async () => {
    const path = `/ui/leases/daytona/acme/prod/${encodeURIComponent(lane.leaseId)}`;
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ADMIN } });
    const page = await context.newPage();
    await page.goto(`${api.base}${path}`);
    await page.getByRole('button', { name: 'Pause lane' }).click();
    await page.waitForURL((url) => url.pathname === path);
    expect(await page.locator('.facts').innerText()).toMatch(/paused by admin-1 \(page\)/);
    expect(await page.locator('tr[data-kind="paused"]').count()).toBe(1);
    expect((await client.getLease(lane)).paused?.by).toBe('admin-1 (page)');
    await page.getByRole('button', { name: 'Unpause lane' }).click();
    await page.waitForURL((url) => url.pathname === path);
    expect(await page.locator('tr[data-kind="unpaused"]').count()).toBe(1);
    expect((await client.getLease(lane)).paused).toBeNull();
    await context.close();

    const basic = (token: string) => `Basic ${Buffer.from(`x:${token}`).toString('base64')}`;
    const attempt = (headers: Record<string, string>) => fetch(`${api.base}${path}/pause`, { method: 'POST', headers, redirect: 'manual' });
    expect((await attempt({ authorization: basic(ADMIN), origin: 'https://evil.example' })).status).toBe(403);
    expect((await attempt({ authorization: basic(ADMIN) })).status).toBe(403);
    expect((await attempt({ authorization: basic(GLOBEX), origin: api.base })).status).toBe(404);
    expect((await client.getLease(lane)).paused).toBeNull();
    expect((await attempt({ authorization: basic(ACME), origin: api.base })).status).toBe(303);
    await client.unpauseLane(lane);
  });

  it('shows a stuck lease as stuck, its retries folded, the overtaken stop still waiting, every label inside its bar at 1400 px, every time in ISO UTC', async () => {
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ADMIN }, viewport: { width: 1400, height: 900 } });
    const page = await context.newPage();
    const path = `/ui/leases/daytona/acme/prod/${encodeURIComponent(stuckLease.leaseId)}`;
    expect((await page.goto(`${api.base}${path}`))?.status()).toBe(200);
    // The badges say what the lease is now, as the API and the CLI do.
    const view = await client.getLease(stuckLease);
    expect(view.stuck).toMatchObject({ budgetMs: 1_500 });
    expect(await page.locator('[data-badge="stuck"]').innerText()).toMatch(/^stuck stopping for /);
    expect(await page.locator('[data-badge="paused"]').count()).toBe(1);
    const status = await cli(['status', '--provider', 'daytona', '--company', 'acme', '--environment', 'prod', '--lease', stuckLease.leaseId], workerEnv(bed, { LEASE_OPS_STUCK_STOPPING_MS: '1500' }));
    expect(status.stdout).toMatch(/STUCK: +stopping since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \(.* ago\), past the budget of 1\.50 s/);
    expect(status.stdout).toMatch(/PAUSED: +by pages-test since \d{4}-/);
    // The maintenance pass that queued it says so on its card (its return value), as each sweep says what it repaired.
    const maintenance = new Queue(`${bed.config.LEASE_OPS_QUEUE}-maintenance`, { connection: bed.redis, prefix: bed.config.LEASE_OPS_PREFIX });
    const passes = await maintenance.getCompleted(0, 199);
    await maintenance.close();
    expect(passes.filter((p) => (p.returnvalue as { queued?: number } | null)?.queued).length).toBeGreaterThanOrEqual(1);
    expect(passes.some((p) => p.returnvalue && 'handedOff' in (p.returnvalue as object))).toBe(true);
    // The force-stop the watchdog queued is counted.
    expect(Number(await page.locator('[data-fact="force-stops"]').innerText())).toBeGreaterThanOrEqual(1);
    // The force-stop's retries: one bar, and one row of the table holding its raw events.
    const forceRow = page.locator('svg g[data-op="force-stop"]').first();
    expect(await forceRow.locator('rect.span-backoff title').first().textContent()).toMatch(/^\d+ attempts retried, last backing off: /);
    const retries = page.locator('tr[data-kind="retries"]', { hasText: 'force-stop: attempts' }).first();
    const count = Number(await retries.getAttribute('data-count'));
    expect(count).toBeGreaterThanOrEqual(3);
    expect(await retries.innerText()).toMatch(/force-stop: attempts \d+–\d+ each ended with \S+ and were retried/);
    expect(await retries.locator('details tr[data-kind="backing-off"]').count()).toBe(count);
    // The stop the force-stop overtook is still queued: its bar runs to now (the plot's right end).
    const stopBars = page.locator('svg g[data-op="stop"] rect');
    const last = stopBars.last();
    expect(await last.getAttribute('class')).toBe('span-waiting');
    const right = Number(await last.getAttribute('x')) + Number(await last.getAttribute('width'));
    expect(right).toBeGreaterThan(1200 - 16 - 3);
    // No label runs out of its bar or under another bar (labels are drawn last), none is cut by the page.
    const escaped = await page.evaluate(() => {
      // The browser's document (this file compiles without the DOM's types).
      type El = { textContent: string | null; getAttribute(n: string): string | null; getBoundingClientRect(): { left: number; right: number; width: number }; querySelectorAll(q: string): El[]; querySelector(q: string): El | null };
      const doc = (globalThis as unknown as { document: El }).document;
      const bad: string[] = [];
      const svg = doc.querySelector('svg[aria-label="lease timeline"]')!;
      const box = svg.getBoundingClientRect();
      for (const text of svg.querySelectorAll('text')) {
        const t = text.getBoundingClientRect();
        if (t.left < box.left - 0.5 || t.right > box.right + 0.5) bad.push(`outside the picture: ${text.textContent}`);
        const id = text.getAttribute('data-label-of');
        if (id === null) continue;
        const r = svg.querySelector(`rect[data-bar="${id}"]`)!.getBoundingClientRect();
        if (t.left < r.left - 0.5 || t.right > r.right + 0.5) bad.push(`${text.textContent}: ${t.left.toFixed(1)}-${t.right.toFixed(1)} outside ${r.left.toFixed(1)}-${r.right.toFixed(1)}`);
      }
      for (const name of svg.querySelectorAll('text.row-name')) if (name.getBoundingClientRect().right > box.left + 240 * (box.width / 1200)) bad.push(`row name: ${name.textContent}`);
      // No bar runs out of the picture either (the sandbox's last state runs until now).
      for (const bar of svg.querySelectorAll('rect[data-bar]')) {
        const r = bar.getBoundingClientRect();
        if (r.left < box.left - 0.5 || r.right > box.right + 0.5) bad.push(`bar ${bar.getAttribute('data-bar')} outside the picture`);
      }
      return bad;
    });
    expect(escaped).toEqual([]);
    expect(await page.locator('svg text[data-label-of]').count()).toBeGreaterThan(0);
    // One format for a moment: every <time> is ISO 8601 UTC, and no other clock format shows.
    const times = await page.locator('time').evaluateAll((els) => els.map((el) => [el.getAttribute('datetime'), el.textContent]));
    expect(times.length).toBeGreaterThan(5);
    for (const [iso, text] of times) {
      expect(iso).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
      expect(text!.startsWith(iso!)).toBe(true);
    }
    const body = await page.locator('body').innerText();
    expect(body).not.toMatch(/\b\d{1,2}:\d\d:\d\d (?:AM|PM)\b/);
    expect(body.replace(/\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z/g, '')).not.toMatch(/\d\d:\d\d:\d\d/);
    expect(body).not.toMatch(/\b1[6-9]\d{11}\b/);
    await page.screenshot({ path: join(SHOTS, 'timeline-stuck.png'), fullPage: true });
    await context.close();
  });

  it('acknowledges a lease\'s failures from its page: the attention list lets it go, its history keeps it', async () => {
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ACME }, viewport: { width: 1400, height: 900 } });
    const page = await context.newPage();
    const path = `/ui/leases/daytona/acme/prod/${encodeURIComponent(failedLease.leaseId)}`;
    await page.goto(`${api.base}${path}`);
    expect(await page.locator('[data-badge="failed"]').count()).toBe(1);
    await page.screenshot({ path: join(SHOTS, 'timeline-failed.png'), fullPage: true });
    await page.getByRole('button', { name: 'Acknowledge failures' }).click();
    await page.waitForURL((url) => url.pathname === path);
    expect(await page.locator('[data-badge="failed"]').count()).toBe(0);
    expect(await page.locator('tr[data-kind="acknowledged"]').count()).toBe(1);
    expect(await page.locator('tr[data-kind="failed"]').count()).toBe(1);
    expect((await client.getLease(failedLease)).lastFailure).toBeNull();
    await page.goto(`${api.base}/ui/attention`);
    expect(await page.locator('body').innerText()).not.toContain(failedLease.leaseId);
    expect(await page.locator(`tr:has([data-reason="stuck_stopping"])`).count()).toBe(1);
    await context.close();
  });

  it('cancels a queued operation and runs a failed one again from the lease page; /metrics counts one stuck-stopping observation per force-stop queued', async () => {
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ACME }, viewport: { width: 1400, height: 900 } });
    const page = await context.newPage();
    // The stop the force-stop overtook waits in the paused lane: its row has a Cancel button.
    const stuckPath = `/ui/leases/daytona/acme/prod/${encodeURIComponent(stuckLease.leaseId)}`;
    await page.goto(`${api.base}${stuckPath}`);
    const stop = (await client.getLease(stuckLease)).queued.find((o) => o.op === 'stop')!;
    await page.locator(`tr[data-job="${stop.jobId}"]`).getByRole('button', { name: 'Cancel' }).click();
    await page.waitForURL((url) => url.pathname === stuckPath);
    expect((await client.getOperation(stop.jobId))?.error?.code).toBe('cancelled');
    expect(await page.locator('tr[data-kind="cancelled"]').count()).toBe(1);
    // The failed resume runs again: it joins the lane's tail (and fails again: the sandbox still refuses).
    const failedPath = `/ui/leases/daytona/acme/prod/${encodeURIComponent(failedLease.leaseId)}`;
    await page.goto(`${api.base}${failedPath}`);
    const failed = (await client.getLeaseTimeline(failedLease)).operations.find((o) => o.state === 'failed')!;
    await page.locator(`tr[data-job="${failed.jobId}"]`).getByRole('button', { name: 'Run again' }).click();
    await page.waitForURL((url) => url.pathname === failedPath);
    expect(await page.locator('tr[data-kind="rerun"]').count()).toBe(1);
    expect((await client.waitForResult(failed.jobId, 15_000)).error?.code).toBe(failed.error?.code);
    await context.close();

    // lease_ops_stuck_stopping_seconds: an observation each time the watchdog queued a force-stop.
    const metrics = await (await fetch(`${api.base}/metrics`)).text();
    const observed = Number(/^lease_ops_stuck_stopping_seconds_count\{provider="daytona"\} (\d+)$/m.exec(metrics)?.[1]);
    const queued = (await Promise.all([lane, stuckLease].map((l) => client.getLeaseTimeline(l)))).flatMap((t) => t.events).filter((e) => e.kind === 'stuck').length;
    expect(observed).toBe(queued);
  });

  it("the Grafana dashboard queries only series /metrics exports, with the labels and values it filters on", async () => {
    const dashboard = JSON.parse(readFileSync(new URL('../docs/grafana/lease-ops.json', import.meta.url), 'utf8')) as {
      title: string;
      panels: { title: string; datasource: { uid: string }; targets: { expr: string }[] }[];
      templating: { list: { name: string; definition?: string }[] };
    };
    const metrics = await (await fetch(`${api.base}/metrics`)).text();
    const samples = metrics.split('\n').filter((line) => line && !line.startsWith('#'));
    const exprs = [...dashboard.panels.flatMap((p) => p.targets.map((t) => t.expr)), ...dashboard.templating.list.flatMap((v) => (v.definition ? [v.definition] : []))];
    expect(dashboard.panels.map((p) => p.title)).toEqual(
      expect.arrayContaining(['Operations by outcome', 'Retries by kind', 'Queue depth by state', 'Leases needing attention', 'Stuck in stopping before a force-stop', 'Force-stops (last hour)']),
    );
    for (const panel of dashboard.panels) expect(panel.datasource.uid).toBe('${datasource}');
    const missing: string[] = [];
    for (const expr of exprs) {
      const names = [...new Set(expr.match(/\b(?:lease_ops|bullmq)_[a-z0-9_]+/g) ?? [])];
      expect(names.length, expr).toBeGreaterThan(0);
      const lines = samples.filter((line) => names.some((name) => line.startsWith(`${name}{`) || line.startsWith(`${name} `)));
      for (const name of names) if (!lines.some((line) => line.startsWith(`${name}{`) || line.startsWith(`${name} `))) missing.push(`${name} (in ${expr})`);
      // Labels it groups by (Prometheus adds job and instance at scrape time; le is the buckets').
      for (const group of expr.matchAll(/by \(([^)]+)\)/g)) {
        for (const label of group[1]!.split(',').map((l) => l.trim())) {
          if (['job', 'instance', 'le'].includes(label)) continue;
          if (!lines.some((line) => line.includes(`${label}="`))) missing.push(`label ${label} (in ${expr})`);
        }
      }
      // Values it filters on.
      for (const [, label, values] of expr.matchAll(/(\w+)=~?"([^"$]+)"/g)) {
        for (const value of values!.split('|')) if (!lines.some((line) => line.includes(`${label}="${value}"`))) missing.push(`${label}="${value}" (in ${expr})`);
      }
    }
    expect(missing).toEqual([]);
  });

  it('took its screenshots where it was told', () => {
    for (const name of ['timeline.png', 'attention.png', 'timeline-stuck.png', 'timeline-failed.png']) expect(existsSync(join(SHOTS, name))).toBe(true);
  });
});
