import { createRequire } from 'node:module';
import type { RedisClient } from './redis.ts';

/**
 * BullMQ's fetch (moveToActive, and the fetch of the next job inside moveToFinished) adds the
 * queue's base marker after every job it takes, whether or not another one waits. Each marker
 * wakes an idle worker's blocking fetch, which then finds nothing: on a lane, where only the
 * head is ever waiting, that is one wasted wake-up and fetch per operation. The quiet fetch is
 * BullMQ's own script with that one step made conditional: the marker is added only while
 * jobs are left to fetch (in the wait list or the prioritized set). Every other marker
 * (adds, promotions, retries, stalls, lane hand-offs) is BullMQ's as before.
 */
const MARKER_STEP = 'addBaseMarkerIfNeeded(markerKey, false)';
/** KEYS[1] and KEYS[3] are the wait list and the prioritized set in both scripts (pinned by test/bullmq-contract.test.ts). */
const QUIET_MARKER_STEP =
  'if rcall("LLEN", KEYS[1]) > 0 or rcall("ZCARD", KEYS[3]) > 0 then addBaseMarkerIfNeeded(markerKey, false) end';

interface BullmqScript {
  name: string;
  content: string;
  keys: number;
}

const FETCHING_SCRIPTS = [
  ['moveToActive-11', 'moveToActive'],
  ['moveToFinished-14', 'moveToFinished'],
] as const;

/** BullMQ's script with the quiet marker step, or null when its text is not the one this was written against. */
export function quietScript(script: BullmqScript): BullmqScript | null {
  const at = script.content.indexOf(MARKER_STEP);
  if (at < 0 || script.content.indexOf(MARKER_STEP, at + 1) >= 0) return null;
  return { ...script, content: script.content.replace(MARKER_STEP, QUIET_MARKER_STEP) };
}

/** BullMQ's own fetching scripts, as it ships them. */
export function bullmqFetchingScripts(): BullmqScript[] {
  const require = createRequire(import.meta.url);
  return FETCHING_SCRIPTS.map(([file, name]) => (require(`bullmq/dist/cjs/scripts/${file}.js`) as Record<string, BullmqScript>)[name]!);
}

/**
 * Registers the quiet fetch on a connection before a BullMQ Worker is made on it: BullMQ
 * defines its scripts on a connection only where none of the same name is defined, so this
 * Worker runs these. Returns false (and registers nothing) when the installed BullMQ's
 * scripts are not the ones expected: the Worker then runs BullMQ's own, correct but with the
 * wasted wake-ups.
 */
export function defineQuietFetch(connection: RedisClient): boolean {
  const scripts = bullmqFetchingScripts().map(quietScript);
  // BullMQ names its commands `<script>:<its version>` (RedisConnection.loadCommands).
  const { version } = createRequire(import.meta.url)('bullmq/dist/cjs/version.js') as { version: string };
  const commands = scripts.map((s) => s && `${s.name}:${version}`);
  if (commands.some((c) => c === null || c in connection)) return false;
  scripts.forEach((s, i) => connection.defineCommand(commands[i]!, { numberOfKeys: s!.keys, lua: s!.content }));
  return true;
}
