/**
 * Showing values that may hold secrets: configuration errors, start-up lines and request
 * logs name what they are about without printing a password, a token or a key.
 */

const MASK = '***';

/** Variables whose whole value is a secret (tokens, keys, passwords). */
const SECRET_NAME = /(TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL)/i;
/** Query parameters that carry credentials (`?access_token=`, `?api_key=`...). */
const SECRET_PARAM = /(token|key|secret|pass|pwd|auth|credential|signature|bearer|jwt|session|code|sig$)/i;

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

/**
 * A request target with the values of credential-like query parameters masked (parameters
 * split on `&` or `;`, names read percent-decoded), or with `shown`, of every parameter not
 * in it; and the credentials of an absolute-form target (`GET http://user:pass@host/...`).
 */
export function redactQuery(target: string, shown?: ReadonlySet<string>): string {
  // Absolute (scheme://) and protocol-relative (//host) targets may carry user info.
  const path = /^[a-z][a-z0-9+.-]*:\/\//i.test(target) ? maskUrl(target) : target.replace(/^\/\/[^/@]*@/, `//${MASK}@`);
  const q = path.indexOf('?');
  const [pathPart, queryPart] = q < 0 ? [path, ''] : [path.slice(0, q), path.slice(q)];
  // With `shown`, only those parameters keep their values (a token sent as ?t= is as secret as ?token=).
  const mask = (all: string, separator: string, name: string) =>
    (shown ? !shown.has(decodedName(name)) : SECRET_PARAM.test(decodedName(name))) ? `${separator}${name}=${MASK}` : all;
  // Parameters in the path (`;name=value`, up to the next `/`), and in the query (up to the
  // next `&`, `;` or a second `?`).
  const query = shown ? queryPart.replace(/([?&;])([^&;?]*)/g, (_all, separator: string, piece: string) => `${separator}${shownPiece(piece, shown)}`) : queryPart.replace(/([?&;])([^=&;?]*)=([^&;?]*)/g, mask);
  // A path's `;` parameters follow the query's rule: with `shown`, a long value under a name the
  // API reads is masked too (helper-40: `/v1/attention;limit=<token>` was logged whole).
  const pathShown = shown ? pathPart.replace(/;([^;/]*)/g, (_all, piece: string) => `;${shownPiece(piece, shown)}`) : pathPart.replace(/(;)([^=;/]*)=([^;/]*)/g, mask);
  return pathShown + query;
}

/**
 * One query parameter as the log shows it, when only `shown` parameters may keep their values:
 * those with a short value (a token is 16 characters or more) or a number; any other a plain
 * name keeps its name; anything else (a bare `?<token>`, a name holding an encoded `=`) is masked whole.
 */
function shownPiece(piece: string, shown: ReadonlySet<string>): string {
  if (piece === '') return piece;
  const eq = piece.indexOf('=');
  const name = eq < 0 ? '' : decodedName(piece.slice(0, eq));
  const value = eq < 0 ? '' : piece.slice(eq + 1);
  if (!/^[A-Za-z][A-Za-z0-9_.-]{0,31}$/.test(name)) return MASK;
  if (shown.has(name) && (value.length < 16 || /^\d+$/.test(value))) return piece;
  return `${piece.slice(0, eq)}=${MASK}`;
}

function decodedName(name: string): string {
  try {
    return decodeURIComponent(name.replaceAll('+', ' '));
  } catch {
    return name;
  }
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
 * A message for callers with the infrastructure taken out: URLs, IP addresses (v4 and v6)
 * and ports, host names a lookup failed for, file paths (POSIX and Windows), and
 * `name=value` pairs whose name says secret become placeholders. Operators read the
 * original in the logs.
 */
export function withoutInfrastructure(message: string): string {
  return message
    .replace(/\b[a-z][a-z0-9+.-]*:\/\/[^\s'"]+/gi, '<url>')
    .replace(/\b(token|secret|password|passwd|api[_-]?key|key|authorization|credentials?)=[^\s&'"]+/gi, '$1=<hidden>')
    .replace(/\[[0-9a-f:.]+\](?::\d+)?/gi, '<address>')
    .replace(/\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b/g, '<address>')
    // IPv6 as Node prints it (::1, fd00::1234, 2001:db8::1:443): groups of hex with at least two colons.
    .replace(/(?<![\w:])(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}(?::\d+)?(?![\w:])/gi, (m) => (/[0-9a-f]/i.test(m) && m.includes('::') || m.split(':').length >= 8 ? '<address>' : m))
    // The host name of a failed lookup (getaddrinfo ENOTFOUND db.internal, EAI_AGAIN ...).
    .replace(/\b(getaddrinfo|ENOTFOUND|EAI_AGAIN|EAI_FAIL)( [A-Z_]+)? ([\w.-]+\.[\w.-]+)/g, '$1$2 <host>')
    // Absolute paths: POSIX (two segments or more) and Windows drive paths.
    .replace(/[A-Za-z]:\\(?:[^\\\s'"]+\\)*[^\\\s'"]*/g, '<path>')
    .replace(/(?<![\w.<>-])\/(?:[\w.@-]+\/)+[\w.@-]+(?::\d+){0,2}/g, '<path>');
}
