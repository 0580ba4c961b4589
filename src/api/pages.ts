import type { LeaseIdentity } from '../lease.ts';
import type { AttentionItem, LeaseTimeline, OperationView } from '../queues/inspect.ts';
import type { HistoryEvent } from '../queues/lease-history.ts';

/**
 * The operator's pages, rendered on the server as plain HTML with an inline SVG: no script,
 * no build step, nothing fetched. A lease's timeline draws what lease-ops knows of it (each
 * operation's wait, attempts, backoffs and end, the watchdog's force-stops, and the sandbox's
 * observed state over time); the attention page lists what needs someone, with links.
 */

/** Text for HTML and SVG: the five characters that could start markup or end an attribute. */
export const esc = (text: unknown) =>
  String(text).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[c]!);

/** Path of a lease's timeline page (each part percent-encoded). */
export function timelinePath(lease: LeaseIdentity): string {
  return `/ui/leases/${[lease.provider, lease.companyId, lease.environmentId, lease.leaseId].map(encodeURIComponent).join('/')}`;
}

/** The pages' one header: no script may run, nothing loads from elsewhere. */
export const PAGE_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

const STYLE = `
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:baseline}
header a{color:#c9d4ff;text-decoration:none} header b{font-size:16px}
main{padding:16px 24px;max-width:1280px}
h1{font-size:20px;margin:4px 0 12px} h2{font-size:15px;margin:22px 0 8px}
.facts{display:flex;flex-wrap:wrap;gap:10px 28px;margin-bottom:8px}
.facts div{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:6px 12px}
.facts span{display:block;font-size:11px;color:#5b6573;text-transform:uppercase;letter-spacing:.04em}
table{border-collapse:collapse;background:#fff;width:100%;border:1px solid #dde1e7}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid #eef0f3;vertical-align:top}
th{font-size:12px;color:#5b6573;font-weight:600;background:#fafbfc}
td.t{white-space:nowrap;color:#5b6573;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
.k{display:inline-block;border-radius:4px;padding:0 6px;font-size:12px;color:#fff}
.k-accepted,.k-absorbed{background:#6b7788}.k-started{background:#3056d3}.k-observed{background:#0f8a8a}
.k-backing-off{background:#c77c02}.k-completed{background:#1f8a3b}.k-failed{background:#c62f2f}
.k-stuck{background:#8e24aa}.k-removed,.k-cancelled{background:#444}.k-rerun{background:#3056d3}.k-paused,.k-unpaused{background:#8e24aa}
.muted{color:#5b6573} svg{background:#fff;border:1px solid #dde1e7;border-radius:6px}
.empty{background:#fff;border:1px dashed #c3c9d2;padding:16px;border-radius:6px}
`;

function page(title: string, body: string): string {
  return `<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>${esc(title)} · lease-ops</title><style>${STYLE}</style></head>
<body><header><b>lease-ops</b><a href="/ui/attention">Needs attention</a><a href="/board/">Bull Board</a></header><main>${body}</main></body></html>`;
}

const clock = (ms: number) => new Date(ms).toISOString().slice(11, 23);
const seconds = (ms: number) => `${(ms / 1000).toFixed(ms < 10_000 ? 2 : 1)} s`;
const shortJob = (jobId: string) => jobId.slice(jobId.lastIndexOf('.') + 1, jobId.lastIndexOf('.') + 7) || jobId.slice(0, 6);

/** One operation as the timeline draws it: its spans, from its events. */
interface Row {
  jobId: string;
  op: string;
  byWatchdog: boolean;
  spans: { from: number; to: number; kind: 'waiting' | 'attempt' | 'backoff'; label: string; outcome?: 'retry' | 'completed' | 'failed' | 'running' }[];
  marks: { at: number; kind: 'stuck' | 'completed' | 'failed' | 'removed' | 'rerun'; label: string }[];
  accepted: number | null;
}

/** Spans of each operation (waiting, attempts, backoffs) and of the sandbox's observed state. */
export function timelineRows(tl: Pick<LeaseTimeline, 'events' | 'operations' | 'now'>) {
  const rows = new Map<string, Row>();
  const views = new Map<string, OperationView>(tl.operations.map((o) => [o.jobId, o]));
  const rowOf = (e: HistoryEvent) => {
    const id = e.jobId!;
    let row = rows.get(id);
    if (!row) {
      row = { jobId: id, op: e.op ?? views.get(id)?.op ?? '?', byWatchdog: false, spans: [], marks: [], accepted: null };
      rows.set(id, row);
    }
    if (e.op && row.op === '?') row.op = e.op;
    return row;
  };
  const open = new Map<string, { from: number; kind: 'waiting' | 'attempt' | 'backoff'; label: string }>();
  const close = (row: Row, at: number, outcome?: Row['spans'][number]['outcome']) => {
    const span = open.get(row.jobId);
    if (!span) return;
    row.spans.push({ ...span, to: Math.max(at, span.from), ...(outcome ? { outcome } : {}) });
    open.delete(row.jobId);
  };
  const state: { from: number; to: number; state: string; providerState: string }[] = [];
  const paused: { from: number; to: number; label: string }[] = [];
  for (const e of tl.events) {
    if (e.kind === 'paused') {
      paused.push({ from: e.at, to: tl.now, label: e.message ?? 'paused' });
      continue;
    }
    if (e.kind === 'unpaused') {
      const last = paused.at(-1);
      if (last && last.to === tl.now) last.to = e.at;
      continue;
    }
    if (e.kind === 'observed') {
      const last = state.at(-1);
      if (last) last.to = e.at;
      state.push({ from: e.at, to: tl.now, state: e.state ?? '?', providerState: e.providerState ?? e.state ?? '?' });
      continue;
    }
    if (!e.jobId) continue;
    const row = rowOf(e);
    switch (e.kind) {
      case 'accepted':
        row.accepted ??= e.at;
        open.set(row.jobId, { from: e.at, kind: 'waiting', label: e.ahead ? `waited behind ${e.ahead}` : 'accepted at the head' });
        break;
      case 'stuck':
        row.byWatchdog = true;
        row.marks.push({ at: e.at, kind: 'stuck', label: `watchdog: ${e.message ?? 'stuck stopping; force-stop queued'}` });
        break;
      case 'started':
        close(row, e.at);
        open.set(row.jobId, { from: e.at, kind: 'attempt', label: `attempt ${e.attempt ?? '?'}` });
        break;
      case 'backing-off':
        close(row, e.at, 'retry');
        open.set(row.jobId, { from: e.at, kind: 'backoff', label: `backing off: ${e.code ?? ''}` });
        break;
      case 'completed':
      case 'failed':
        close(row, e.at, e.kind);
        row.marks.push({ at: e.at, kind: e.kind, label: e.kind === 'failed' ? `failed: ${e.code ?? ''}` : 'completed' });
        break;
      case 'removed':
      case 'cancelled':
        close(row, e.at);
        row.marks.push({ at: e.at, kind: 'removed', label: e.message ?? `${e.kind} by an operator` });
        break;
      case 'rerun':
        close(row, e.at);
        row.marks.push({ at: e.at, kind: 'rerun', label: e.message ?? 'run again' });
        open.set(row.jobId, { from: e.at, kind: 'waiting', label: 'run again: waiting in the lane' });
        break;
      case 'absorbed':
        break;
    }
  }
  for (const [jobId, span] of open) {
    const row = rows.get(jobId)!;
    // Still open: a backoff ends at its retry time at most, anything else now.
    const until = span.kind === 'backoff' ? tl.events.findLast((e) => e.jobId === jobId && e.kind === 'backing-off')?.until : undefined;
    row.spans.push({ ...span, to: Math.min(tl.now, until ?? tl.now), ...(span.kind === 'attempt' ? { outcome: 'running' as const } : {}) });
  }
  return { rows: [...rows.values()], state, paused };
}

const STATE_COLOURS: Record<string, string> = { running: '#1f8a3b', stopped: '#8a94a3', transitioning: '#e08a00', gone: '#444', none: '#c3c9d2', error: '#c62f2f' };
const SPAN_COLOURS = { waiting: '#c9d0da', attempt: '#3056d3', backoff: '#f3c86b' };
const OUTCOME_COLOURS = { retry: '#c77c02', completed: '#1f8a3b', failed: '#c62f2f', running: '#3056d3' };

/** The timeline as an SVG: the sandbox's observed state on top, one row per operation below. */
export function timelineSvg(tl: Pick<LeaseTimeline, 'events' | 'operations' | 'now'>, width = 1200): string {
  const { rows, state, paused } = timelineRows(tl);
  const times = [...tl.events.map((e) => e.at), ...rows.flatMap((r) => r.spans.map((s) => s.to))];
  if (times.length === 0) return '';
  const start = Math.min(...times);
  const end = Math.max(start + 1_000, ...times);
  const left = 190;
  const right = 16;
  const plot = width - left - right;
  const x = (t: number) => left + ((t - start) / (end - start)) * plot;
  const rowH = 30;
  const top = 34;
  const height = top + rowH * (rows.length + 1) + 30;
  const parts: string[] = [];
  // Axis: about 8 ticks, in seconds from the first event.
  const step = niceStep((end - start) / 8);
  for (let t = 0; t <= end - start; t += step) {
    const px = x(start + t);
    parts.push(`<line x1="${px}" y1="${top - 8}" x2="${px}" y2="${height - 24}" stroke="#eef0f3"/>`);
    parts.push(`<text x="${px}" y="${height - 8}" font-size="11" text-anchor="middle" fill="#5b6573">+${esc(seconds(t))}</text>`);
  }
  parts.push(`<text x="8" y="18" font-size="12" font-weight="600" fill="#1d2430">sandbox (observed)</text>`);
  for (const s of state) {
    const w = Math.max(2, x(s.to) - x(s.from));
    const colour = STATE_COLOURS[s.state] ?? '#8a94a3';
    parts.push(`<rect x="${x(s.from)}" y="${top - 26}" width="${w}" height="20" rx="3" fill="${colour}"><title>${esc(`${s.providerState} from +${seconds(s.from - start)} for ${seconds(s.to - s.from)}`)}</title></rect>`);
    if (w > 60) parts.push(`<text x="${x(s.from) + 6}" y="${top - 12}" font-size="11" fill="#fff">${esc(s.providerState)}</text>`);
  }
  for (const p of paused) {
    // The lane paused by an operator: a band behind every row.
    parts.push(`<rect class="lane-paused" x="${x(p.from)}" y="${top - 4}" width="${Math.max(2, x(p.to) - x(p.from))}" height="${rowH * Math.max(1, rows.length) + 8}" fill="#8e24aa" fill-opacity="0.08" stroke="#8e24aa" stroke-dasharray="3 3"><title>${esc(`${p.label}: +${seconds(p.from - start)} for ${seconds(p.to - p.from)}`)}</title></rect>`);
  }
  rows.forEach((row, i) => {
    const y = top + 8 + i * rowH;
    const name = `${row.op}${row.byWatchdog ? ' (watchdog)' : ''} · ${shortJob(row.jobId)}`;
    parts.push(`<g data-job="${esc(row.jobId)}" data-op="${esc(row.op)}"><text x="8" y="${y + 15}" font-size="12" fill="#1d2430">${esc(name)}</text>`);
    for (const s of row.spans) {
      const w = Math.max(2, x(s.to) - x(s.from));
      const fill = s.kind === 'attempt' ? OUTCOME_COLOURS[s.outcome ?? 'running'] : SPAN_COLOURS[s.kind];
      parts.push(
        `<rect class="span-${s.kind}" x="${x(s.from)}" y="${y + 3}" width="${w}" height="16" rx="2" fill="${fill}"><title>${esc(`${s.label}: +${seconds(s.from - start)} for ${seconds(s.to - s.from)}`)}</title></rect>`,
      );
      // A label only where it fits (about 5.5 px a character at this size).
      if (w > s.label.length * 5.5 + 10) parts.push(`<text x="${x(s.from) + 5}" y="${y + 15}" font-size="10" fill="${s.kind === 'attempt' ? '#fff' : '#1d2430'}">${esc(s.label)}</text>`);
    }
    for (const m of row.marks) {
      const px = x(m.at);
      const colour = m.kind === 'stuck' ? '#8e24aa' : m.kind === 'completed' ? '#1f8a3b' : m.kind === 'failed' ? '#c62f2f' : m.kind === 'rerun' ? '#3056d3' : '#444';
      parts.push(`<path class="mark-${m.kind}" d="M${px} ${y + 1}l6 10l-6 10l-6-10z" fill="${colour}" stroke="#fff"><title>${esc(m.label)}</title></path>`);
    }
    parts.push('</g>');
  });
  return `<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="lease timeline" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="system-ui,sans-serif">${parts.join('')}</svg>`;
}

function niceStep(raw: number): number {
  const steps = [100, 200, 500, 1_000, 2_000, 5_000, 10_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000, 3_600_000, 21_600_000, 86_400_000];
  return steps.find((s) => s >= raw) ?? 86_400_000;
}

/** What one event says, in a sentence. */
export function describeEvent(e: HistoryEvent): string {
  switch (e.kind) {
    case 'accepted':
      return `${e.op ?? 'operation'} accepted${e.ahead ? `, ${e.ahead} ahead of it` : ', at the head of the lane'}`;
    case 'absorbed':
      return `an identical ${e.op ?? 'request'} was answered with this queued one`;
    case 'started':
      return `${e.op ?? 'operation'}: attempt ${e.attempt ?? '?'} started`;
    case 'observed':
      return `the sandbox ${e.sandbox ? `${e.sandbox} ` : ''}was ${e.providerState ?? e.state ?? '?'}`;
    case 'backing-off':
      return `${e.op ?? 'operation'}: attempt ${e.attempt ?? '?'} ended with ${e.code ?? 'an error'}${e.message ? ` (${e.message})` : ''}; retry at ${e.until ? clock(e.until) : '?'}`;
    case 'completed':
      return `${e.op ?? 'operation'} completed`;
    case 'failed':
      return `${e.op ?? 'operation'} failed: ${e.code ?? ''}${e.message ? ` (${e.message})` : ''}`;
    case 'stuck':
      return `watchdog: ${e.message ?? 'stuck stopping; force-stop queued'}`;
    case 'removed':
      return e.message ?? 'removed by an operator';
    case 'cancelled':
      return `${e.op ?? 'operation'} ${e.message ?? 'cancelled by an operator'}`;
    case 'rerun':
      return `${e.op ?? 'operation'} ${e.message ?? 'run again by an operator'}: it joins the lane's tail`;
    case 'paused':
      return `lane ${e.message ?? 'paused'}: nothing new starts`;
    case 'unpaused':
      return `lane ${e.message ?? 'unpaused'}`;
    case 'acknowledged':
      return `failures ${e.message ?? 'acknowledged by an operator'}: they leave the attention list`;
    case 'named':
      return e.message ?? `sandbox ${e.sandbox ?? '?'} names this lease from now on`;
  }
}

/** A lease's timeline page. */
export function timelinePage(tl: LeaseTimeline): string {
  const { lease } = tl;
  const title = `${lease.provider} · ${lease.companyId}/${lease.environmentId}/${lease.leaseId}`;
  const first = tl.events[0]?.at ?? tl.now;
  const observed = tl.observed
    ? `${esc(tl.observed.providerState)} <span class="muted">for ${esc(seconds(tl.now - tl.observed.since))}</span>`
    : '<span class="muted">never read</span>';
  const lane = tl.executing
    ? `${esc(tl.executing.op)} executing`
    : tl.backingOff
      ? `${esc(tl.backingOff.op)} backing off${tl.backingOff.retryAt ? ` until ${clock(tl.backingOff.retryAt)}` : ''}`
      : 'idle';
  const facts = [
    ['sandbox', tl.observed ? `<code>${esc(tl.observed.providerLeaseId)}</code>` : '<span class="muted">none seen</span>'],
    ['observed state', observed],
    ['lane', `${lane}${tl.queuedTotal ? `, ${tl.queuedTotal} queued` : ''}${tl.paused ? `, <b>paused</b> by ${esc(tl.paused.by)}` : ''}`],
    ['force-stops this episode', String(tl.observed?.forceStops ?? 0)],
    ['last failure', tl.lastFailure ? `<code>${esc(tl.lastFailure.code)}</code>` : '<span class="muted">none</span>'],
  ];
  const events = tl.events
    .map(
      (e) =>
        `<tr data-kind="${esc(e.kind)}"><td class="t">+${esc(seconds(e.at - first))}</td><td class="t">${esc(clock(e.at))}</td><td><span class="k k-${esc(e.kind)}">${esc(e.kind)}</span></td><td>${esc(describeEvent(e))}</td><td><code>${e.jobId ? `<a href="/v1/operations/${encodeURIComponent(e.jobId)}">${esc(shortJob(e.jobId))}</a>` : ''}</code></td></tr>`,
    )
    .join('');
  const svg = timelineSvg(tl);
  return page(
    title,
    `<h1>${esc(title)}</h1>
<div class="facts">${facts.map(([k, v]) => `<div><span>${k}</span>${v}</div>`).join('')}</div>
<h2>Timeline</h2>${svg || '<div class="empty">No events recorded for this lease (none in the last week, or none yet).</div>'}
<p class="muted">Grey: waiting in the lane. Blue: an attempt running; amber: an attempt that ended for a retry, then its backoff; green: completed; red: failed. Purple diamonds: the watchdog's force-stops. Times are Redis' clock (UTC).</p>
${actionsSection(tl)}
<h2>Events</h2><table><thead><tr><th>after</th><th>at (UTC)</th><th>event</th><th>what happened</th><th>job</th></tr></thead><tbody>${events}</tbody></table>`,
  );
}

/** Buttons for what an operator may do here: each a form posted to this page's own origin. */
function actionsSection(tl: LeaseTimeline): string {
  const base = timelinePath(tl.lease);
  const button = (action: string, label: string, name: string) =>
    `<form method="post" action="${esc(action)}" style="display:inline"><button type="submit" name="action" value="${esc(name)}">${esc(label)}</button></form>`;
  const lane = tl.paused ? button(`${base}/unpause`, 'Unpause lane', 'unpause') : button(`${base}/pause`, 'Pause lane', 'pause');
  const rows = tl.operations
    .filter((o) => o.state === 'queued' || o.state === 'backing-off' || o.state === 'failed')
    .map((o) => {
      const path = `/ui/operations/${encodeURIComponent(o.jobId)}`;
      const act = o.state === 'failed' ? button(`${path}/rerun`, 'Run again', 'rerun') : button(`${path}/cancel`, 'Cancel', 'cancel');
      return `<tr data-job="${esc(o.jobId)}"><td>${esc(o.op)} · <code>${esc(shortJob(o.jobId))}</code></td><td>${esc(o.state)}</td><td>${act}</td></tr>`;
    })
    .join('');
  return `<h2>Actions</h2><p>${lane} <span class="muted">A paused lane finishes what executes and starts nothing new until unpaused.</span></p>${
    rows ? `<table><thead><tr><th>operation</th><th>state</th><th></th></tr></thead><tbody>${rows}</tbody></table>` : ''
  }`;
}

/** A refused or done action, with the way back. */
export function actionPage(title: string, message: string, back: string): string {
  return page(title, `<h1>${esc(title)}</h1><p>${esc(message)}</p><p><a href="${esc(back)}">Back</a></p>`);
}

const REASONS: Record<AttentionItem['reason'], string> = {
  stuck_stopping: 'stuck stopping',
  last_operation_failed: 'last operation failed',
  paused: 'lane paused',
  blocked: 'lane blocked',
};

/** The attention page: leases stuck, failing or blocked, each linked to its timeline. */
export function attentionPage(items: AttentionItem[], next: number | null, now: number, offset: number): string {
  const rows = items
    .map((item) => {
      const name = item.lease ? `${item.lease.provider} · ${item.lease.companyId}/${item.lease.environmentId}/${item.lease.leaseId}` : item.laneId;
      const link = item.lease ? `<a href="${esc(timelinePath(item.lease))}">${esc(name)}</a>` : esc(name);
      return `<tr data-reason="${esc(item.reason)}"><td><span class="k k-${item.reason === 'stuck_stopping' ? 'stuck' : item.reason === 'blocked' || item.reason === 'paused' ? 'backing-off' : 'failed'}">${esc(REASONS[item.reason])}</span></td><td>${link}</td><td class="t">${esc(seconds(Math.max(0, now - item.since)))}</td><td>${esc(item.detail)}</td></tr>`;
    })
    .join('');
  const more = next === null ? '' : `<p><a href="/ui/attention?offset=${next}">Next page</a></p>`;
  return page(
    'Needs attention',
    `<h1>Needs attention</h1>
${items.length ? `<table><thead><tr><th>why</th><th>lease</th><th>for</th><th>detail</th></tr></thead><tbody>${rows}</tbody></table>` : `<div class="empty">Nothing needs attention${offset ? ' on this page' : ''}.</div>`}${more}`,
  );
}
