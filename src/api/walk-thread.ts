import { AsyncLocalStorage } from 'node:async_hooks';
import { setPriority } from 'node:os';
import { parentPort, workerData } from 'node:worker_threads';
import { Redis } from 'ioredis';
import { LeaseOpsClient } from '../client.ts';
import type { Config } from '../config.ts';
import { RedisUnavailableError } from '../errors.ts';
import { faultPoint } from '../fault-points.ts';
import { LayoutError } from '../queues/layout.ts';
import type { WalkAsk, WalkReply } from './walks.ts';
import { walksInProcess } from './walks.ts';

/**
 * The Redis commands each walk sends, counted in the walk's own async context: what it cost
 * its company (WalkThreads charges it to the company's walk rate). Counted per walk, not by
 * the thread's busy time, so a short walk beside a long one of another company in the same
 * thread pays for its own commands only (helper-23: sharing the busy time out charged B's 5 ms
 * walk 51-91 ms of A's). Every command of this thread goes through Redis#sendCommand (a
 * pipeline's too, at exec), which is patched in this thread only.
 */
const walkCommands = new AsyncLocalStorage<{ commands: number }>();
const sendCommand = Redis.prototype.sendCommand;
Redis.prototype.sendCommand = function countedSendCommand(this: Redis, ...args: Parameters<typeof sendCommand>) {
  const tally = walkCommands.getStore();
  if (!tally) return sendCommand.apply(this, args);
  tally.commands++;
  const sent = sendCommand.apply(this, args);
  void faultPoint('walk-command-sent');
  return sent;
};

const { config, nice } = workerData as { config: Config; nice: number };
// A background thread (WalkThreads): a lower CPU priority for this thread alone, which Linux
// sets per thread (elsewhere setpriority would take the whole API down with it, so not there).
if (nice && process.platform === 'linux') setPriority(0, nice);

/**
 * How long a background thread's Redis command may go unanswered before its walk fails (503).
 * At nice 10 beside busy threads a reply can wait seconds to be read, while Redis answered at
 * once: with the API's own 2 s a heavy walk failed on a loaded machine. A Redis that is down
 * still fails a walk at once (no offline queue), and a hung one within this; the walks in line
 * behind it fail at once (WalkThreads). 20 s held a heavy company's requests 40 s (helper-59).
 */
const BACKGROUND_REDIS_TIMEOUT_MS = 5_000;

/** A walk thread of the API (see WalkThreads): its own client and Redis connections, no provider keys. */
const client = new LeaseOpsClient(
  nice ? { ...config, LEASE_OPS_REDIS_TIMEOUT_MS: Math.max(config.LEASE_OPS_REDIS_TIMEOUT_MS, BACKGROUND_REDIS_TIMEOUT_MS) } : config,
  { failFast: true, masterKeys: null },
);
const walks = walksInProcess(client);

parentPort!.on('message', (request: WalkAsk & { id: number }) => {
  const tally = { commands: 0 };
  const run: Promise<unknown> = walkCommands.run(tally, () =>
    request.kind === 'attentionPage' ? walks.attentionPage(request.offset, request.limit, request.principal) : request.kind === 'timeline' ? client.getLeaseTimeline(request.lease) : walks.overview({ name: 'walk-thread', admin: true }),
  );
  run.then(
    (value) => parentPort!.postMessage({ id: request.id, value, commands: tally.commands } satisfies WalkReply),
    (err: unknown) => {
      const e = err instanceof Error ? err : new Error(String(err));
      const redis = err instanceof RedisUnavailableError ? { url: err.url, timeoutMs: err.timeoutMs, credentialsRefused: err.credentialsRefused } : {};
      const layout = err instanceof LayoutError ? { code: err.code, layout: true } : {};
      parentPort!.postMessage({ id: request.id, commands: tally.commands, error: { name: e.name, message: e.message, ...redis, ...layout } } satisfies WalkReply);
    },
  );
});
