import { once } from 'node:events';
import { existsSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { chromium, type Browser } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { captureLog } from './helpers/log-capture.ts';
import { lease, TestBed } from './helpers/env.ts';

// Issue 27 items 1, 6 and 8: what a web page on another origin, with an operator signed in
// (the browser holds the token as Basic credentials), can make the API and the board do.

const CHROMIUM = process.env.LEASE_OPS_CHROMIUM ?? '/usr/bin/chromium';
const haveChromium = existsSync(CHROMIUM);
if (!haveChromium && process.env.CI) throw new Error(`${CHROMIUM} is missing; .ci/run installs Debian's chromium package`);
const ADMIN = 'web-attacks-admin-token-0123456789';

describe.skipIf(!haveChromium)('a hostile web page, with an operator signed in', () => {
  let bed: TestBed;
  let api: TestApi;
  let browser: Browser;
  let evil: Server;
  let evilBase: string;
  let evilHtml = '';
  let logLines: string[] = [];

  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: ADMIN, LEASE_OPS_BOARD_READ_ONLY: 'false' });
    const { lines, log } = captureLog();
    api = await startTestApi(bed, log);
    logLines = lines;
    // The other site: another origin (another port) serving whatever page the test sets.
    evil = createServer((_req, res) => res.writeHead(200, { 'content-type': 'text/html' }).end(evilHtml));
    evil.listen(0, '127.0.0.1');
    await once(evil, 'listening');
    evilBase = `http://localhost:${(evil.address() as AddressInfo).port}`;
    browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'] });
  });

  afterAll(async () => {
    await browser?.close();
    evil?.close();
    await api?.close();
    await bed?.close();
  });

  /** A browser context whose every request to the API carries the operator's Basic credentials. */
  const signedIn = () => browser.newContext({ httpCredentials: { username: 'operator', password: ADMIN, origin: api.base, send: 'always' } });

  it('cannot pause a lane, cancel or rerun through /v1 with a form: /v1 takes Bearer tokens only (issue 27 item 1)', async () => {
    const context = await signedIn();
    const page = await context.newPage();
    // The operator has the board open: the browser holds the credentials.
    expect((await page.goto(`${api.base}/board`))?.status()).toBe(200);
    const target = `${api.base}/v1/leases/recording/co/env/victim/pause`;
    evilHtml = `<form id="f" method="post" action="${target}"></form><script>document.getElementById('f').submit()</script>`;
    const answered = page.waitForResponse((r) => r.url() === target);
    await page.goto(evilBase);
    const response = await answered;
    expect(response.status()).toBe(401);
    expect((await response.request().allHeaders()).authorization).toMatch(/^Basic /);
    expect(await bed.ops.lanes.pausedBy(await bed.ops.laneOf(lease('victim')))).toBeNull();
    await context.close();
    // Programs keep using Bearer; Basic is refused there, whoever sends it.
    const basic = `Basic ${Buffer.from(`op:${ADMIN}`).toString('base64')}`;
    expect((await fetch(target, { method: 'POST', headers: { authorization: basic } })).status).toBe(401);
    expect((await fetch(target, { method: 'POST', headers: { authorization: `Bearer ${ADMIN}` } })).status).toBe(200);
  });

  it('cannot frame the board: X-Frame-Options and CSP frame-ancestors; no Google Fonts, no X-Powered-By (issue 27 item 6)', async () => {
    const context = await signedIn();
    const page = await context.newPage();
    const requested: string[] = [];
    const refusals: string[] = [];
    page.on('request', (r) => requested.push(r.url()));
    page.on('console', (m) => /Content Security Policy/i.test(m.text()) && refusals.push(m.text()));
    const direct = await page.goto(`${api.base}/board/`);
    expect(direct?.status()).toBe(200);
    const headers = direct!.headers();
    expect(headers['x-frame-options']).toBe('DENY');
    expect(headers['content-security-policy']).toContain("frame-ancestors 'none'");
    expect(headers['x-powered-by']).toBeUndefined();
    expect(await direct!.text()).not.toContain('fonts.googleapis.com');
    // The board still works under its policy: it lists the operations queue.
    await page.getByText('ops', { exact: false }).first().waitFor({ timeout: 15_000 });
    expect(requested.filter((url) => !url.startsWith(api.base))).toEqual([]);
    // Nothing of its own is refused by the policy (a refused <base> broke its links once).
    await page.goto(`${api.base}/board/queue/ops?status=failed`);
    await page.getByText('ops', { exact: false }).first().waitFor({ timeout: 15_000 });
    expect(refusals).toEqual([]);
    // Framed from another origin, the board does not load.
    evilHtml = `<iframe id="b" src="${api.base}/board/" width="800" height="600"></iframe>`;
    const blocked = page.waitForEvent('console', { predicate: (m) => /frame-ancestors|Refused to display|X-Frame-Options/i.test(m.text()), timeout: 15_000 }).catch(() => null);
    await page.goto(evilBase);
    const frame = page.frames().find((f) => f !== page.mainFrame());
    const framedText = frame ? await frame.evaluate(() => (globalThis as unknown as { document: { body?: { innerText: string } } }).document.body?.innerText ?? '').catch(() => '') : '';
    expect(framedText).not.toContain('ops');
    expect(await blocked).not.toBeNull();
    await context.close();
  });

  it('never logs a token sent in a query, whatever the parameter is called (issue 27 item 8)', async () => {
    const lines = logLines;
    for (const name of ['t', 'q', 'token', 'x']) await fetch(`${api.base}/v1/attention?${name}=${ADMIN}&limit=5`, { headers: { authorization: `Bearer ${ADMIN}` } });
    await fetch(`${api.base}/board/api/queues?activeQueue=ops&t=${ADMIN}`, { headers: { authorization: `Bearer ${ADMIN}` } });
    // What the attack on the change found: a bare token, one in a name with an encoded `=`, and
    // one as the value of a parameter the API reads.
    for (const query of [ADMIN, `x&t%3D${ADMIN}`, `limit=${ADMIN}`, `cursor=${ADMIN}`]) await fetch(`${api.base}/v1/attention?${query}`, { headers: { authorization: `Bearer ${ADMIN}` } });
    const logged = lines.join('\n');
    expect(logged).toContain('/v1/attention?');
    expect(logged).toContain('limit=5');
    expect(logged).not.toContain(ADMIN);
    expect(logged).not.toContain(ADMIN.slice(0, 20));
  });
});
