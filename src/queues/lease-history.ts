import { z } from 'zod';
import type { Logger } from '../logger.ts';
import { withoutInfrastructure } from '../secrets.ts';
import { luaCommand, type LuaCommand } from './lua-scripts.ts';
import type { RedisClient } from './redis.ts';

/** Entries a lease's history keeps (includes/history.lua trims to it): an attempt's start and end are one. */
export const HISTORY_CAPACITY = 200;

/** A lease's history: a list of its last events (includes/history.lua keeps 200 entries, for a week). */
export function historyKey(prefix: string, laneId: string): string {
  return `${prefix}:history:${laneId}`;
}

/**
 * What happened to a lease, one event at a time:
 *   accepted     an operation joined the lane, `ahead` of it (0: it is the head)
 *   absorbed     an identical request was answered with a queued one (`by`)
 *   started      an attempt began (`attempt`, 1 for the first); not stored on its own: an
 *                attempt's end carries how long it ran (`ran`, ms), and reading gives it back
 *                as a start that long before (a running attempt's start comes from its job)
 *   observed     an attempt saw the sandbox in a new state
 *   backing-off  the attempt ended with a settling or transient error; retry at `until`
 *   completed / failed   the operation ended
 *   stuck        the watchdog found the sandbox stopping too long and queued a force-stop (`job`)
 *   removed      an operator removed a waiting operation (Bull Board)
 *   cancelled / rerun   an operator cancelled a waiting operation, or ran a failed one again
 *   paused / unpaused   an operator paused the lane (nothing new starts), or unpaused it
 *   acknowledged an operator saw the lease's failures: they leave the attention list
 *   named        an acquire's sandbox became a second name of this lease (`sandbox`), or could
 *                not (its id had a lane of its own already: `message` says so)
 */
export const HISTORY_EVENT_KINDS = [
  'accepted',
  'absorbed',
  'started',
  'observed',
  'backing-off',
  'completed',
  'failed',
  'stuck',
  'removed',
  'cancelled',
  'rerun',
  'paused',
  'unpaused',
  'named',
  'acknowledged',
] as const;
export type HistoryEventKind = (typeof HISTORY_EVENT_KINDS)[number];

const optionalNumber = z.coerce.number().int().optional();
const FieldsSchema = z.object({
  e: z.enum(HISTORY_EVENT_KINDS),
  job: z.string().optional(),
  op: z.string().optional(),
  ahead: optionalNumber,
  /** `accepted`: the operation's acceptedAt, written by lane-push (the entry's own time is Redis' at the push). */
  at: optionalNumber,
  attempt: optionalNumber,
  until: optionalNumber,
  since: optionalNumber,
  by: z.string().optional(),
  code: z.string().optional(),
  message: z.string().optional(),
  state: z.string().optional(),
  providerState: z.string().optional(),
  sandbox: z.string().optional(),
  ran: optionalNumber,
});

export interface HistoryEvent {
  /** Epoch ms, Redis' clock. */
  at: number;
  kind: HistoryEventKind;
  jobId: string | null;
  op?: string;
  ahead?: number;
  attempt?: number;
  until?: number;
  since?: number;
  by?: string;
  code?: string;
  message?: string;
  state?: string;
  providerState?: string;
  sandbox?: string;
}

type EventInput = { kind: Exclude<HistoryEventKind, 'accepted' | 'absorbed' | 'observed' | 'started'>; jobId: string } & Partial<
  Pick<HistoryEvent, 'op' | 'attempt' | 'until' | 'since' | 'code' | 'message' | 'sandbox'>
> & {
  /** How long the attempt that ends here ran (ms): its start is read back from this. */
  ran?: number;
};

/**
 * An event as one history entry holds it (without the time, which Redis adds): the pairs
 * joined by the separator, values bounded and without it. The lane scripts write an
 * attempt's end with the lane step it belongs to (lane-release, lane-yield).
 */
export function historyEntry(event: EventInput): string {
  const fields: string[] = ['e', event.kind, 'job', historyValue(event.jobId)];
  for (const name of ['op', 'attempt', 'until', 'since', 'code', 'sandbox'] as const) {
    const value = event[name];
    if (value !== undefined) fields.push(name, historyValue(String(value)));
  }
  if (event.ran !== undefined) fields.push('ran', String(Math.max(0, Math.round(event.ran))));
  // Callers read messages: no addresses or paths of the infrastructure in them.
  if (event.message !== undefined) fields.push('message', historyValue(withoutInfrastructure(event.message).slice(0, 500)));
  return fields.join(SEPARATOR);
}

/**
 * An event written by lane-push with the operation it is about, just before that one's
 * `accepted` (the watchdog's `stuck` with its force-stop, an operator's `rerun`): its kind,
 * and its fields after the job id, which the script fills in.
 */
export type HistoryNote = { kind: 'stuck' | 'rerun'; fields: string };

export function historyNote(event: Omit<EventInput, 'jobId'> & { kind: 'stuck' | 'rerun' }): HistoryNote {
  const entry = historyEntry({ ...event, jobId: '' });
  // ['e', kind, 'job', '', ...rest]: the rest, after the four.
  return { kind: event.kind, fields: entry.split(SEPARATOR).slice(4).join(SEPARATOR) };
}

/** Reads and appends a lease's history (accepted, absorbed and observed are written by the lane and record scripts). */
export class LeaseHistory {
  private readonly appendScript: LuaCommand;

  constructor(
    private readonly redis: RedisClient,
    private readonly prefix: string,
    private readonly log: Logger | null = null,
  ) {
    this.appendScript = luaCommand(redis, 'history-append', 1, prefix);
  }

  /**
   * Sent without waiting for the answer: the history explains, it decides nothing, and an
   * attempt must not wait a round trip for it. A failed append is logged and forgotten.
   */
  append(laneId: string, event: EventInput): void {
    this.appendScript(historyKey(this.prefix, laneId), historyEntry(event)).catch((err: unknown) => this.log?.debug({ err, laneId }, 'history append failed'));
  }

  /** How many entries the lease's history holds (HISTORY_CAPACITY once it drops its oldest). */
  async entries(laneId: string): Promise<number> {
    return this.redis.llen(historyKey(this.prefix, laneId));
  }

  /** The last `limit` events, oldest first; entries this version cannot read are skipped. */
  async read(laneId: string, limit = HISTORY_CAPACITY): Promise<HistoryEvent[]> {
    const entries = await this.redis.lrange(historyKey(this.prefix, laneId), -limit, -1);
    const events: HistoryEvent[] = [];
    for (const entry of entries) {
      const [at, ...flat] = entry.split(SEPARATOR);
      const record: Record<string, string> = {};
      for (let i = 0; i + 1 < flat.length; i += 2) record[flat[i]!] = flat[i + 1]!;
      const parsed = FieldsSchema.safeParse(record);
      if (!parsed.success || !/^\d+$/.test(at ?? '')) continue;
      const { e, job, ran, at: stated, ...rest } = parsed.data;
      // An acceptance is dated as its operation says (never after the push: clocks may differ).
      const event: HistoryEvent = { at: stated === undefined ? Number(at) : Math.min(stated, Number(at)), kind: e, jobId: job || null };
      for (const [name, value] of Object.entries(rest)) if (value !== undefined && value !== '') (event as unknown as Record<string, unknown>)[name] = value;
      if (ran !== undefined) {
        const started: HistoryEvent = { at: event.at - ran, kind: 'started', jobId: event.jobId };
        if (event.op !== undefined) started.op = event.op;
        if (event.attempt !== undefined) started.attempt = event.attempt;
        placeStart(events, started);
      }
      events.push(event);
    }
    return events.sort((a, b) => a.at - b.at);
  }
}

/** The kinds that end an attempt (the lane runs one attempt at a time). */
const ATTEMPT_ENDS: ReadonlySet<HistoryEventKind> = new Set(['backing-off', 'completed', 'failed']);

/**
 * Puts an attempt's start into `events` (oldest first) after the attempt before it ended and
 * before the first thing this attempt saw. A start read back from its end's `ran` lands late
 * by the time the end's lane step took to reach Redis (`ran` is measured before it is sent),
 * and a running attempt's start is its worker's clock: neither may put the start after what
 * the attempt observed. The caller sorts by time afterwards, which keeps this order (stable,
 * and the start is never later than that observation).
 */
export function placeStart(events: HistoryEvent[], started: HistoryEvent): void {
  let from = events.length;
  while (from > 0 && !ATTEMPT_ENDS.has(events[from - 1]!.kind)) from--;
  if (from > 0) started.at = Math.max(started.at, events[from - 1]!.at);
  const seen = events.findIndex((e, i) => i >= from && e.kind === 'observed');
  if (seen === -1) {
    events.push(started);
    return;
  }
  started.at = Math.min(started.at, events[seen]!.at);
  events.splice(seen, 0, started);
}

/** What separates an entry's parts (includes/history.lua): the unit separator. */
const SEPARATOR = '\x1f';

/** A value as an entry holds it: without the separator. */
export function historyValue(value: string): string {
  return value.includes(SEPARATOR) ? value.replaceAll(SEPARATOR, ' ') : value;
}
