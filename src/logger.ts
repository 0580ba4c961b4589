import { pino, type Logger } from 'pino';

export type { Logger };

/** Paths that may carry secrets; pino replaces their values before anything is written. */
export const REDACT_PATHS = [
  'apiKey',
  'token',
  'password',
  'authorization',
  '*.apiKey',
  '*.token',
  '*.password',
  '*.authorization',
  'headers.authorization',
  'req.headers.authorization',
  'req.headers.cookie',
  'res.headers["set-cookie"]',
  'config.apiKey',
];

/** How log lines are written: `json` (one object a line, for collectors) or `pretty` (for a person at a terminal). */
export type LogFormat = 'json' | 'pretty';

/** LEASE_OPS_LOG_FORMAT: `auto` is pretty when the output is a terminal, JSON otherwise. */
export function logFormat(setting: 'auto' | LogFormat, output: { isTTY?: boolean } = process.stdout): LogFormat {
  return setting === 'auto' ? (output.isTTY ? 'pretty' : 'json') : setting;
}

export function createLogger(opts: { level?: string; name?: string; destination?: pino.DestinationStream; format?: LogFormat } = {}): Logger {
  const destination = opts.destination ?? (opts.format === 'pretty' ? prettyStream(process.stdout) : undefined);
  return pino(
    {
      name: opts.name ?? 'lease-ops',
      level: opts.level ?? 'info',
      redact: { paths: REDACT_PATHS, censor: '[redacted]' },
      base: { pid: process.pid },
    },
    destination,
  );
}

const LEVELS: Record<number, string> = { 10: 'TRACE', 20: 'DEBUG', 30: 'INFO ', 40: 'WARN ', 50: 'ERROR', 60: 'FATAL' };
const COLOURS: Record<number, string> = { 10: '90', 20: '90', 30: '36', 40: '33', 50: '31', 60: '35' };
/** What every line has and the pretty form shows in its own place, or leaves out. */
const SHOWN_APART = new Set(['level', 'time', 'msg', 'name', 'pid', 'hostname', 'v']);

/** A field's value, short: strings bare (quoted when they hold a space), the rest as JSON. */
function fieldValue(value: unknown): string {
  if (typeof value === 'string') return /[\s"=]/.test(value) ? JSON.stringify(value) : value;
  if (value && typeof value === 'object' && 'message' in value && ('type' in value || 'stack' in value)) {
    const err = value as { type?: string; message?: string; code?: string };
    return JSON.stringify(`${err.type ?? 'Error'}${err.code ? ` ${err.code}` : ''}: ${err.message ?? ''}`);
  }
  return JSON.stringify(value);
}

/**
 * Formats pino's JSON lines for a person: `2026-12-04T16:55:18.123Z INFO  lease-ops-worker:
 * message  lease=... job=... op=...`, the level coloured when `out` is a terminal. One time
 * format, ISO 8601 in UTC, as everywhere lease-ops shows a moment. Redaction happened before.
 */
export function prettyStream(out: { write(text: string): unknown; isTTY?: boolean }): pino.DestinationStream {
  const colour = out.isTTY === true && !process.env.NO_COLOR;
  return {
    write(line: string) {
      let record: Record<string, unknown>;
      try {
        record = JSON.parse(line) as Record<string, unknown>;
      } catch {
        out.write(line);
        return;
      }
      const level = typeof record.level === 'number' ? record.level : 30;
      const label = LEVELS[level] ?? String(level).padEnd(5);
      const at = typeof record.time === 'number' ? new Date(record.time).toISOString() : '';
      const fields = Object.entries(record)
        .filter(([key, value]) => !SHOWN_APART.has(key) && value !== undefined)
        .map(([key, value]) => `${key}=${fieldValue(value)}`)
        .join(' ');
      const name = typeof record.name === 'string' ? `${record.name}: ` : '';
      const lvl = colour ? `\x1b[${COLOURS[level] ?? '0'}m${label}\x1b[0m` : label;
      // An error's stack under an error line (as the JSON form keeps it), indented.
      const stack = level >= 50 ? (record.err as { stack?: unknown } | undefined)?.stack : undefined;
      const trace = typeof stack === 'string' ? `${stack.split('\n').slice(1).map((l) => `    ${l.trim()}`).join('\n')}\n` : '';
      out.write(`${at} ${lvl} ${name}${String(record.msg ?? '')}${fields ? `  ${fields}` : ''}\n${trace}`);
    },
  };
}
