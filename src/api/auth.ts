import { createHash, timingSafeEqual } from 'node:crypto';
import type { ApiToken } from '../config.ts';
import type { LeaseIdentity } from '../lease.ts';

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

  /** The principal of an Authorization header (Bearer, or Basic with the token as password). */
  authenticate(header: string | undefined): Principal | null {
    const presented = tokenOf(header);
    if (presented === null) return null;
    const candidate = digest(presented);
    let found: Principal | null = null;
    for (const entry of this.entries) {
      if (timingSafeEqual(entry.digest, candidate)) found = entry.principal;
    }
    return found;
  }
}

function tokenOf(header: string | undefined): string | null {
  if (!header) return null;
  const [scheme, value] = header.split(' ', 2);
  if (!value) return null;
  if (scheme?.toLowerCase() === 'bearer') return value.trim();
  if (scheme?.toLowerCase() === 'basic') {
    // Browsers (Bull Board) send Basic; the user name is ignored, the password is the token.
    const decoded = Buffer.from(value, 'base64').toString('utf8');
    const colon = decoded.indexOf(':');
    return colon >= 0 ? decoded.slice(colon + 1) : null;
  }
  return null;
}

/** Whether a principal may see or act on a lease. Out of scope reads as "does not exist". */
export function canSee(principal: Principal, lease: Pick<LeaseIdentity, 'companyId' | 'environmentId'> | null): boolean {
  if (principal.admin) return true;
  if (!lease || lease.companyId !== principal.companyId) return false;
  return !principal.environmentIds || principal.environmentIds.includes(lease.environmentId);
}
