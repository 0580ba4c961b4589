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
export function luaCommand(client: RedisClient, name: string, numberOfKeys: number | 'varies'): LuaCommand {
  const command = luaCommandName(name);
  if (!(command in client)) client.defineCommand(command, numberOfKeys === 'varies' ? { lua: loadLuaScript(name) } : { numberOfKeys, lua: loadLuaScript(name) });
  const run = (client as unknown as Record<string, LuaCommand>)[command]!;
  return (...keysThenArgs) => run.apply(client, keysThenArgs);
}
