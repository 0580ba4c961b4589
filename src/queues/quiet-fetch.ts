import { createRequire } from 'node:module';
import type { RedisClient } from './redis.ts';

/**
 * BullMQ's fetching scripts (moveToActive, and the fetch of the next job inside moveToFinished
 * and moveToDelayed), rewritten in three ways; everything else they do is BullMQ's.
 *
 * Quiet: BullMQ adds the queue's base marker after every job it takes, whether or not another
 * one waits, and each marker wakes an idle worker's blocking fetch, which then finds nothing.
 * On a lane, where only the head is ever waiting, that is a wasted wake-up and fetch per
 * operation. The marker is now added only while jobs are left to fetch (in the wait list or
 * the prioritized set). Every other marker (adds, promotions, stalls, hand-offs) is BullMQ's.
 *
 * Due times kept: a worker blocks until the next delayed job is due, as its fetches' replies
 * tell it, else for its block timeout. Three replies said "no delayed job" when there was
 * one: a fetch that took a job, a retry step (moveToDelayed, a backoff) that took one, and a
 * retry step that took none (it replies 0, which BullMQ's worker reads as an empty fetch). The
 * worker then forgot the due time it knew, often that very retry's, which ran up to the block
 * timeout late. Each now names the next due time; a retry step that took a job also marks the
 * retry's due time, as it does when it takes none, so an idle worker hears of it.
 *
 * Completion after the release: moveToFinished refuses to complete an acquire whose outcome
 * the lane's release has not recorded (`lo:outcome`), replying UNRELEASED_ACQUIRE. The release
 * goes just ahead of the completion on the same connection, so this refuses in the case where
 * the release refused: the acquire was cancelled while it ran (job-cancel.lua marks it only
 * while it has no outcome). It also refuses where the release ran late: ioredis sends a script
 * again (as EVAL) only once Redis answered NOSCRIPT, after the completion sent with it ran
 * (the script cache flushed under a connected worker; helper-43). Either way the worker
 * learns what the release said and ends the acquire by it (see LaneJobsWorker), and an
 * acquire's end costs one round trip instead of two (see AttemptLife.complete).
 */
const MARKER_STEP = 'addBaseMarkerIfNeeded(markerKey, false)';
const quietMarkerStep = (wait: string, prioritized: string) =>
  `if rcall("LLEN", ${wait}) > 0 or rcall("ZCARD", ${prioritized}) > 0 then addBaseMarkerIfNeeded(markerKey, false) end`;
const FETCHED_JOB_RETURN = 'return {rcall("HGETALL", jobKey), jobId, 0, 0} -- get job data';
const fetchedJobReturnWithDue = (delayed: string) => `return {rcall("HGETALL", jobKey), jobId, 0, getNextDelayedTimestamp(${delayed}) or 0} -- get job data`;
const DELAYED_NO_FETCH_RETURN = `    addDelayMarkerIfNeeded(markerKey, delayedKey)
    return 0`;
const DELAYED_NO_FETCH_RETURN_WITH_DUE = `    addDelayMarkerIfNeeded(markerKey, delayedKey)
    return {0, 0, 0, getNextDelayedTimestamp(delayedKey) or 0}`;
/** What the rewritten moveToFinished replies for an acquire whose release has not recorded its outcome. */
export const UNRELEASED_ACQUIRE = -1001;
const COMPLETION_CHECKS = `    if ARGV[5] == "completed" then
        if rcall("SCARD", jobIdKey .. ":dependencies") ~= 0 then`;
const COMPLETION_CHECKS_AFTER_RELEASE = `    if ARGV[5] == "completed" then
        local released = rcall("HMGET", jobIdKey, "name", "lo:outcome")
        if released[1] == "acquire" and not released[2] then
            return ${UNRELEASED_ACQUIRE}
        end
        if rcall("SCARD", jobIdKey .. ":dependencies") ~= 0 then`;
const DELAYED_FETCH_RETURN = `        if result and type(result[1]) == "table" then
            return result`;
const DELAYED_FETCH_RETURN_MARKED = `        if result and type(result[1]) == "table" then
            addDelayMarkerIfNeeded(markerKey, delayedKey)
            return result`;

interface BullmqScript {
  name: string;
  content: string;
  keys: number;
}

/**
 * Each script BullMQ fetches in, and its rewrites: each text must occur exactly once. The keys
 * are named as each script's header lists them (pinned by test/bullmq-contract.test.ts).
 */
export const FETCHING_SCRIPTS = [
  { file: 'moveToActive-11', name: 'moveToActive', rewrites: [[MARKER_STEP, quietMarkerStep('KEYS[1]', 'KEYS[3]')], [FETCHED_JOB_RETURN, fetchedJobReturnWithDue('KEYS[7]')]] },
  {
    file: 'moveToFinished-14',
    name: 'moveToFinished',
    rewrites: [[MARKER_STEP, quietMarkerStep('KEYS[1]', 'KEYS[3]')], [FETCHED_JOB_RETURN, fetchedJobReturnWithDue('KEYS[7]')], [COMPLETION_CHECKS, COMPLETION_CHECKS_AFTER_RELEASE]],
  },
  {
    file: 'moveToDelayed-11',
    name: 'moveToDelayed',
    rewrites: [
      [MARKER_STEP, quietMarkerStep('KEYS[9]', 'KEYS[3]')],
      [FETCHED_JOB_RETURN, fetchedJobReturnWithDue('KEYS[4]')],
      [DELAYED_FETCH_RETURN, DELAYED_FETCH_RETURN_MARKED],
      [DELAYED_NO_FETCH_RETURN, DELAYED_NO_FETCH_RETURN_WITH_DUE],
    ],
  },
] as const;

/** BullMQ's script rewritten, or null when its text is not the one the rewrites were written against. */
export function quietScript(script: BullmqScript, rewrites: readonly (readonly [string, string])[]): BullmqScript | null {
  let content = script.content;
  for (const [text, replacement] of rewrites) {
    const at = content.indexOf(text);
    if (at < 0 || content.indexOf(text, at + 1) >= 0) return null;
    content = content.slice(0, at) + replacement + content.slice(at + text.length);
  }
  return { ...script, content };
}

/** BullMQ's own fetching scripts, as it ships them, in the order of FETCHING_SCRIPTS. */
export function bullmqFetchingScripts(): BullmqScript[] {
  const require = createRequire(import.meta.url);
  return FETCHING_SCRIPTS.map(({ file, name }) => (require(`bullmq/dist/cjs/scripts/${file}.js`) as Record<string, BullmqScript>)[name]!);
}

/**
 * Registers the quiet fetch on a connection before a BullMQ Worker is made on it: BullMQ
 * defines its scripts on a connection only where none of the same name is defined, so this
 * Worker runs these. Returns false (and registers nothing) when the installed BullMQ's
 * scripts are not the ones expected: the Worker then runs BullMQ's own, correct but with the
 * wasted wake-ups and the late retries.
 */
export function defineQuietFetch(connection: RedisClient): boolean {
  const scripts = bullmqFetchingScripts().map((script, i) => quietScript(script, FETCHING_SCRIPTS[i]!.rewrites));
  // BullMQ names its commands `<script>:<its version>` (RedisConnection.loadCommands).
  const { version } = createRequire(import.meta.url)('bullmq/dist/cjs/version.js') as { version: string };
  const commands = scripts.map((s) => s && `${s.name}:${version}`);
  if (commands.some((c) => c === null || c in connection)) return false;
  scripts.forEach((s, i) => connection.defineCommand(commands[i]!, { numberOfKeys: s!.keys, lua: s!.content }));
  return true;
}
