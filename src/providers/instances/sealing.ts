import { createCipheriv, createDecipheriv, createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { ConfigError } from '../../config.ts';

/**
 * Envelope encryption of provider credentials: each instance's credentials are sealed with a
 * data key of their own (AES-256-GCM), and that data key is wrapped by the master key
 * (AES-256-GCM again). Redis holds only ciphertexts, wrapped keys and the master key's id;
 * the master key lives in the processes' environment (or a file) and nowhere else.
 */

const ALGORITHM = 'aes-256-gcm';
const IV_BYTES = 12;
const TAG_BYTES = 16;

/** A master key's id: the first 8 bytes of SHA-256 of "lease-ops/kid" and the key. It names the key and reveals nothing of it. */
export function keyId(key: Buffer): string {
  return createHash('sha256').update('lease-ops/kid\0').update(key).digest('hex').slice(0, 16);
}

/** A master key: 32 bytes, written as 64 hex digits or as base64 (44 characters). */
function parseKey(text: string, variable: string): Buffer {
  const trimmed = text.trim();
  if (/^[0-9a-f]{64}$/i.test(trimmed)) return Buffer.from(trimmed, 'hex');
  if (/^[A-Za-z0-9+/]{43}=$/.test(trimmed)) {
    const bytes = Buffer.from(trimmed, 'base64');
    if (bytes.length === 32) return bytes;
  }
  throw new ConfigError(`${variable} must be 32 bytes as 64 hex digits or base64 (make one with: openssl rand -hex 32); its value is not shown`);
}

/** The master keys a process holds: the current one wraps, the previous one (during a rotation) still opens. */
export class MasterKeys {
  readonly #keys: Map<string, Buffer>;

  constructor(
    current: Buffer,
    previous?: Buffer,
  ) {
    this.currentKid = keyId(current);
    this.#keys = new Map([[this.currentKid, current]]);
    if (previous) {
      this.previousKid = keyId(previous);
      this.#keys.set(this.previousKid, previous);
    }
  }

  readonly currentKid: string;
  readonly previousKid: string | undefined;

  /** The key that id names, if this process holds it. */
  keyOf(kid: string): Buffer | undefined {
    return this.#keys.get(kid);
  }

  get current(): Buffer {
    return this.#keys.get(this.currentKid)!;
  }

  holds(kid: string): boolean {
    return this.#keys.has(kid);
  }

  /** Only the ids, whatever prints or serialises this. */
  toJSON(): { currentKid: string; previousKid?: string } {
    return { currentKid: this.currentKid, ...(this.previousKid ? { previousKid: this.previousKid } : {}) };
  }
}

/** One key from its variable or its file variable (not both); undefined when neither is set. */
function readKey(env: NodeJS.ProcessEnv, variable: string): Buffer | undefined {
  const direct = env[variable];
  const file = env[`${variable}_FILE`];
  if (direct && file) throw new ConfigError(`set ${variable} or ${variable}_FILE, not both`);
  if (direct) return parseKey(direct, variable);
  if (!file) return undefined;
  let text: string;
  try {
    text = readFileSync(file, 'utf8');
  } catch (err) {
    throw new ConfigError(`${variable}_FILE: cannot read it (${(err as NodeJS.ErrnoException).code ?? 'error'})`);
  }
  return parseKey(text, `${variable}_FILE`);
}

/**
 * The master keys from LEASE_OPS_SECRETS_KEY (or _FILE) and, during a rotation,
 * LEASE_OPS_SECRETS_KEY_PREVIOUS (or _PREVIOUS_FILE); null when no key is set (then this
 * process cannot open or save provider instances).
 */
export function loadMasterKeys(env: NodeJS.ProcessEnv = process.env): MasterKeys | null {
  const current = readKey(env, 'LEASE_OPS_SECRETS_KEY');
  const previous = readKey(env, 'LEASE_OPS_SECRETS_KEY_PREVIOUS');
  if (!current) {
    if (previous) throw new ConfigError('LEASE_OPS_SECRETS_KEY_PREVIOUS is set without LEASE_OPS_SECRETS_KEY: set the new key too');
    return null;
  }
  if (previous && previous.equals(current)) throw new ConfigError('LEASE_OPS_SECRETS_KEY_PREVIOUS is the same key as LEASE_OPS_SECRETS_KEY');
  return new MasterKeys(current, previous);
}

/** Sealed credentials as Redis holds them (base64 fields). */
export const SealedSchema = z.strictObject({
  v: z.literal(1),
  /** The master key that wraps the data key. */
  kid: z.string().regex(/^[0-9a-f]{16}$/),
  /** The data key, wrapped: iv, ciphertext and tag. */
  wrapped: z.string().min(1),
  /** The credentials under the data key: iv, ciphertext and tag. */
  sealed: z.string().min(1),
});
export type Sealed = z.infer<typeof SealedSchema>;

/** Why sealed credentials did not open. */
export class UnsealError extends Error {
  override name = 'UnsealError';
  constructor(
    readonly reason: 'key_not_held' | 'tampered',
    message: string,
  ) {
    super(message);
  }
}

function encrypt(key: Buffer, plaintext: Buffer, aad: string): string {
  const iv = randomBytes(IV_BYTES);
  const cipher = createCipheriv(ALGORITHM, key, iv, { authTagLength: TAG_BYTES });
  cipher.setAAD(Buffer.from(aad, 'utf8'));
  const body = Buffer.concat([cipher.update(plaintext), cipher.final()]);
  return Buffer.concat([iv, body, cipher.getAuthTag()]).toString('base64');
}

function decrypt(key: Buffer, text: string, aad: string): Buffer | null {
  const bytes = Buffer.from(text, 'base64');
  if (bytes.length < IV_BYTES + TAG_BYTES) return null;
  try {
    const decipher = createDecipheriv(ALGORITHM, key, bytes.subarray(0, IV_BYTES), { authTagLength: TAG_BYTES });
    decipher.setAAD(Buffer.from(aad, 'utf8'));
    decipher.setAuthTag(bytes.subarray(bytes.length - TAG_BYTES));
    return Buffer.concat([decipher.update(bytes.subarray(IV_BYTES, bytes.length - TAG_BYTES)), decipher.final()]);
  } catch {
    return null;
  }
}

/**
 * What a ciphertext is bound to (GCM's additional data): the instance it belongs to, so a
 * ciphertext copied into another instance's record (another company's, say) does not open,
 * and the fingerprint saved beside it, so an earlier ciphertext of the same instance written
 * back into its record (a rollback by someone who can write to Redis) opens only with its
 * own fingerprint beside it, which every read then shows.
 */
export const instanceAad = (companyId: string, name: string, fingerprint: string) => `lease-ops/provider-instance/v1\0${companyId}\0${name}\0${fingerprint}`;

/** Seals credentials for one instance under a new data key, wrapped by the current master key. */
export function seal(keys: MasterKeys, aad: string, credentials: Record<string, string>): Sealed {
  const dataKey = randomBytes(32);
  try {
    return {
      v: 1,
      kid: keys.currentKid,
      wrapped: encrypt(keys.current, dataKey, `${aad}\0wrap\0${keys.currentKid}`),
      sealed: encrypt(dataKey, Buffer.from(JSON.stringify(credentials), 'utf8'), `${aad}\0credentials`),
    };
  } finally {
    dataKey.fill(0);
  }
}

function unwrap(keys: MasterKeys, aad: string, sealed: Sealed): Buffer {
  const master = keys.keyOf(sealed.kid);
  if (!master) throw new UnsealError('key_not_held', `its data key is wrapped by master key ${sealed.kid}, which this process does not hold (it holds ${[keys.currentKid, keys.previousKid].filter(Boolean).join(' and ')})`);
  const dataKey = decrypt(master, sealed.wrapped, `${aad}\0wrap\0${sealed.kid}`);
  if (!dataKey || dataKey.length !== 32) throw new UnsealError('tampered', 'its wrapped data key does not open: it was altered, or copied from another instance');
  return dataKey;
}

/** Opens sealed credentials; an UnsealError says why not (never what they hold). */
export function unseal(keys: MasterKeys, aad: string, sealed: Sealed): Record<string, string> {
  const dataKey = unwrap(keys, aad, sealed);
  try {
    const plaintext = decrypt(dataKey, sealed.sealed, `${aad}\0credentials`);
    if (!plaintext) throw new UnsealError('tampered', 'its credentials do not open: they were altered, or copied from another instance');
    const parsed = z.record(z.string(), z.string()).safeParse(JSON.parse(plaintext.toString('utf8')));
    if (!parsed.success) throw new UnsealError('tampered', 'its credentials opened to something this version cannot read');
    return parsed.data;
  } finally {
    dataKey.fill(0);
  }
}

/** The same credentials with their data key wrapped by the current master key (a rotation's re-wrap). */
export function rewrap(keys: MasterKeys, aad: string, sealed: Sealed): Sealed {
  if (sealed.kid === keys.currentKid) return sealed;
  const dataKey = unwrap(keys, aad, sealed);
  try {
    return { ...sealed, kid: keys.currentKid, wrapped: encrypt(keys.current, dataKey, `${aad}\0wrap\0${keys.currentKid}`) };
  } finally {
    dataKey.fill(0);
  }
}

/**
 * What reads show of credentials: the first 8 hex digits of SHA-256 of the API key, which an
 * operator can compare (`printf %s "$KEY" | sha256sum | cut -c1-8`) and which tells nothing
 * usable of a random key.
 */
export function fingerprintOf(credentials: Record<string, string>): string {
  const keys = Object.keys(credentials).sort();
  const material = keys.length === 1 ? credentials[keys[0]!]! : JSON.stringify(keys.map((k) => [k, credentials[k]]));
  return `sha256:${createHash('sha256').update(material, 'utf8').digest('hex').slice(0, 8)}`;
}
