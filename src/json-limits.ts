/** How deep JSON a caller or a provider may nest in lease metadata: far more than metadata needs, far less than any parser's limit. */
export const MAX_JSON_DEPTH = 32;

/**
 * Whether `value` nests objects and arrays at most `max` levels deep. Iterative, so a
 * hostile value thousands of levels deep is refused without exhausting the stack (the
 * checks after it, JSON.stringify among them, recurse).
 */
export function jsonDepthWithin(value: unknown, max = MAX_JSON_DEPTH): boolean {
  const stack: [unknown, number][] = [[value, 0]];
  while (stack.length) {
    const [v, depth] = stack.pop()!;
    if (v === null || typeof v !== 'object') continue;
    if (depth >= max) return false;
    for (const child of Array.isArray(v) ? v : Object.values(v as object)) stack.push([child, depth + 1]);
  }
  return true;
}
