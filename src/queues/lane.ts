import { readFileSync } from 'node:fs';
import type { Cluster, Redis } from 'ioredis';

type RedisClient = Redis | Cluster;

const SCRIPTS = ['lane-push', 'lane-acquire', 'lane-release', 'lane-yield', 'lane-drop', 'lane-touch'] as const;
const KEY_COUNTS: Record<(typeof SCRIPTS)[number], number> = {
  'lane-push': 3,
  'lane-acquire': 5,
  'lane-release': 4,
  'lane-yield': 1,
  'lane-drop': 3,
  'lane-touch': 2,
};

/** Command names registered on the client; prefixed so they never clash with BullMQ's. */
const commandName = (script: string) => `leaseOps_${script.replaceAll('-', '_')}`;

type Evaluator = (...args: (string | number)[]) => Promise<unknown>;

/** The outcome a lane records for its finished head, replayed if the job ever re-runs. */
export type LaneOutcome = { status: 'completed'; result: unknown } | { status: 'failed'; error: string; code: string };

export type AcquireResult =
  | { kind: 'run'; token: string }
  | { kind: 'park' }
  | { kind: 'done'; outcome: LaneOutcome }
  | { kind: 'orphan' };

export type AdvanceResult = { kind: 'stale' } | { kind: 'moved' } | { kind: 'next'; jobId: string } | { kind: 'idle' };

/**
 * The per-lease lanes: which job of a lease may run, in what order, and who holds it.
 * All bookkeeping is done by the Lua scripts beside this file, each one atomic.
 *
 * Keys (all under the one hash-tagged prefix, so a Redis Cluster keeps them in one slot
 * with the BullMQ queue they refer to):
 *   <prefix>:lane:<laneId>     list of job ids, head first; gone when the lane is idle
 *   <prefix>:lane:<laneId>:x   hash {job, token} of the executing head; gone when none
 *   <prefix>:lanes             zset laneId -> last progress (ms), read by the sweep
 *   <prefix>:fence             counter behind every fencing token
 */
export class Lanes {
  readonly lanesKey: string;
  readonly fenceKey: string;

  constructor(
    private readonly client: RedisClient,
    readonly prefix: string,
    /** Maps a job id to its BullMQ job hash key. */
    private readonly jobKey: (jobId: string) => string,
  ) {
    this.lanesKey = `${prefix}:lanes`;
    this.fenceKey = `${prefix}:fence`;
    for (const script of SCRIPTS) {
      const name = commandName(script);
      if (!(name in client)) {
        client.defineCommand(name, {
          numberOfKeys: KEY_COUNTS[script],
          lua: readFileSync(new URL(`./lua/${script}.lua`, import.meta.url), 'utf8'),
        });
      }
    }
  }

  listKey(laneId: string): string {
    return `${this.prefix}:lane:${laneId}`;
  }

  execKey(laneId: string): string {
    return `${this.prefix}:lane:${laneId}:x`;
  }

  private run(script: (typeof SCRIPTS)[number], ...args: (string | number)[]): Promise<unknown> {
    const fn = (this.client as unknown as Record<string, Evaluator>)[commandName(script)];
    if (!fn) throw new Error(`lane script ${script} is not loaded`);
    return fn.apply(this.client, args);
  }

  /** Returns true when the job became the head with nothing executing: hand it to the workers. */
  async push(laneId: string, jobId: string, position: 'tail' | 'front' = 'tail'): Promise<boolean> {
    const r = await this.run(
      'lane-push',
      this.listKey(laneId),
      this.execKey(laneId),
      this.lanesKey,
      jobId,
      laneId,
      Date.now(),
      position,
    );
    return r === 1;
  }

  async acquire(laneId: string, jobId: string): Promise<AcquireResult> {
    const r = (await this.run(
      'lane-acquire',
      this.listKey(laneId),
      this.execKey(laneId),
      this.fenceKey,
      this.lanesKey,
      this.jobKey(jobId),
      jobId,
      laneId,
      Date.now(),
    )) as [string, string?];
    switch (r[0]) {
      case 'run':
        return { kind: 'run', token: String(r[1]) };
      case 'park':
        return { kind: 'park' };
      case 'done':
        return { kind: 'done', outcome: JSON.parse(String(r[1])) as LaneOutcome };
      default:
        return { kind: 'orphan' };
    }
  }

  async release(laneId: string, jobId: string, token: string, outcome: LaneOutcome): Promise<AdvanceResult> {
    const r = (await this.run(
      'lane-release',
      this.listKey(laneId),
      this.execKey(laneId),
      this.lanesKey,
      this.jobKey(jobId),
      jobId,
      token,
      JSON.stringify(outcome),
      laneId,
      Date.now(),
    )) as [string, string?];
    return toAdvance(r);
  }

  /** Before a retry's backoff: keep the head, stop being the executing one. False if stale. */
  async yield(laneId: string, jobId: string, token: string): Promise<boolean> {
    return (await this.run('lane-yield', this.execKey(laneId), jobId, token)) === 1;
  }

  async drop(laneId: string, jobId: string): Promise<AdvanceResult> {
    const r = (await this.run(
      'lane-drop',
      this.listKey(laneId),
      this.execKey(laneId),
      this.lanesKey,
      jobId,
      laneId,
      Date.now(),
    )) as [string, string?];
    return toAdvance(r);
  }

  /** Returns false when the lane no longer exists (and was forgotten by the index). */
  async touch(laneId: string): Promise<boolean> {
    return (await this.run('lane-touch', this.listKey(laneId), this.lanesKey, laneId, Date.now())) === 1;
  }

  /** Lanes that showed no progress since `olderThan` (epoch ms), oldest first. */
  async quietLanes(olderThan: number, limit = 500): Promise<string[]> {
    return this.client.zrangebyscore(this.lanesKey, '-inf', olderThan, 'LIMIT', 0, limit);
  }

  async view(laneId: string): Promise<{ jobs: string[]; executing: { job: string; token: string } | null }> {
    const [jobs, exec] = await Promise.all([
      this.client.lrange(this.listKey(laneId), 0, -1),
      this.client.hgetall(this.execKey(laneId)),
    ]);
    return { jobs, executing: exec.job && exec.token ? { job: exec.job, token: exec.token } : null };
  }

  async head(laneId: string): Promise<{ job: string | null; executing: string | null }> {
    const [job, executing] = await Promise.all([
      this.client.lindex(this.listKey(laneId), 0),
      this.client.hget(this.execKey(laneId), 'job'),
    ]);
    return { job, executing };
  }

  async activeLaneCount(): Promise<number> {
    return this.client.zcard(this.lanesKey);
  }
}

function toAdvance(r: [string, string?]): AdvanceResult {
  switch (r[0]) {
    case 'stale':
      return { kind: 'stale' };
    case 'moved':
      return { kind: 'moved' };
    case 'next':
      return { kind: 'next', jobId: String(r[1]) };
    default:
      return { kind: 'idle' };
  }
}
