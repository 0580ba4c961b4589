import { existsSync, mkdirSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium, type Browser } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { LeaseOpsClient } from '../src/client.ts';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';

// Debian's chromium, installed by .ci/run (apt-get), driven by playwright-core: no browser download.
const CHROMIUM = process.env.LEASE_OPS_CHROMIUM ?? '/usr/bin/chromium';
const haveChromium = existsSync(CHROMIUM);
if (!haveChromium && process.env.CI) throw new Error(`${CHROMIUM} is missing; .ci/run installs Debian's chromium package`);

// LEASE_OPS_SCREENSHOTS=docs/images writes the README's pictures (test/pages.test.ts takes the others).
const SHOTS = process.env.LEASE_OPS_SCREENSHOTS ?? mkdtempSync(join(tmpdir(), 'lease-ops-shots-'));
mkdirSync(SHOTS, { recursive: true });

const ADMIN = 'board-admin-token-0123456789';
const SCOPED = 'board-acme-token-0123456789';

describe.skipIf(!haveChromium)('Bull Board in a real browser', () => {
  let bed: TestBed;
  let client: LeaseOpsClient;
  let api: TestApi;
  let base: string;
  let browser: Browser;
  let jobId: string;
  let release: () => void = () => undefined;
  const held = new Promise<void>((resolve) => (release = resolve));

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: ADMIN }, { token: SCOPED, companyId: 'acme' }]),
      LEASE_OPS_KEEP_COMPLETED_S: '600',
      // A stop that settles waits long before its retry: it stays on the Delayed tab while the test looks.
      LEASE_OPS_BACKOFF_BY_OP: JSON.stringify({ stop: { baseMs: 60_000, capMs: 60_000 } }),
    });
    // A lease whose stop keeps settling (it backs off) with operations queued behind it; a
    // resume that holds its attempt until the test ends (executing); a destroy refused for good.
    await bed.startWorker(
      createRecordingProvider({
        behaviour: async ({ ctx, op }) => {
          if (ctx.lease.leaseId === 'busy' && op === 'stop') return 'settling';
          if (ctx.lease.leaseId === 'held' && op === 'resume') await held;
          if (ctx.lease.leaseId === 'refused' && op === 'destroy') return 'permanent';
          return 'ok';
        },
      }).provider,
    );
    api = await startTestApi(bed);
    client = api.client;
    base = api.base;
    const enqueued = await client.enqueue('acquire', { provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId: 'board-lease' }, { runId: 'board-run-7f3a' });
    jobId = enqueued.jobId;
    expect((await client.waitForResult(jobId, 10_000)).state).toBe('completed');
    browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'] });
  });

  afterAll(async () => {
    release();
    await browser?.close();
    await api?.close();
    await bed?.close();
  });

  it('shows the lease-ops queue and a job with its data to an admin', async () => {
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ADMIN } });
    const page = await context.newPage();
    await page.goto(`${base}/board`);
    // The queue list names the operations queue and the maintenance one.
    await expect.poll(async () => page.locator('body').innerText(), { timeout: 15_000 }).toContain('ops');
    await page.goto(`${base}/board/queue/ops?status=completed`);
    await page.getByText(jobId).first().waitFor({ timeout: 15_000 });
    // The job card's data tab shows the operation as it was enqueued.
    const data = page.getByRole('button', { name: /^Data$/ }).first();
    if (await data.count()) await data.click();
    await expect.poll(async () => page.locator('body').innerText(), { timeout: 15_000 }).toContain('board-run-7f3a');
    const text = await page.locator('body').innerText();
    expect(text).toContain('board-lease');
    await context.close();
  });

  /**
   * Opens a board page with these credentials. A browser facing a Basic challenge it cannot
   * answer either shows the 401 page or gives up with ERR_INVALID_AUTH_CREDENTIALS
   * (Chromium does both, depending on whether it had credentials to try); both are refusals.
   */
  async function visit(credentials?: { username: string; password: string }): Promise<{ status: number | 'gave-up'; text: string }> {
    const context = await browser.newContext(credentials ? { httpCredentials: credentials } : {});
    try {
      const page = await context.newPage();
      const response = await page.goto(`${base}/board/queue/ops?status=completed`).catch((err: Error) => {
        if (/ERR_INVALID_AUTH_CREDENTIALS/.test(err.message)) return 'gave-up' as const;
        throw err;
      });
      if (response === 'gave-up') return { status: response, text: '' };
      return { status: response?.status() ?? 0, text: await page.locator('body').innerText() };
    } finally {
      await context.close();
    }
  }

  it('refuses the board without credentials and with a wrong token', async () => {
    for (const credentials of [undefined, { username: 'operator', password: 'wrong-password-0123456789' }]) {
      const { status, text } = await visit(credentials);
      expect([401, 'gave-up']).toContain(status);
      if (status === 401) expect(text).toMatch(/unauthorized/);
      expect(text).not.toContain('board-run-7f3a');
    }
  });

  it('refuses the board to a company-scoped token', async () => {
    const { status, text } = await visit({ username: 'acme', password: SCOPED });
    expect(status).toBe(403);
    expect(text).toMatch(/forbidden/);
    expect(text).not.toContain('board-run-7f3a');
  });

  it('tells where each operation stands: queued behind N, backing off until T with its error, executing; failures without stacks; a link to the lease timeline', async () => {
    const lease = (leaseId: string) => ({ provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId });
    const stop = await client.enqueue('stop', lease('busy'), { providerLeaseId: 'busy' }, { deadlineMs: 120_000 });
    const resume = await client.enqueue('resume', lease('busy'), { providerLeaseId: 'busy', leaseMetadata: {} });
    const release2 = await client.enqueue('release', lease('busy'), { providerLeaseId: 'busy', resourceDisposition: 'stop_and_retain' });
    const running = await client.enqueue('resume', lease('held'), { providerLeaseId: 'held', leaseMetadata: {} });
    const refused = await client.enqueue('destroy', lease('refused'), { providerLeaseId: 'refused' });
    expect((await client.waitForResult(refused.jobId, 10_000)).state).toBe('failed');
    await expect.poll(async () => (await client.getOperation(stop.jobId))?.state, { timeout: 10_000 }).toBe('backing-off');
    await expect.poll(async () => (await client.getOperation(running.jobId))?.state, { timeout: 10_000 }).toBe('running');

    // What the board's own page reads (its JSON API), per tab.
    const auth = { authorization: `Basic ${Buffer.from(`operator:${ADMIN}`).toString('base64')}` };
    type BoardJob = { id: string; name: string; delay: number; opts: { delay?: number }; failedReason?: string; stacktrace: string[]; externalUrl?: { href: string } };
    const tab = async (status: string) => {
      const res = await fetch(`${base}/board/api/queues?activeQueue=ops&status=${status}&page=1&jobsPerPage=50`, { headers: auth });
      const body = (await res.json()) as { queues: { name: string; jobs: BoardJob[] }[] };
      return new Map(body.queues.find((q) => q.name === 'ops')!.jobs.map((j) => [j.id, j]));
    };
    const delayed = await tab('delayed');
    expect(delayed.get(stop.jobId)?.name).toMatch(/^stop · acme\/prod\/busy · lane head, backing off until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z: .*still settling/);
    // Every job behind the head names it, by its job id (the board finds a job by its id).
    expect(delayed.get(resume.jobId)?.name).toBe(`resume · acme/prod/busy · queued behind 1 (lane head: stop ${stop.jobId})`);
    expect(delayed.get(release2.jobId)?.name).toBe(`release · acme/prod/busy · queued behind 2 (lane head: stop ${stop.jobId})`);
    // Queued ones carry no delay (the board would say "Will run at" a day away); the backoff's is its retry time.
    expect(delayed.get(resume.jobId)?.delay).toBe(0);
    expect(delayed.get(resume.jobId)?.opts.delay).toBe(0);
    const retryAt = (await client.getOperation(stop.jobId))!.retryAt!;
    const backoff = delayed.get(stop.jobId)!;
    expect(Math.abs(backoff.delay - (retryAt - (await client.ops.queue.getJob(stop.jobId))!.timestamp))).toBeLessThan(2_000);
    expect(backoff.externalUrl?.href).toBe('/ui/leases/recording/acme/prod/busy');
    expect((await tab('active')).get(running.jobId)?.name).toBe('resume · acme/prod/held · lane head, executing, attempt 1');
    // A job whose data is not JSON (written into Redis by hand) is listed as unreadable: BullMQ's own listing answered 500.
    await client.ops.connection.hset(client.ops.queue.toKey('board-unreadable'), { name: 'stop', data: '{not json', opts: '{}', timestamp: String(Date.now()), finishedOn: String(Date.now()), failedReason: 'x' });
    await client.ops.connection.zadd(client.ops.queue.toKey('failed'), Date.now(), 'board-unreadable');
    expect((await tab('failed')).get('board-unreadable')?.name).toMatch(/^unreadable job/);
    const failed = (await tab('failed')).get(refused.jobId)!;
    expect(failed.name).toBe('destroy · acme/prod/refused · failed');
    expect(failed.failedReason).toContain('refused destroy');
    expect(failed.stacktrace).toEqual([]);
    expect(JSON.stringify(failed)).not.toMatch(/\/work\/|\.ts:\d|node_modules|at async/);

    // A paused lane's operations say so; one cancelled before it ever ran shows no start on its card.
    await client.pauseLane(lease('still'), 'ops:erin');
    const waitsPaused = await client.enqueue('stop', lease('still'), { providerLeaseId: 'still' });
    const cancelledBefore = await client.enqueue('destroy', lease('still'), { providerLeaseId: 'still' });
    await expect.poll(async () => (await client.getOperation(waitsPaused.jobId))?.state, { timeout: 10_000 }).toBe('paused');
    expect(await client.cancelOperation(cancelledBefore.jobId, 'ops:erin')).toBeTruthy();
    expect((await tab('delayed')).get(waitsPaused.jobId)?.name).toMatch(/^stop · acme\/prod\/still · lane head, paused by ops:erin since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z/);
    const never = (await tab('failed')).get(cancelledBefore.jobId) as (BoardJob & { processedOn?: number }) | undefined;
    expect(never).toBeDefined();
    expect(never!.processedOn).toBeUndefined();
    await client.unpauseLane(lease('still'), 'ops:erin');
    expect((await client.waitForResult(waitsPaused.jobId, 10_000)).state).toBe('completed');

    // And in the browser: a "Will run at" on the delayed tab only for the backoff; a picture for the README.
    const context = await browser.newContext({ httpCredentials: { username: 'operator', password: ADMIN }, viewport: { width: 1280, height: 900 } });
    const page = await context.newPage();
    await page.goto(`${base}/board/queue/ops?status=delayed`);
    await page.getByText('queued behind 2').first().waitFor({ timeout: 15_000 });
    const text = await page.locator('body').innerText();
    expect(text).toContain(`resume · acme/prod/busy · queued behind 1 (lane head: stop ${stop.jobId})`);
    expect(text.match(/Will run at/g) ?? []).toHaveLength(1);
    expect((text.match(/· queued behind \d/g) ?? []).length).toBe(2);
    await page.screenshot({ path: join(SHOTS, 'board-delayed.png'), fullPage: true });
    await context.close();
    release();
  });
});
