import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { RedisClient } from './redis.ts';

const INCLUDE = /^--- @include "([a-z-]+)"$/gm;

/**
 * Reads a Lua script from ./lua, with `--- @include "name"` lines replaced by
 * ./lua/includes/name.lua, so shared steps are written once and every script stays atomic.
 */
export function loadLuaScript(name: string): string {
  const read = (path: string) => readFileSync(new URL(`./lua/${path}.lua`, import.meta.url), 'utf8');
  return read(name).replace(INCLUDE, (_line, include: string) => read(`includes/${include}`));
}

/**
 * Scripts whose second run would not answer as the first did, or would do its work again (a
 * cancel that then finds nothing to cancel and says refused, a rerun counted twice, an event
 * written twice, a rate-limit turn taken twice). ioredis sends a command again after it
 * reconnects when its reply never came, so Redis may run one call twice. For these, each call
 * carries a mark of its own (one more key, `<prefix>:answer:<mark>` under the prefix of the
 * keys it is given, so in their slot), and a run of a call that ran already answers what its
 * first run answered, kept ANSWER_KEPT_MS (lua/answered-once.lua). The lane push keeps its
 * mark on its job instead; lane-release, lane-yield and lane-acquire are safe run twice (their
 * fencing token refuses the second run; an acquire's end told 'stale' by its release looks
 * whether a first run ended the job: Lanes.releasedCompleted). Never called through a pipeline.
 */
const ANSWERED_ONCE = new Set(['lane-drop', 'lane-upgrade', 'lane-pause', 'lane-unpause', 'rerun-admit', 'history-append', 'pace-take', 'lease-force-claim', 'lease-force-unclaim']);
/**
 * Longer than a link is likely to stay down while its client holds a command (ioredis holds it
 * for as long as it reconnects); a resend after that runs the script again.
 */
const ANSWER_KEPT_MS = 10 * 60_000;

/** A script's text as it is registered (in its answered-once frame, for one answered once). */
export function registeredLuaScript(name: string): string {
  if (!ANSWERED_ONCE.has(name)) return loadLuaScript(name);
  const script = loadLuaScript(name);
  return loadLuaScript('answered-once').replace(/^--- @wrapped$/m, () => script);
}

/** The command a script is registered as (pipelines call it by this name). */
export function luaCommandName(name: string): string {
  return `leaseOps_${name.replaceAll('-', '_')}`;
}

/** Runs a script: its keys first, then its arguments. */
export type LuaCommand = (...keysThenArgs: (string | number)[]) => Promise<unknown>;

/**
 * Registers ./lua/<name>.lua on the client as a command (once per client; ioredis then runs
 * it by EVALSHA) and returns a function that runs it. Command names are prefixed so they
 * never clash with BullMQ's. With `numberOfKeys` 'varies', each call passes its key count first.
 */
export function luaCommand(client: RedisClient, name: string, numberOfKeys: number | 'varies', answersUnder?: string): LuaCommand {
  const command = luaCommandName(name);
  const once = ANSWERED_ONCE.has(name);
  if (once && (numberOfKeys === 'varies' || answersUnder === undefined)) throw new Error(`${name}: a script answered once has a fixed number of keys and the prefix of its keys`);
  if (!(command in client)) {
    const lua = registeredLuaScript(name);
    client.defineCommand(command, numberOfKeys === 'varies' ? { lua } : { numberOfKeys: once ? numberOfKeys + 1 : numberOfKeys, lua });
  }
  const run = (client as unknown as Record<string, LuaCommand>)[command]!;
  if (!once) return (...keysThenArgs) => run.apply(client, keysThenArgs);
  const keys = numberOfKeys as number;
  // The call's answer key goes last among its keys, and how long it is kept last among its
  // arguments (the frame takes both off before the script runs).
  return (...keysThenArgs) => run.apply(client, [...keysThenArgs.slice(0, keys), `${answersUnder}:answer:${randomBytes(12).toString('base64url')}`, ...keysThenArgs.slice(keys), ANSWER_KEPT_MS]);
}
