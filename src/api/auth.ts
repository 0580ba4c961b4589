import { createHash, timingSafeEqual } from 'node:crypto';
import type { ApiToken } from '../config.ts';
import type { LeaseIdentity } from '../lease.ts';
import type { AttentionScope } from '../queues/inspect.ts';

/** Who a request speaks for: an admin, or a token scoped to one company (and maybe some environments). */
export interface Principal {
  name: string;
  admin: boolean;
  companyId?: string;
  environmentIds?: readonly string[];
}

const digest = (text: string) => createHash('sha256').update(text).digest();

/**
 * Checks presented tokens against the configured ones in constant time: every candidate is
 * compared (no early exit), as equal-length digests, so timing tells nothing about a token.
 * Only digests are kept, so a heap dump or a stray log of this object shows no token.
 */
export class TokenAuthority {
  private readonly entries: { digest: Buffer; principal: Principal }[];

  constructor(tokens: readonly ApiToken[]) {
    this.entries = tokens.map((t, i) => ({
      digest: digest(t.token),
      principal: {
        name: t.name ?? (t.companyId ? `company:${t.companyId}` : `admin-${i + 1}`),
        admin: t.companyId === undefined,
        ...(t.companyId === undefined ? {} : { companyId: t.companyId }),
        ...(t.environmentIds === undefined ? {} : { environmentIds: t.environmentIds }),
      },
    }));
  }

  get size(): number {
    return this.entries.length;
  }

  /**
   * The principal of an Authorization header: Bearer, or (`basic: true`, for the pages and the
   * board a browser opens) Basic with the token as password. A browser attaches Basic
   * credentials to any request to their origin, a cross-site form's too; never Bearer.
   */
  authenticate(header: string | undefined, opts: { basic: boolean } = { basic: true }): Principal | null {
    const presented = tokenOf(header, opts.basic);
    if (presented === null) return null;
    const candidate = digest(presented);
    let found: Principal | null = null;
    for (const entry of this.entries) {
      if (timingSafeEqual(entry.digest, candidate)) found = entry.principal;
    }
    return found;
  }
}

/** One token (printable ASCII without spaces, as LEASE_OPS_API_TOKENS allows) and nothing after it. */
const BEARER = /^Bearer ([\x21-\x7e]+)$/i;
/** RFC 7617: base64 of `user:password`, and nothing after it. */
const BASIC = /^Basic ([A-Za-z0-9+/]+={0,2})$/i;

function tokenOf(header: string | undefined, acceptBasic: boolean): string | null {
  if (!header) return null;
  const bearer = BEARER.exec(header);
  if (bearer) return bearer[1]!;
  if (!acceptBasic) return null;
  const basic = BASIC.exec(header);
  if (!basic) return null;
  // Browsers (Bull Board) send Basic; the user name is ignored, the password is the token.
  // Base64 that does not decode back to itself was not base64 (Buffer skips what it cannot read).
  const decoded = Buffer.from(basic[1]!, 'base64');
  if (decoded.toString('base64') !== basic[1]) return null;
  const text = decoded.toString('utf8');
  const colon = text.indexOf(':');
  return colon >= 0 ? text.slice(colon + 1) : null;
}

/**
 * Whether a request may read /metrics: always when no token is set (the documented
 * default), else only with `Authorization: Bearer <LEASE_OPS_METRICS_TOKEN>`.
 */
export function metricsAllowed(header: string | undefined, token: string | undefined): boolean {
  if (!token) return true;
  const presented = header ? BEARER.exec(header)?.[1] : undefined;
  return presented !== undefined && timingSafeEqual(digest(presented), digest(token));
}

/** Whether a principal may see or act on a lease. Out of scope reads as "does not exist". */
export function canSee(principal: Principal, lease: Pick<LeaseIdentity, 'companyId' | 'environmentId'> | null): boolean {
  if (principal.admin) return true;
  if (!lease || lease.companyId !== principal.companyId) return false;
  return !principal.environmentIds || principal.environmentIds.includes(lease.environmentId);
}

/** A scoped token's company and environments, whose attention is read from their own index entries; none for an admin. */
export const scopeOf = (principal: Principal): AttentionScope | undefined =>
  principal.admin || principal.companyId === undefined ? undefined : { companyId: principal.companyId, environmentIds: principal.environmentIds };
