import { readFileSync } from 'node:fs';

const INCLUDE = /^--- @include "([a-z-]+)"$/gm;

/**
 * Reads a Lua script from ./lua, with `--- @include "name"` lines replaced by
 * ./lua/includes/name.lua, so shared steps are written once and every script stays atomic.
 */
export function loadLuaScript(name: string): string {
  const read = (path: string) => readFileSync(new URL(`./lua/${path}.lua`, import.meta.url), 'utf8');
  return read(name).replace(INCLUDE, (_line, include: string) => read(`includes/${include}`));
}
