import { Worker } from 'node:worker_threads';
import type { LeaseOpsClient } from '../client.ts';
import type { Config } from '../config.ts';
import type { Logger } from '../logger.ts';
import { RedisUnavailableError } from '../errors.ts';
import { faultPoint } from '../fault-points.ts';
import { LayoutError } from '../queues/layout.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { AttentionItem, AttentionScope, LeaseTimeline, QueueOverview } from '../queues/inspect.ts';
import { canSee, scopeOf, type Principal } from './auth.ts';
import { CompanyTurns } from './company-turns.ts';
import { HttpError } from './http-error.ts';

/**
 * The walks a tenant may ask for (its attention, a lease's timeline): each reads many records
 * and builds many items. Run in the API's own event loop, one company's walks held every other
 * request behind them (issue 27: B's enqueue p99 went 7-23x while A walked its attention).
 */
export interface Walks {
  /** `gone` aborts when the caller hangs up: a walk still waiting its turn is dropped then. */
  attentionPage(offset: number, limit: number, principal: Principal, gone?: AbortSignal): Promise<{ items: AttentionItem[]; next: number | null }>;
  timeline(lease: LeaseIdentity, principal: Principal, gone?: AbortSignal): Promise<LeaseTimeline>;
  /** The admin's overview: it reads the first 200 attention items of every company. */
  overview(principal: Principal, gone?: AbortSignal): Promise<QueueOverview>;
  close(): Promise<void>;
}

/** Walks of one company that may wait for its turn in the threads; past them, 429 `company_walks_full`. */
export const WALKS_WAITING_PER_COMPANY = 4;

/**
 * A walk that sent more Redis commands than this (a company's attention over some 600 leases
 * or more) makes its company's walks of that kind heavy for HEAVY_WALKS_FOR_MS: they run in the
 * background threads from its next one on. Ten minutes, so that a company walking its long
 * list every few minutes stays there (helper-51: with one minute, a poller at 61 s never got there).
 */
export const HEAVY_WALK_COMMANDS = 2_000;
/**
 * A company whose scope index holds more entries than this (about what a walk of HEAVY_WALK_COMMANDS
 * reads, three reads an entry) walks its attention as heavy from its first walk: counted before
 * it runs (one ZLEXCOUNT a partition), not learnt when it ends.
 */
export const HEAVY_ATTENTION_ENTRIES = 600;
const HEAVY_WALKS_FOR_MS = 10 * 60_000;
/**
 * The nice value of a background walk thread (Linux: per thread). Not 19: a heavy walk that
 * takes 100 ms took 3-8 s at nice 19 beside two busy processes (helper-51); at 10 it gets
 * about a tenth of a core they contend for.
 */
export const BACKGROUND_WALK_NICE = 10;

/** How long after a walk that Redis did not answer the next walk to get its turn fails at once. */
const REDIS_FAILED_RECENTLY_MS = 1_000;

/** Walks in the caller's event loop (tests, embedded use, LEASE_OPS_API_WALK_THREADS=0). */
export function walksInProcess(client: LeaseOpsClient): Walks {
  return {
    attentionPage: async (offset, limit, principal) => {
      const page = await client.attentionPage(offset, limit, (lease) => canSee(principal, lease), scopeOf(principal));
      await faultPoint('walk');
      return page;
    },
    timeline: (lease) => client.getLeaseTimeline(lease),
    overview: async () => {
      const overview = await client.overview();
      await faultPoint('walk');
      return overview;
    },
    close: async () => undefined,
  };
}

/** What a walk thread is asked (with an id in its message). */
export type WalkAsk = { kind: 'attentionPage'; offset: number; limit: number; principal: Principal } | { kind: 'timeline'; lease: LeaseIdentity } | { kind: 'overview' };
/** A walk's answer, with the Redis commands it sent (what it is charged). */
export type WalkReply = { id: number; commands: number; value: unknown } | { id: number; commands: number; error: { name: string; message: string; code?: string; layout?: boolean; url?: string; timeoutMs?: number; credentialsRefused?: boolean } };

interface Pending {
  request: WalkAsk;
  /** The company the walk is charged to (null: an admin's, not limited). */
  companyId: string | null;
  resolve: (value: unknown) => void;
  reject: (err: unknown) => void;
  /** Gives its company's walk turn back (the next of its line goes). */
  done: () => void;
}

/**
 * Walks in worker threads, each with its own Redis connection: the API's event loop only
 * parses requests and writes answers. A company has one walk in a thread at a time (its others
 * wait their turn, in order: CompanyTurns with one turn), and a walk goes to the thread with
 * the fewest in hand: with two threads or more, one company's walks leave a thread free for
 * everyone else's.
 *
 * With two threads or more, the last half (rounded down) are background threads, at a lower
 * CPU priority where the OS sets it per thread (Linux). A company whose walk of one kind (its
 * attention, a timeline, the overview) sent more than HEAVY_WALK_COMMANDS walks that kind
 * there, and only there, for ten minutes; every other walk goes to a foreground thread (the one
 * with the fewest in hand), never beside a heavy one. On a small machine a heavy walk holds a
 * core for 100 ms or more, and another company's short walk that met it took about twice as
 * long (issue 27's walks); in a background thread it gives way to everything else. A scoped
 * attention walk is also weighed before it runs, by its company's entries of the scope index
 * (HEAVY_ATTENTION_ENTRIES), so its first heavy one goes there too; a company's first heavy
 * walk of another kind in ten minutes runs in a foreground thread: its cost is known when it ends.
 */
export class WalkThreads implements Walks {
  private readonly threads: { worker: Worker; inHand: Map<number, Pending>; background: boolean }[] = [];
  /** Until when walks are heavy (ms), by company (the admin's: '') and kind of walk: heavyKey. */
  private readonly heavyUntil = new Map<string, number>();
  /** Walks sent to each kind of thread (for /metrics). */
  readonly walksByThread = { foreground: 0, background: 0 };
  private readonly turns = new CompanyTurns(1, WALKS_WAITING_PER_COMPANY);
  /** An admin's walks share one turn (an operator's, few) and are not held to the line's length. */
  private readonly adminTurns = new CompanyTurns(1, Number.POSITIVE_INFINITY);
  /** Walks not settled yet, in hand or in line: failed at close. */
  private readonly open = new Set<Pending>();
  private nextId = 1;
  private closed = false;
  /**
   * By line (a company's, the admin's), its last walk that Redis did not answer (monotonic ms,
   * and its error): the next of that line whose turn comes within REDIS_FAILED_RECENTLY_MS
   * fails the same way at once, rather than each walk in line waiting out a background
   * thread's Redis timeout in turn (helper-59: a hung Redis held a heavy company's line, and
   * its turns, 20 s a walk). Another line's walks ask Redis themselves (helper-60: one
   * company's failure failed another's walks after Redis had recovered).
   */
  private readonly redisFailed = new Map<string, { at: number; error: Extract<WalkReply, { error: unknown }>['error'] }>();

  /** Redis commands each company's walks sent (for /metrics). */
  readonly commandsByCompany = new Map<string, number>();

  /**
   * `charge` is told what each company's walk cost (the Redis commands it sent): the API
   * counts it against the company's walk rate (CompanyRateLimiter.chargeWalk). `attentionEntries`
   * counts a scope's entries of the scope index (LeaseOpsClient.attentionEntries), so that a
   * company's first heavy attention walk in ten minutes goes to the background threads too.
   */
  constructor(
    private readonly config: Config,
    private readonly count: number,
    private readonly log?: Logger,
    private readonly charge?: (companyId: string, commands: number) => void,
    private readonly attentionEntries?: (scope: AttentionScope) => Promise<number>,
  ) {}

  /** Threads from this index on are background ones. */
  private get firstBackground(): number {
    return this.count - Math.floor(this.count / 2);
  }

  private start(index: number): Worker {
    const fromSources = import.meta.url.endsWith('.ts');
    const file = new URL(fromSources ? './walk-thread.ts' : './walk-thread.js', import.meta.url);
    const workerData = { config: this.config, nice: index >= this.firstBackground ? BACKGROUND_WALK_NICE : 0 };
    // From the sources (the tests), the thread registers tsx's loader first, as `--import tsx` would.
    const worker = fromSources
      ? new Worker(`import('tsx/esm/api').then(({ register }) => { register(); return import(${JSON.stringify(file.href)}); });`, { eval: true, workerData })
      : new Worker(file, { workerData });
    worker.unref();
    worker.on('message', (reply: WalkReply) => this.settle(index, reply));
    worker.on('error', (err) => this.log?.error({ err }, 'a walk thread failed; a new one takes its place'));
    worker.on('exit', () => {
      const thread = this.threads[index];
      if (!thread || thread.worker !== worker) return;
      // A thread that died (out of memory, say) fails what it held, and a new one takes its place.
      const held = [...thread.inHand.values()];
      thread.inHand.clear();
      if (!this.closed) thread.worker = this.start(index);
      for (const pending of held) this.finish(pending, () => pending.reject(walkUnavailable('its walk thread exited')));
    });
    return worker;
  }

  attentionPage(offset: number, limit: number, principal: Principal, gone?: AbortSignal): Promise<{ items: AttentionItem[]; next: number | null }> {
    return this.run({ kind: 'attentionPage', offset, limit, principal }, principal, gone) as Promise<{ items: AttentionItem[]; next: number | null }>;
  }

  timeline(lease: LeaseIdentity, principal: Principal, gone?: AbortSignal): Promise<LeaseTimeline> {
    return this.run({ kind: 'timeline', lease }, principal, gone) as Promise<LeaseTimeline>;
  }

  overview(principal: Principal, gone?: AbortSignal): Promise<QueueOverview> {
    return this.run({ kind: 'overview' }, principal, gone) as Promise<QueueOverview>;
  }

  private run(request: WalkAsk, principal: Principal, gone?: AbortSignal): Promise<unknown> {
    if (this.closed) return Promise.reject(walkUnavailable('the API is closing'));
    return new Promise((resolve, reject) => {
      let sent = false;
      const pending: Pending = { request, companyId: principal.admin ? null : (principal.companyId ?? null), resolve, reject, done: () => turn?.done() };
      // A company's walks wait in a short line: one that hangs up and asks again cannot grow
      // it (helper-15: 79 walks nobody waited for, Redis busy 18 s after the attack).
      const turn = (principal.admin ? this.adminTurns : this.turns).take(principal.companyId ?? '', () => {
        sent = true;
        const failed = this.redisFailed.get(lineOf(pending));
        if (failed && performance.now() - failed.at < REDIS_FAILED_RECENTLY_MS) {
          this.finish(pending, () => reject(rebuiltError(failed.error)));
          return;
        }
        void this.weigh(pending, principal).then(() => {
          // Closed while it was weighed: close() failed it already.
          if (this.open.has(pending)) this.send(pending);
        });
      });
      if (!turn) {
        reject(new HttpError(429, 'company_walks_full', `the company already has ${WALKS_WAITING_PER_COMPANY} walks waiting for their turn (attention, timelines): retry after one ends`, { retryAfterS: 1 }));
        return;
      }
      this.open.add(pending);
      gone?.addEventListener(
        'abort',
        () => {
          // One in a thread runs to its end; one still in line leaves it.
          if (sent) return;
          this.open.delete(pending);
          turn.done();
          reject(walkUnavailable('the caller hung up'));
        },
        { once: true },
      );
    });
  }

  /**
   * Marks a scoped attention walk heavy before it runs when its company's entries say it will be
   * (HEAVY_ATTENTION_ENTRIES). A count that fails leaves it to be learnt when the walk ends.
   */
  private async weigh(pending: Pending, principal: Principal): Promise<void> {
    const scope = scopeOf(principal);
    if (pending.request.kind !== 'attentionPage' || !scope || !this.attentionEntries) return;
    if (this.isHeavy(pending)) return;
    const entries = await this.attentionEntries(scope).catch(() => 0);
    if (entries > HEAVY_ATTENTION_ENTRIES) this.markHeavy(heavyKey(pending));
  }

  private send(pending: Pending): void {
    // Started at the first walk: an API that is never asked for one loads no thread.
    while (this.threads.length < this.count) this.threads.push({ worker: this.start(this.threads.length), inHand: new Map(), background: this.threads.length >= this.firstBackground });
    const heavy = this.isHeavy(pending);
    // With no background thread (one thread in all) every walk goes to the one there is.
    const candidates = this.threads.some((t) => t.background) ? this.threads.filter((t) => t.background === heavy) : this.threads;
    const thread = candidates.reduce((least, t) => (t.inHand.size < least.inHand.size ? t : least));
    this.walksByThread[thread.background ? 'background' : 'foreground']++;
    const id = this.nextId++;
    thread.inHand.set(id, pending);
    thread.worker.postMessage({ ...pending.request, id });
  }

  private settle(index: number, reply: WalkReply): void {
    const thread = this.threads[index]!;
    const pending = thread.inHand.get(reply.id);
    if (!pending) return;
    thread.inHand.delete(reply.id);
    if (reply.commands > HEAVY_WALK_COMMANDS) this.markHeavy(heavyKey(pending));
    if (pending.companyId !== null) {
      this.commandsByCompany.set(pending.companyId, (this.commandsByCompany.get(pending.companyId) ?? 0) + reply.commands);
      this.charge?.(pending.companyId, reply.commands);
    }
    if ('error' in reply && reply.error.name === 'RedisUnavailableError') {
      const now = performance.now();
      // One entry per line that failed lately: the lapsed go as it grows.
      if (this.redisFailed.size >= 1_000) for (const [line, failed] of this.redisFailed) if (now - failed.at >= REDIS_FAILED_RECENTLY_MS) this.redisFailed.delete(line);
      this.redisFailed.set(lineOf(pending), { at: now, error: reply.error });
    }
    this.finish(pending, () => ('error' in reply ? pending.reject(rebuiltError(reply.error)) : pending.resolve(reply.value)));
  }

  /** Whether its company's walks of its kind are heavy now (see markHeavy). */
  private isHeavy(pending: Pending): boolean {
    return (this.heavyUntil.get(heavyKey(pending)) ?? 0) > Date.now();
  }

  private markHeavy(key: string): void {
    const now = Date.now();
    // One entry per company and kind that walked heavily lately: the lapsed go as it grows.
    if (this.heavyUntil.size >= 1_000) for (const [k, until] of this.heavyUntil) if (until <= now) this.heavyUntil.delete(k);
    this.heavyUntil.set(key, now + HEAVY_WALKS_FOR_MS);
  }

  /** Settles a walk, then gives its company's turn to the next of its line, if one waits. */
  private finish(pending: Pending, settle: () => void): void {
    settle();
    this.open.delete(pending);
    pending.done();
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const pending of this.open) pending.reject(walkUnavailable('the API is closing'));
    this.open.clear();
    await Promise.all(this.threads.map((t) => t.worker.terminate()));
  }
}

/** What a walk's weight is kept under: its company (the admin's: '') and its kind. */
const heavyKey = (pending: Pending) => `${pending.companyId ?? ''}\n${pending.request.kind}`;

/** A walk that could not run (its thread died, the API closes, its caller left): 503, try again. */
const walkUnavailable = (why: string) => new HttpError(503, 'walk_unavailable', `the walk did not run: ${why}; retry`, { retryAfterS: 1 });

/** The line a walk waits in for its turn: its company's, or the admin's (companyId null). */
function lineOf(pending: Pending): string {
  return pending.companyId === null ? '' : `company:${pending.companyId}`;
}

/**
 * The thread's error as the API's handler knows it: Redis down stays a 503, a partition count
 * that differs from the deployment's stays a LayoutError (503, detail in the log).
 */
function rebuiltError(error: Extract<WalkReply, { error: unknown }>['error']): Error {
  if (error.name === 'RedisUnavailableError') return new RedisUnavailableError(error.url ?? '', error.timeoutMs ?? 0, undefined, error.credentialsRefused ?? false);
  if (error.layout && error.code) return new LayoutError(error.code, error.message);
  return new Error(error.message);
}
