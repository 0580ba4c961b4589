import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { Job, type JobType } from 'bullmq';
import { laneIdOfJobId } from '../lease.ts';
import { codeOf, failedBeforeItRan } from '../queues/inspect.ts';
import { parsePause } from '../queues/lane.ts';
import { OperationJobDataSchema } from '../operations.ts';
import type { OperationsQueue } from '../queues/operations-queue.ts';
import { withoutInfrastructure } from '../secrets.ts';
import { isoUtc } from '../time-format.ts';
import { timelinePath } from './pages.ts';

type Options = ConstructorParameters<typeof BullMQAdapter>[1];

/** Where a job stands in its lane, read in one round trip for a page of jobs. */
interface Place {
  parked: boolean;
  outcome: string | null;
  position: number | null;
  holder: string | null;
  retryAt: number | null;
  head: string | null;
  /** The head's operation (its BullMQ job name), when it is another job. */
  headOp: string | null;
  /** The lane is paused: by whom, since when. */
  paused: { by: string; since: number } | null;
}

/** The lane's recorded outcome of a finished job ('completed' or 'failed'), if it is readable. */
function outcomeStatus(text: string | null): string | null {
  if (!text) return null;
  try {
    const status = (JSON.parse(text) as { status?: unknown }).status;
    return status === 'completed' || status === 'failed' ? status : null;
  } catch {
    return null;
  }
}


/** The failure code the lane recorded for a finished job, if it is readable. */
function outcomeCode(text: string | null): string | null {
  if (!text) return null;
  try {
    const code = (JSON.parse(text) as { code?: unknown }).code;
    return typeof code === 'string' ? code : null;
  } catch {
    return null;
  }
}


/**
 * Bull Board's view of the operations queue, told the way lease-ops runs it. BullMQ keeps an
 * operation that waits its turn in its lane as a delayed job (parked until its deadline), so
 * the board would say "Will run at" a day away: here a queued job shows no delay and its
 * name says where it stands (queued behind N, next, executing, backing off until T with the
 * last error). Names read `stop · acme/prod/<lease> · ...`; failed jobs show their code and
 * message without stack traces or server paths; each job links to its lease's timeline.
 * Only what the board displays changes: the Job objects actions run on are BullMQ's own.
 */
export class LeaseOpsBoardAdapter extends BullMQAdapter {
  constructor(
    private readonly ops: OperationsQueue,
    options: Options = {},
  ) {
    super(ops.queue, {
      ...options,
      // A finished operation's retry is a rerun of a failed one (the API's); a completed one is
      // not run again. (Bull Board reads this option, its types leave it out.)
      ...({ allowCompletedRetries: false } as object),
      description:
        'Operations of every lease. BullMQ lists an operation waiting its turn in its lane as delayed; each name says where it stands: queued behind N, next, executing, or backing off until a time.',
      externalJobUrl: (job) => {
        const parsed = OperationJobDataSchema.safeParse(job.data);
        return parsed.success ? { href: timelinePath(parsed.data.lease), displayText: 'lease timeline' } : { href: '/ui/attention', displayText: 'attention' };
      },
    });
  }

  /**
   * BullMQ's own listing fails the whole page (a 500) on one job whose data it cannot parse
   * (written into Redis by hand, or by something else than lease-ops): read job by job, and
   * list such a job by its id, as unreadable.
   */
  override async getJobs(...args: Parameters<BullMQAdapter['getJobs']>): ReturnType<BullMQAdapter['getJobs']> {
    let jobs: Job[];
    try {
      jobs = (await super.getJobs(...args)) as unknown as Job[];
    } catch (err) {
      if (!(err instanceof SyntaxError)) throw err;
      const [statuses, start, end] = args;
      // sanitizeJobTypes is BullMQ's (protected in its typings; pinned by test/bullmq-contract.test.ts).
      const queue = this.ops.queue as unknown as { sanitizeJobTypes(types: unknown): JobType[]; getRanges(types: JobType[], start?: number, end?: number, asc?: boolean): Promise<string[]> };
      // The ids as BullMQ's getJobs lists them (its own names of the states, newest first).
      const ids = await queue.getRanges(queue.sanitizeJobTypes(statuses), start, end, false);
      jobs = (await Promise.all(ids.map((id) => this.readJob(id)))).filter((job): job is Job => job !== null);
    }
    await this.tell(jobs);
    return jobs as unknown as Awaited<ReturnType<BullMQAdapter['getJobs']>>;
  }

  override async getJob(...args: Parameters<BullMQAdapter['getJob']>): ReturnType<BullMQAdapter['getJob']> {
    const job = await this.readJob(args[0]);
    if (job) await this.tell([job]);
    return job as unknown as Awaited<ReturnType<BullMQAdapter['getJob']>>;
  }

  private async readJob(id: string): Promise<Job | null> {
    try {
      return (await Job.fromId(this.ops.queue, id)) ?? null;
    } catch (err) {
      if (!(err instanceof SyntaxError)) throw err;
      return new Job(this.ops.queue, 'unreadable job (its data is not JSON)', {}, {}, id);
    }
  }

  /** Gives each job a toJSON that says where it stands (the board formats jobs from toJSON). */
  private async tell(jobs: Job[]): Promise<void> {
    const places = await this.places(jobs);
    jobs.forEach((job, i) => {
      const place = places[i];
      if (!place) return;
      const own = job.toJSON.bind(job);
      const told = () => this.told(job, own(), place);
      Object.defineProperty(job, 'toJSON', { value: told, configurable: true });
    });
  }

  private async places(jobs: Job[]): Promise<(Place | null)[]> {
    const lanes = this.ops.lanes;
    const pipeline = this.ops.connection.pipeline();
    const laneIds = jobs.map((job) => (job.id ? laneIdOfJobId(job.id) : null));
    jobs.forEach((job, i) => {
      const laneId = laneIds[i];
      if (!job.id || !laneId) return;
      pipeline
        .hmget(this.ops.queue.toKey(job.id), 'lo:parked', 'lo:outcome')
        .lpos(lanes.listKey(laneId), job.id)
        .hget(lanes.execKey(laneId), 'job')
        .zscore(lanes.backingOffKey, job.id)
        .lindex(lanes.listKey(laneId), 0)
        .hget(lanes.pausedKey, laneId);
    });
    const results = (await pipeline.exec()) ?? [];
    // The heads' operations, so a job behind one names it (a second round trip, for the page's distinct heads).
    const heads = [...new Set(results.filter((_, k) => k % 6 === 4).map(([err, value]) => (err ? null : value)).filter((id): id is string => typeof id === 'string'))];
    const headOps = new Map<string, string | null>();
    if (heads.length) {
      const names = await this.ops.connection.pipeline(heads.map((id) => ['hget', this.ops.queue.toKey(id), 'name'])).exec();
      heads.forEach((id, k) => headOps.set(id, (names?.[k]?.[1] as string | null | undefined) ?? null));
    }
    let at = 0;
    return jobs.map((job, i) => {
      if (!job.id || !laneIds[i]) return null;
      const [hash, position, holder, retryAt, head, pause] = results.slice(at, (at += 6)).map(([err, value]) => (err ? null : value));
      const [parked, outcome] = (hash as (string | null)[] | null) ?? [null, null];
      return {
        parked: parked === '1',
        outcome: outcome ?? null,
        position: typeof position === 'number' ? position : null,
        holder: (holder as string | null) ?? null,
        retryAt: retryAt === null || retryAt === undefined ? null : Number(retryAt),
        head: (head as string | null) ?? null,
        headOp: typeof head === 'string' ? (headOps.get(head) ?? null) : null,
        paused: typeof pause === 'string' ? parsePause(pause) : null,
      };
    });
  }

  private told(job: Job, json: ReturnType<Job['toJSON']>, place: Place): ReturnType<Job['toJSON']> {
    const parsed = OperationJobDataSchema.safeParse(job.data);
    const who = parsed.success ? `${parsed.data.op} · ${parsed.data.lease.companyId}/${parsed.data.lease.environmentId}/${parsed.data.lease.leaseId}` : json.name;
    const told = { ...json, opts: { ...json.opts } };
    const lastError = json.failedReason ? withoutInfrastructure(json.failedReason) : null;
    let where: string;
    // Where the lane's head is: a job behind it names it (its job id finds it on the board);
    // the head says it is the head.
    const isHead = place.position === 0 || place.head === job.id;
    const behind = (n: number) => `queued behind ${n}${place.head && place.head !== job.id ? ` (lane head: ${place.headOp ?? 'job'} ${place.head})` : ''}`;
    const headMark = isHead ? 'lane head, ' : '';
    if (json.finishedOn) {
      where = outcomeStatus(place.outcome) ?? (json.returnvalue === null || json.returnvalue === undefined ? 'failed' : 'completed');
    } else if (place.holder === job.id) {
      where = `lane head, executing, attempt ${json.attemptsMade + 1}`;
    } else if (place.paused && place.position !== null) {
      where = `${headMark}paused by ${place.paused.by} since ${isoUtc(place.paused.since)}: runs once the lane is unpaused${place.position > 0 ? ` (${behind(place.position)})` : ''}`;
      told.delay = 0;
      told.opts.delay = 0;
    } else if (place.retryAt !== null) {
      where = `${headMark}backing off until ${isoUtc(place.retryAt)}${lastError ? `: ${lastError}` : ''}`;
      // The board says "Will run at" accepted time + delay: the retry's time, not the park's.
      told.delay = Math.max(0, place.retryAt - json.timestamp);
      told.opts.delay = told.delay;
    } else if (place.position !== null && place.position > 0) {
      where = behind(place.position);
      // Waiting its turn, not delayed: nothing "will run at" a time.
      told.delay = 0;
      told.opts.delay = 0;
    } else if (isHead) {
      where = 'lane head, next: waiting for a worker';
      told.delay = 0;
      told.opts.delay = 0;
    } else {
      where = place.parked ? 'waiting outside its lane (the sweep repairs it)' : 'not in its lane';
    }
    told.name = `${who} · ${where}`;
    // Failed without ever running (cancelled or removed while it waited, never in its lane,
    // out of time before its turn): no "process started" on its card. The same test as the
    // API's view of an operation (attempts 0, no start).
    const failedEarly = failedBeforeItRan(outcomeCode(place.outcome) ?? codeOf(json.failedReason), json.failedReason);
    if (json.finishedOn && (json.attemptsMade === 0 || (failedEarly && json.attemptsMade <= 1))) told.processedOn = undefined;
    if (json.failedReason) {
      // Code and message only: stack traces carry the server's paths.
      told.failedReason = lastError ?? '';
      told.stacktrace = [];
    }
    // A completed job keeps the reason of its last retry in BullMQ: not a failure, not shown.
    if (json.finishedOn && outcomeStatus(place.outcome) === 'completed') told.failedReason = '';
    return told;
  }
}
