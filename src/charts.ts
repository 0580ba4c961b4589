import { esc, timelineRows } from './api/pages.ts';
import type { LeaseTimeline } from './queues/inspect.ts';

/**
 * Pictures for a terminal and for files: a lease's timeline as text (the demo prints it),
 * and the bench's throughput and hand-off charts as SVG. No dependencies: a few rectangles.
 */


/**
 * A lease's timeline in text, one row per operation: `·` waiting in the lane, `█` an
 * attempt that completed or is running, `▒` one that ended for a retry, `░` its backoff,
 * `✗` failed, `◆` the watchdog's force-stop; the sandbox's observed state on top.
 */
export function timelineText(tl: Pick<LeaseTimeline, 'events' | 'operations' | 'now'>, width = 60): string {
  const { rows, state } = timelineRows(tl);
  const times = [...tl.events.map((e) => e.at), ...rows.flatMap((r) => r.spans.map((s) => s.to))];
  if (!times.length) return '(no events)';
  const start = Math.min(...times);
  const end = Math.max(start + 1_000, ...times);
  const col = (t: number) => Math.min(width - 1, Math.max(0, Math.floor(((t - start) / (end - start)) * width)));
  const paint = (line: string[], from: number, to: number, ch: string) => {
    for (let i = col(from); i <= col(to); i++) line[i] = ch;
  };
  const label = (text: string) => text.slice(0, 24).padEnd(24);
  const out: string[] = [];
  const sandbox = Array<string>(width).fill(' ');
  const legend: string[] = [];
  // Each state its own letter: the first of its name not taken by another (stopping, stopped, started).
  const letters = new Map<string, string>();
  for (const s of state) {
    let ch = letters.get(s.providerState);
    if (!ch) {
      const taken = new Set(letters.values());
      ch = [...s.providerState.toUpperCase(), ...'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'].find((c) => /[A-Z0-9]/.test(c) && !taken.has(c)) ?? '?';
      letters.set(s.providerState, ch);
      legend.push(`${ch}=${s.providerState}`);
    }
    paint(sandbox, s.from, s.to, ch);
  }
  out.push(`${label('sandbox (observed)')} |${sandbox.join('')}|  ${legend.join(' ')}`);
  for (const row of rows) {
    const line = Array<string>(width).fill(' ');
    for (const s of row.spans) paint(line, s.from, s.to, s.kind === 'waiting' ? '·' : s.kind === 'backoff' ? '░' : s.outcome === 'retry' ? '▒' : '█');
    for (const m of row.marks) line[col(m.at)] = m.kind === 'stuck' ? '◆' : m.kind === 'failed' ? '✗' : m.kind === 'removed' ? 'x' : line[col(m.at)]!;
    out.push(`${label(`${row.op}${row.byWatchdog ? ' (watchdog)' : ''}`)} |${line.join('')}|`);
  }
  const seconds = (end - start) / 1000;
  out.push(`${' '.repeat(24)}  0 s${' '.repeat(Math.max(1, width - 8))}${seconds.toFixed(1)} s`);
  out.push(`${' '.repeat(24)}  · waiting  █ attempt  ▒ attempt that retried  ░ backoff  ◆ watchdog force-stop  ✗ failed`);
  return out.join('\n');
}

export interface Bar {
  label: string;
  value: number;
  /** Other measurements of the same thing (rounds), drawn as dots. */
  samples?: number[];
  colour?: string;
}

/** Horizontal bars with their values, and each bar's samples as dots. */
export function barChartSvg(title: string, unit: string, bars: Bar[], width = 760): string {
  const left = 290;
  const rowH = 34;
  const top = 40;
  const height = top + bars.length * rowH + 16;
  const max = Math.max(1, ...bars.flatMap((b) => [b.value, ...(b.samples ?? [])]));
  const scale = (v: number) => ((width - left - 110) * v) / max;
  const parts = [`<text x="12" y="24" font-size="15" font-weight="600">${esc(title)}</text>`];
  bars.forEach((b, i) => {
    const y = top + i * rowH;
    parts.push(`<text x="12" y="${y + 18}" font-size="12">${esc(b.label)}</text>`);
    parts.push(`<rect x="${left}" y="${y + 4}" width="${Math.max(1, scale(b.value))}" height="20" rx="3" fill="${b.colour ?? '#3056d3'}"/>`);
    for (const s of b.samples ?? []) parts.push(`<circle cx="${left + scale(s)}" cy="${y + 14}" r="3" fill="#1d2430" fill-opacity="0.55"/>`);
    parts.push(`<text x="${left + scale(b.value) + 8}" y="${y + 18}" font-size="12" fill="#1d2430">${esc(`${Math.round(b.value).toLocaleString('en-US')} ${unit}`)}</text>`);
  });
  return svg(width, height, parts);
}

/** A distribution on a log axis (for latencies in ms), with its p50 and p99 marked. */
export function histogramSvg(title: string, values: number[], width = 760, counted = 'hand-offs'): string {
  const height = 230;
  const left = 50;
  const bottom = height - 40;
  const parts = [`<text x="12" y="24" font-size="15" font-weight="600">${esc(title)}</text>`];
  const positive = values.filter((v) => v > 0).sort((a, b) => a - b);
  if (!positive.length) return svg(width, height, [...parts, '<text x="12" y="60" font-size="12">no measurements</text>']);
  const lo = Math.floor(Math.log10(positive[0]!));
  const hi = Math.max(lo + 1, Math.ceil(Math.log10(positive.at(-1)!)));
  const binsPerDecade = 10;
  const bins = Array<number>((hi - lo) * binsPerDecade).fill(0);
  for (const v of positive) bins[Math.min(bins.length - 1, Math.floor((Math.log10(v) - lo) * binsPerDecade))]!++;
  const plot = width - left - 20;
  const barW = plot / bins.length;
  const most = Math.max(...bins);
  bins.forEach((n, i) => {
    if (!n) return;
    const h = ((bottom - 40) * n) / most;
    parts.push(`<rect x="${left + i * barW}" y="${bottom - h}" width="${Math.max(1, barW - 1)}" height="${h}" fill="#3056d3"><title>${n}</title></rect>`);
  });
  const x = (v: number) => left + ((Math.log10(v) - lo) / (hi - lo)) * plot;
  for (let d = lo; d <= hi; d++) {
    parts.push(`<line x1="${x(10 ** d)}" y1="${bottom}" x2="${x(10 ** d)}" y2="${bottom + 5}" stroke="#5b6573"/>`);
    parts.push(`<text x="${x(10 ** d)}" y="${bottom + 18}" font-size="11" text-anchor="middle" fill="#5b6573">${esc(`${10 ** d < 1 ? (10 ** d).toFixed(-d) : 10 ** d} ms`)}</text>`);
  }
  parts.push(`<line x1="${left}" y1="${bottom}" x2="${left + plot}" y2="${bottom}" stroke="#5b6573"/>`);
  const at = (p: number) => positive[Math.min(positive.length - 1, Math.floor((p / 100) * positive.length))]!;
  for (const [p, colour] of [[50, '#1f8a3b'], [99, '#c62f2f']] as const) {
    const v = at(p);
    parts.push(`<line x1="${x(v)}" y1="36" x2="${x(v)}" y2="${bottom}" stroke="${colour}" stroke-dasharray="4 3"/>`);
    parts.push(`<text x="${x(v) + 4}" y="${p === 50 ? 48 : 62}" font-size="11" fill="${colour}">${esc(`p${p} ${v.toFixed(2)} ms`)}</text>`);
  }
  parts.push(`<text x="${left}" y="${height - 6}" font-size="11" fill="#5b6573">${esc(`${positive.length} ${counted}`)}</text>`);
  return svg(width, height, parts);
}

/** Several SVGs one above the other, in one file. */
export function stackSvg(svgs: string[]): string {
  let y = 0;
  let width = 0;
  const placed = svgs.map((one) => {
    const w = Number(/width="(\d+)"/.exec(one)?.[1] ?? 0);
    const h = Number(/height="(\d+)"/.exec(one)?.[1] ?? 0);
    const at = y;
    y += h + 12;
    width = Math.max(width, w);
    return one.replace('<svg ', `<svg y="${at}" `);
  });
  return svg(width, Math.max(0, y - 12), placed);
}

function svg(width: number, height: number, parts: string[]): string {
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="system-ui,sans-serif" fill="#1d2430"><rect width="100%" height="100%" fill="#fff"/>${parts.join('')}</svg>`;
}
