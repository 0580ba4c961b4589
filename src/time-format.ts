/**
 * The one way lease-ops shows a moment to a person (pages, CLI): ISO 8601 in UTC, and how
 * long ago (or how far ahead) it is. JSON keeps epoch ms, for programs.
 */
export function isoUtc(ms: number): string {
  return new Date(ms).toISOString();
}

/** A duration in the largest unit that keeps it readable: 850 ms, 4.2 s, 3 min 20 s, 2 h 5 min, 3 d 4 h. */
export function duration(ms: number): string {
  const abs = Math.abs(ms);
  if (abs < 1_000) return `${Math.round(abs)} ms`;
  if (abs < 60_000) return `${(abs / 1_000).toFixed(abs < 10_000 ? 2 : 1)} s`;
  const s = Math.round(abs / 1_000);
  if (s < 3_600) return `${Math.floor(s / 60)} min${s % 60 ? ` ${s % 60} s` : ''}`;
  if (s < 86_400) return `${Math.floor(s / 3_600)} h${Math.floor((s % 3_600) / 60) ? ` ${Math.floor((s % 3_600) / 60)} min` : ''}`;
  return `${Math.floor(s / 86_400)} d${Math.floor((s % 86_400) / 3_600) ? ` ${Math.floor((s % 86_400) / 3_600)} h` : ''}`;
}

/** `ago`: relative to `now`, "12 s ago" or "in 3 s". */
export function relative(ms: number, now: number): string {
  return ms <= now ? `${duration(now - ms)} ago` : `in ${duration(ms - now)}`;
}

/** ISO UTC plus relative: `2026-12-04T16:40:00.123Z (12 s ago)`. */
export function moment(ms: number, now: number): string {
  return `${isoUtc(ms)} (${relative(ms, now)})`;
}
