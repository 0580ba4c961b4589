import type { LeaseIdentity } from '../lease.ts';
import type { AttentionItem, LeaseTimeline, OperationView } from '../queues/inspect.ts';
import { HISTORY_CAPACITY, type HistoryEvent } from '../queues/lease-history.ts';
import { duration, isoUtc, moment } from '../time-format.ts';

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
.facts .label{display:block;font-size:11px;color:#5b6573;text-transform:uppercase;letter-spacing:.04em}
table{border-collapse:collapse;background:#fff;width:100%;border:1px solid #dde1e7}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid #eef0f3;vertical-align:top}
th{font-size:12px;color:#5b6573;font-weight:600;background:#fafbfc}
td.t{white-space:nowrap;color:#5b6573;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
.k{display:inline-block;border-radius:4px;padding:0 6px;font-size:12px;color:#fff}
.k-accepted,.k-absorbed{background:#6b7788}.k-started{background:#3056d3}.k-observed{background:#0f8a8a}
.k-backing-off{background:#c77c02}.k-completed{background:#1f8a3b}.k-failed{background:#c62f2f}
.k-stuck{background:#8e24aa}.k-removed,.k-cancelled{background:#444}.k-rerun{background:#3056d3}.k-paused,.k-unpaused{background:#8e24aa}.k-named,.k-acknowledged{background:#0f6a8a}
.muted{color:#5b6573} svg{background:#fff;border:1px solid #dde1e7;border-radius:6px;height:auto}
.badge{display:inline-block;vertical-align:middle;border-radius:10px;padding:1px 10px;font-size:12px;font-weight:600;color:#fff;margin-left:6px}
.b-stuck{background:#8e24aa}.b-paused{background:#6b3fa0}.b-failed{background:#c62f2f}
details summary{cursor:pointer;color:#3056d3;font-size:12px} table.raw{margin-top:4px;font-size:12px}
.empty{background:#fff;border:1px dashed #c3c9d2;padding:16px;border-radius:6px}
`;

function page(title: string, body: string): string {
  return `<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>${esc(title)} · lease-ops</title><style>${STYLE}</style></head>
<body><header><b>lease-ops</b><a href="/ui/attention">Needs attention</a><a href="/board/">Bull Board</a></header><main>${body}</main></body></html>`;
}

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
  const open = new Map<string, { from: number; kind: 'waiting' | 'attempt' | 'backoff'; label: string; until?: number }>();
  // A backoff lasts until its retry is due; well past that (OVERDUE_MS: more than a worker's
  // pickup) the operation waits for its turn again, behind an operation that jumped ahead or
  // in a paused lane: its bar goes on as waiting.
  const endBackoff = (row: Row, span: { from: number; label: string; until?: number }, at: number) => {
    const due = span.until !== undefined && span.until + OVERDUE_MS < at ? Math.max(span.until, span.from) : at;
    row.spans.push({ from: span.from, to: due, kind: 'backoff', label: span.label });
    if (due < at) row.spans.push({ from: due, to: at, kind: 'waiting', label: 'retry due: waiting for its turn' });
  };
  const close = (row: Row, at: number, outcome?: Row['spans'][number]['outcome']) => {
    const span = open.get(row.jobId);
    if (!span) return;
    open.delete(row.jobId);
    if (span.kind === 'backoff') return endBackoff(row, span, Math.max(at, span.from));
    row.spans.push({ from: span.from, to: Math.max(at, span.from), kind: span.kind, label: span.label, ...(outcome ? { outcome } : {}) });
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
        open.set(row.jobId, { from: e.at, kind: 'backoff', label: `backing off: ${e.code ?? ''}`, ...(e.until !== undefined ? { until: e.until } : {}) });
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
    const view = views.get(jobId);
    // Still open. What the operation is now decides where its bar ends: one still in its lane
    // (queued, backing off, paused, ready, running) runs to now; one that ended without an
    // event here (or that BullMQ no longer keeps) ends where its last event left it.
    const inLane = view ? ['queued', 'ready', 'running', 'backing-off', 'paused'].includes(view.state) : true;
    if (span.kind === 'backoff') {
      if (inLane) endBackoff(row, span, tl.now);
      else row.spans.push({ from: span.from, to: Math.min(tl.now, Math.max(span.from, span.until ?? tl.now)), kind: 'backoff', label: span.label });
      continue;
    }
    const end = inLane ? tl.now : Math.max(span.from, view?.finishedAt ?? tl.now);
    row.spans.push({ from: span.from, to: Math.min(tl.now, end), kind: span.kind, label: span.label, ...(span.kind === 'attempt' ? { outcome: 'running' as const } : {}) });
  }
  for (const row of rows.values()) row.spans = foldRetries(row.spans);
  return { rows: [...rows.values()], state, paused };
}

/**
 * How long past its retry time a backoff still counts as the retry being picked up: a worker
 * may see a due retry up to its block timeout (1 s) late, more on a busy machine.
 */
const OVERDUE_MS = 1_000;

/** Attempts in a row that ended for a retry, each with its backoff: drawn as one span from `FOLD_AT` of them on. */
const FOLD_AT = 3;

/**
 * A retry streak (an attempt that ended for a retry, its backoff, the next such attempt, ...)
 * folded into one backoff span that says how many attempts it holds and the last error: a
 * stop stuck for ten minutes is one bar, not hundreds of slivers.
 */
export function foldRetries(spans: Row['spans']): Row['spans'] {
  const out: Row['spans'] = [];
  let i = 0;
  while (i < spans.length) {
    let j = i;
    let attempts = 0;
    let lastBackoff = '';
    // attempt (ended for a retry), its backoff, and the wait for a turn after it, if any
    while (spans[j]?.kind === 'attempt' && spans[j]!.outcome === 'retry' && spans[j + 1]?.kind === 'backoff') {
      lastBackoff = spans[j + 1]!.label;
      j += spans[j + 2]?.kind === 'waiting' && spans[j + 3]?.kind === 'attempt' ? 3 : 2;
      attempts++;
    }
    if (attempts >= FOLD_AT) {
      // A wait that ends the streak (nothing after it) stays its own span: the bar runs on as waiting.
      const tail = spans[j - 1]!.kind === 'waiting' && j === spans.length ? spans[--j]! : null;
      out.push({ from: spans[i]!.from, to: spans[j - 1]!.to, kind: 'backoff', label: `${attempts} attempts retried, last ${lastBackoff}` });
      if (tail) out.push(tail);
      i = j;
    } else {
      out.push(spans[i]!);
      i++;
    }
  }
  return out;
}

const STATE_COLOURS: Record<string, string> = { running: '#1f8a3b', stopped: '#8a94a3', transitioning: '#e08a00', gone: '#444', none: '#c3c9d2', error: '#c62f2f' };
const SPAN_COLOURS = { waiting: '#c9d0da', attempt: '#3056d3', backoff: '#f3c86b' };
const OUTCOME_COLOURS = { retry: '#c77c02', completed: '#1f8a3b', failed: '#c62f2f', running: '#3056d3' };

/** About how wide a label is, in px, at a font size: generous, so a label said to fit does. */
const textWidth = (text: string, size: number) => text.length * size * 0.62;

/** `text` cut (with an ellipsis) to fit `px` at `size`; empty when fewer than four characters would show (its tooltip has it). */
function fitted(text: string, px: number, size: number): string {
  if (textWidth(text, size) <= px) return text;
  const chars = Math.floor(px / (size * 0.62)) - 1;
  return chars >= 4 ? `${text.slice(0, chars)}…` : '';
}

/**
 * The timeline as an SVG: the sandbox's observed state on top, one row per operation below.
 * It scales to the page's width (viewBox); every label is drawn after the bars, inside its
 * own bar, cut to fit it, so no bar covers a label and no label runs out of its bar.
 */
export function timelineSvg(tl: Pick<LeaseTimeline, 'events' | 'operations' | 'now'>, width = 1200): string {
  const { rows, state, paused } = timelineRows(tl);
  const times = [...tl.events.map((e) => e.at), ...rows.flatMap((r) => r.spans.map((s) => s.to))];
  if (times.length === 0) return '';
  const start = Math.min(...times);
  // Up to now: the sandbox's last observed state runs until now, whatever ended before.
  const end = Math.max(start + 1_000, tl.now, ...times);
  const left = 240;
  const right = 16;
  const plot = width - left - right;
  const x = (t: number) => left + ((t - start) / (end - start)) * plot;
  const rowH = 30;
  const top = 34;
  const height = top + rowH * (rows.length + 1) + 30;
  const grid: string[] = [];
  const bars: string[] = [];
  const labels: string[] = [];
  // A bar and its label, tied by data-bar so a test can hold the label inside its bar.
  let barCount = 0;
  const bar = (attrs: { cls: string; x: number; y: number; w: number; h: number; fill: string; title: string }, label: string, size: number, colour: string) => {
    const id = barCount++;
    bars.push(`<rect class="${attrs.cls}" data-bar="${id}" x="${attrs.x.toFixed(1)}" y="${attrs.y}" width="${attrs.w.toFixed(1)}" height="${attrs.h}" rx="2" fill="${attrs.fill}"><title>${esc(attrs.title)}</title></rect>`);
    const text = fitted(label, attrs.w - 8, size);
    if (text) labels.push(`<text data-label-of="${id}" x="${(attrs.x + 4).toFixed(1)}" y="${attrs.y + attrs.h / 2 + size * 0.36}" font-size="${size}" fill="${colour}" pointer-events="none">${esc(text)}</text>`);
  };
  // Axis: about 8 ticks, in seconds from the first event.
  const step = niceStep((end - start) / 8);
  for (let t = 0; t <= end - start; t += step) {
    const px = x(start + t);
    grid.push(`<line x1="${px.toFixed(1)}" y1="${top - 8}" x2="${px.toFixed(1)}" y2="${height - 24}" stroke="#eef0f3"/>`);
    // A tick at the right end (a range of a whole number of steps) has its label end there:
    // centred, half of it ran out of the picture.
    const atEnd = px > width - right - 30;
    grid.push(`<text x="${(atEnd ? width - 2 : px).toFixed(1)}" y="${height - 8}" font-size="11" text-anchor="${atEnd ? 'end' : 'middle'}" fill="#5b6573">+${esc(duration(t))}</text>`);
  }
  grid.push(`<text x="8" y="18" font-size="12" font-weight="600" fill="#1d2430">sandbox (observed)</text>`);
  for (const s of state) {
    const w = Math.max(2, x(s.to) - x(s.from));
    bar({ cls: 'state', x: x(s.from), y: top - 26, w, h: 20, fill: STATE_COLOURS[s.state] ?? '#8a94a3', title: `${s.providerState} from ${isoUtc(s.from)} for ${duration(s.to - s.from)}` }, s.providerState, 11, '#fff');
  }
  for (const p of paused) {
    // The lane paused by an operator: a band behind every row.
    grid.push(`<rect class="lane-paused" x="${x(p.from).toFixed(1)}" y="${top - 4}" width="${Math.max(2, x(p.to) - x(p.from)).toFixed(1)}" height="${rowH * Math.max(1, rows.length) + 8}" fill="#8e24aa" fill-opacity="0.08" stroke="#8e24aa" stroke-dasharray="3 3"><title>${esc(`${p.label}: from ${isoUtc(p.from)} for ${duration(p.to - p.from)}`)}</title></rect>`);
  }
  rows.forEach((row, i) => {
    const y = top + 8 + i * rowH;
    const name = `${row.op}${row.byWatchdog ? ' (watchdog)' : ''} · ${shortJob(row.jobId)}`;
    bars.push(`<g data-job="${esc(row.jobId)}" data-op="${esc(row.op)}"><text class="row-name" x="8" y="${y + 15}" font-size="12" fill="#1d2430"><title>${esc(`${row.op} ${row.jobId}`)}</title>${esc(fitted(name, left - 16, 12))}</text>`);
    for (const s of row.spans) {
      const w = Math.max(2, x(s.to) - x(s.from));
      const fill = s.kind === 'attempt' ? OUTCOME_COLOURS[s.outcome ?? 'running'] : SPAN_COLOURS[s.kind];
      const id = barCount++;
      bars.push(`<rect class="span-${s.kind}" data-bar="${id}" x="${x(s.from).toFixed(1)}" y="${y + 3}" width="${w.toFixed(1)}" height="16" rx="2" fill="${fill}"><title>${esc(`${s.label}: from ${isoUtc(s.from)} for ${duration(s.to - s.from)}`)}</title></rect>`);
      const text = fitted(s.label, w - 8, 10);
      if (text) labels.push(`<text data-label-of="${id}" x="${(x(s.from) + 4).toFixed(1)}" y="${y + 14.6}" font-size="10" fill="${s.kind === 'attempt' ? '#fff' : '#1d2430'}" pointer-events="none">${esc(text)}</text>`);
    }
    for (const m of row.marks) {
      const px = x(m.at);
      const colour = m.kind === 'stuck' ? '#8e24aa' : m.kind === 'completed' ? '#1f8a3b' : m.kind === 'failed' ? '#c62f2f' : m.kind === 'rerun' ? '#3056d3' : '#444';
      bars.push(`<path class="mark-${m.kind}" d="M${px.toFixed(1)} ${y + 1}l6 10l-6 10l-6-10z" fill="${colour}" stroke="#fff"><title>${esc(`${m.label} at ${isoUtc(m.at)}`)}</title></path>`);
    }
    bars.push('</g>');
  });
  return `<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="lease timeline" width="100%" style="max-width:${width}px" viewBox="0 0 ${width} ${height}" font-family="system-ui,sans-serif">${grid.join('')}${bars.join('')}${labels.join('')}</svg>`;
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
      return `${e.op ?? 'operation'}: attempt ${e.attempt ?? '?'} ended with ${e.code ?? 'an error'}${e.message ? ` (${e.message})` : ''}; retry at ${e.until ? isoUtc(e.until) : '?'}`;
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

/** One row of the events table: an event, or a retry streak folded with its events inside. */
type EventRow = { kind: 'event'; event: HistoryEvent } | { kind: 'retries'; events: HistoryEvent[]; retries: HistoryEvent[] };

/**
 * The events, oldest first, with each retry streak (one operation's attempts that each ended
 * for a retry with the same code, `FOLD_AT` or more in a row, and their starts) folded into
 * one row; the raw events stay inside it.
 */
export function eventRows(events: HistoryEvent[]): EventRow[] {
  const rows: EventRow[] = [];
  let i = 0;
  while (i < events.length) {
    const e = events[i]!;
    let j = i;
    const retries: HistoryEvent[] = [];
    if (e.jobId && (e.kind === 'started' || e.kind === 'backing-off')) {
      const code = events.slice(i).find((x) => x.jobId === e.jobId && x.kind === 'backing-off')?.code;
      while (j < events.length) {
        const x = events[j]!;
        if (x.jobId !== e.jobId || !(x.kind === 'started' || (x.kind === 'backing-off' && x.code === code))) break;
        if (x.kind === 'backing-off') retries.push(x);
        j++;
      }
    }
    if (retries.length >= FOLD_AT) {
      rows.push({ kind: 'retries', events: events.slice(i, j), retries });
      i = j;
    } else {
      rows.push({ kind: 'event', event: e });
      i++;
    }
  }
  return rows;
}

/** A lease's timeline page. */
export function timelinePage(tl: LeaseTimeline): string {
  const { lease } = tl;
  const title = `${lease.provider} · ${lease.companyId}/${lease.environmentId}/${lease.leaseId}`;
  const first = tl.events[0]?.at ?? tl.now;
  const at = (ms: number) => `<time datetime="${isoUtc(ms)}">${esc(moment(ms, tl.now))}</time>`;
  const observed = tl.observed
    ? `${esc(tl.observed.providerState)} <span class="muted">since ${at(tl.observed.since)}</span>`
    : '<span class="muted">never read</span>';
  const lane = tl.executing
    ? `${esc(tl.executing.op)} executing`
    : tl.backingOff
      ? `${esc(tl.backingOff.op)} backing off${tl.backingOff.retryAt ? `, retry ${at(tl.backingOff.retryAt)}` : ''}`
      : tl.queued[0]
        ? `${esc(tl.queued[0].op)} next (${esc(tl.queued[0].state)})`
        : 'idle';
  const forces = tl.events.filter((e) => e.kind === 'stuck').length;
  const facts = [
    ['sandbox', tl.observed ? `<code>${esc(tl.observed.providerLeaseId)}</code>` : '<span class="muted">none seen</span>'],
    ['observed state', observed],
    ['lane', `${lane}${tl.queuedTotal ? `, ${tl.queuedTotal} queued` : ''}${tl.paused ? `, <b>paused</b> by ${esc(tl.paused.by)} since ${at(tl.paused.since)}` : ''}`],
    [
      'watchdog force-stops',
      `<span data-fact="force-stops">${forces}</span> in this history${tl.observed?.forceStops ? `, ${tl.observed.forceStops} in the stuck episode now` : ''}`,
    ],
    ['last failure', tl.lastFailure ? `<code>${esc(tl.lastFailure.code)}</code> ${at(tl.lastFailure.at)}` : '<span class="muted">none</span>'],
  ];
  const badges = [
    tl.stuck
      ? `<span class="badge b-stuck" data-badge="stuck" title="${esc(`on its way to stopped since ${isoUtc(tl.stuck.since)}; the budget is ${duration(tl.stuck.budgetMs)}`)}">stuck stopping for ${esc(duration(tl.now - tl.stuck.since))}</span>`
      : '',
    tl.paused ? `<span class="badge b-paused" data-badge="paused">paused</span>` : '',
    tl.lastFailure ? `<span class="badge b-failed" data-badge="failed">failed: ${esc(tl.lastFailure.code)}</span>` : '',
  ].join('');
  const job = (jobId: string | null) => (jobId ? `<code><a href="/v1/operations/${encodeURIComponent(jobId)}">${esc(shortJob(jobId))}</a></code>` : '');
  const eventRow = (e: HistoryEvent) =>
    `<tr data-kind="${esc(e.kind)}"><td class="t">+${esc(seconds(e.at - first))}</td><td class="t"><time datetime="${isoUtc(e.at)}">${esc(isoUtc(e.at))}</time></td><td><span class="k k-${esc(e.kind)}">${esc(e.kind)}</span></td><td>${esc(describeEvent(e))}</td><td>${job(e.jobId)}</td></tr>`;
  const rows = eventRows(tl.events).map((row) => {
    if (row.kind === 'event') return eventRow(row.event);
    const head = row.events[0]!;
    const last = row.retries.at(-1)!;
    const attempts = row.retries.map((r) => r.attempt).filter((n): n is number => n !== undefined);
    const span = attempts.length ? `attempts ${Math.min(...attempts)}–${Math.max(...attempts)}` : `${row.retries.length} attempts`;
    const summary = `${head.op ?? 'operation'}: ${span} each ended with ${last.code ?? 'an error'} and were retried (${row.retries.length} times over ${duration(last.at - head.at)}); the last: ${last.message ?? last.code ?? ''}${last.until ? `, retry at ${isoUtc(last.until)}` : ''}`;
    return `<tr data-kind="retries" data-count="${row.retries.length}"><td class="t">+${esc(seconds(head.at - first))}</td><td class="t"><time datetime="${isoUtc(head.at)}">${esc(isoUtc(head.at))}</time></td><td><span class="k k-backing-off">retries ×${row.retries.length}</span></td><td>${esc(summary)}<details><summary>the ${row.events.length} events</summary><table class="raw"><tbody>${row.events.map(eventRow).join('')}</tbody></table></details></td><td>${job(head.jobId)}</td></tr>`;
  });
  const attempts = tl.events.filter((e) => e.kind === 'started').length;
  const retries = tl.events.filter((e) => e.kind === 'backing-off').length;
  const ops = new Set(tl.events.map((e) => e.jobId).filter(Boolean)).size;
  const summary = tl.events.length
    ? `<p class="summary" data-events="${tl.events.length}">${tl.events.length} events from ${at(first)} to ${at(tl.events.at(-1)!.at)}: ${ops} operations, ${attempts} attempts, ${retries} retries, watchdog force-stops: ${forces}.${
        tl.historyFull ? ` The history keeps a lease's last ${HISTORY_CAPACITY} entries for a week: older events were dropped.` : ''
      }</p>`
    : '';
  const svg = timelineSvg(tl);
  return page(
    title,
    `<h1>${esc(title)} ${badges}</h1>
<div class="facts">${facts.map(([k, v]) => `<div><span class="label">${k}</span>${v}</div>`).join('')}</div>
<h2>Timeline</h2>${svg || '<div class="empty">No events recorded for this lease (none in the last week, or none yet).</div>'}
<p class="muted">Grey: waiting in the lane. Blue: an attempt running; amber: an attempt that ended for a retry, then its backoff (${FOLD_AT} or more in a row: one bar); green: completed; red: failed. Purple diamonds: the watchdog's force-stops. Times are Redis' clock, in UTC.</p>
${actionsSection(tl)}
<h2>Events</h2>${summary}<table><thead><tr><th>after</th><th>at (UTC)</th><th>event</th><th>what happened</th><th>job</th></tr></thead><tbody>${rows.join('')}</tbody></table>`,
  );
}

/** Buttons for what an operator may do here: each a form posted to this page's own origin. */
function actionsSection(tl: LeaseTimeline): string {
  const base = timelinePath(tl.lease);
  const button = (action: string, label: string, name: string) =>
    `<form method="post" action="${esc(action)}" style="display:inline"><button type="submit" name="action" value="${esc(name)}">${esc(label)}</button></form>`;
  const lane = tl.paused ? button(`${base}/unpause`, 'Unpause lane', 'unpause') : button(`${base}/pause`, 'Pause lane', 'pause');
  const rows = tl.operations
    // A paused lane's waiting operations can be cancelled as well as queued and backing-off ones.
    .filter((o) => o.state === 'queued' || o.state === 'backing-off' || o.state === 'paused' || o.state === 'failed')
    .map((o) => {
      const path = `/ui/operations/${encodeURIComponent(o.jobId)}`;
      const act = o.state === 'failed' ? button(`${path}/rerun`, 'Run again', 'rerun') : button(`${path}/cancel`, 'Cancel', 'cancel');
      return `<tr data-job="${esc(o.jobId)}"><td>${esc(o.op)} · <code>${esc(shortJob(o.jobId))}</code></td><td>${esc(o.state)}</td><td>${act}</td></tr>`;
    })
    .join('');
  const ack = tl.lastFailure
    ? ` ${button(`${base}/acknowledge`, 'Acknowledge failures', 'acknowledge')} <span class="muted">Takes the lease's failures off the attention list (its history keeps them).</span>`
    : '';
  return `<h2>Actions</h2><p>${lane} <span class="muted">A paused lane finishes what executes and starts nothing new until unpaused.</span></p>${ack ? `<p>${ack}</p>` : ''}${
    rows ? `<table><thead><tr><th>operation</th><th>state</th><th></th></tr></thead><tbody>${rows}</tbody></table>` : ''
  }`;
}

/** A refused or done action, with the way back. */
export function actionPage(title: string, message: string, back: string): string {
  return page(title, `<h1>${esc(title)}</h1><p>${esc(message)}</p><p><a href="${esc(back)}">Back</a></p>`);
}

const REASONS: Record<AttentionItem['reason'], string> = {
  stuck_stopping: 'stuck stopping',
  operation_failed: 'an operation failed',
  paused: 'lane paused',
  blocked: 'lane blocked',
};

/** The attention page: one row per lease (stuck, failing, paused or blocked: each reason it has), linked to its timeline. */
export function attentionPage(items: AttentionItem[], next: number | null, now: number, offset: number): string {
  const chip = (reason: AttentionItem['reason']) => (reason === 'stuck_stopping' ? 'stuck' : reason === 'blocked' || reason === 'paused' ? 'backing-off' : 'failed');
  const rows = items
    .map((item) => {
      const name = item.lease ? `${item.lease.provider} · ${item.lease.companyId}/${item.lease.environmentId}/${item.lease.leaseId}` : item.laneId;
      const link = item.lease ? `<a href="${esc(timelinePath(item.lease))}">${esc(name)}</a>` : esc(name);
      const why = item.reasons.map((reason) => `<span class="k k-${chip(reason)}" data-reason="${esc(reason)}">${esc(REASONS[reason])}</span>`).join(' ');
      const detail = item.detail
        .split('; ')
        .map((line) => `<div>${esc(line)}</div>`)
        .join('');
      return `<tr data-lane="${esc(item.laneId)}" data-reasons="${esc(item.reasons.join(' '))}"><td>${why}</td><td>${link}</td><td class="t">${esc(duration(Math.max(0, now - item.since)))}<br><time datetime="${isoUtc(item.since)}" class="muted">${esc(isoUtc(item.since))}</time></td><td>${detail}</td></tr>`;
    })
    .join('');
  const more = next === null ? '' : `<p><a href="/ui/attention?offset=${next}">Next page</a></p>`;
  return page(
    'Needs attention',
    `<h1>Needs attention</h1>
${items.length ? `<table><thead><tr><th>why</th><th>lease</th><th>for</th><th>detail</th></tr></thead><tbody>${rows}</tbody></table>` : `<div class="empty">Nothing needs attention${offset ? ' on this page' : ''}.</div>`}${more}`,
  );
}
