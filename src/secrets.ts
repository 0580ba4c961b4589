/**
 * Showing values that may hold secrets: configuration errors, start-up lines and request
 * logs name what they are about without printing a password, a token or a key.
 */

const MASK = '***';

/** Variables whose whole value is a secret (tokens, keys, passwords). */
const SECRET_NAME = /(TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL)/i;
/** Query parameters that carry credentials (`?access_token=`, `?api_key=`...). */
const SECRET_PARAM = /(token|key|secret|password|auth|credential|signature)/i;

/** A URL with its password (and a user name that stands alone, as `redis://token@host`) masked. */
export function maskUrl(url: string): string {
  if (!URL.canParse(url)) {
    // Not a URL: show it only when nothing in it looks like user info.
    return url.includes('@') ? MASK : url;
  }
  const parsed = new URL(url);
  if (parsed.password) parsed.password = MASK;
  else if (parsed.username) parsed.username = MASK;
  for (const [name] of parsed.searchParams) if (SECRET_PARAM.test(name)) parsed.searchParams.set(name, MASK);
  // URL.toString percent-encodes the mask; keep it readable.
  return parsed.toString().replaceAll(encodeURIComponent(MASK), MASK);
}

/** A request path with the values of credential-like query parameters masked. */
export function redactQuery(path: string): string {
  const q = path.indexOf('?');
  if (q < 0) return path;
  const params = new URLSearchParams(path.slice(q + 1));
  let changed = false;
  for (const [name] of params) {
    if (!SECRET_PARAM.test(name)) continue;
    params.set(name, MASK);
    changed = true;
  }
  return changed ? `${path.slice(0, q)}?${params.toString().replaceAll(encodeURIComponent(MASK), MASK)}` : path;
}

/** A token shown with its first characters only, enough to tell which one it is. */
export function maskToken(token: string): string {
  return `${token.slice(0, 4)}${MASK}`;
}

/**
 * How a configuration error shows a variable's value: secrets never, URLs with their
 * credentials masked, other values as given (quoted, and cut at 80 characters).
 */
export function describeSetting(name: string, value: string | undefined): string {
  if (value === undefined) return `${name} (not set)`;
  if (SECRET_NAME.test(name)) return `${name} (value hidden: it may hold a secret)`;
  const shown = /_URL$/.test(name) ? maskUrl(value) : value;
  return `${name}=${JSON.stringify(shown.length > 80 ? `${shown.slice(0, 80)}...` : shown)}`;
}

/**
 * A message for callers with the infrastructure taken out: URLs, IP addresses and ports,
 * and server file paths become placeholders. Operators read the original in the logs.
 */
export function withoutInfrastructure(message: string): string {
  return message
    .replace(/\b[a-z][a-z0-9+.-]*:\/\/[^\s'"]+/gi, '<url>')
    .replace(/\[[0-9a-f:.]+\](?::\d+)?/gi, '<address>')
    .replace(/\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b/g, '<address>')
    .replace(/(?:[A-Za-z]:)?(?:[\\/][\w.@-]+){2,}\.(?:[cm]?[jt]s|lua)(?::\d+){0,2}/g, '<path>');
}
