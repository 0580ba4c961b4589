import { existsSync } from 'node:fs';
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

const ADMIN = 'board-admin-token-0123456789';
const SCOPED = 'board-acme-token-0123456789';

describe.skipIf(!haveChromium)('Bull Board in a real browser', () => {
  let bed: TestBed;
  let client: LeaseOpsClient;
  let api: TestApi;
  let base: string;
  let browser: Browser;
  let jobId: string;

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: ADMIN }, { token: SCOPED, companyId: 'acme' }]),
      LEASE_OPS_KEEP_COMPLETED_S: '600',
    });
    await bed.startWorker(createRecordingProvider().provider);
    api = await startTestApi(bed);
    client = api.client;
    base = api.base;
    const enqueued = await client.enqueue('acquire', { provider: 'recording', companyId: 'acme', environmentId: 'prod', leaseId: 'board-lease' }, { runId: 'board-run-7f3a' });
    jobId = enqueued.jobId;
    expect((await client.waitForResult(jobId, 10_000)).state).toBe('completed');
    browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'] });
  });

  afterAll(async () => {
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
});
