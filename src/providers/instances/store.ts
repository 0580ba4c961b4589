import { randomUUID } from 'node:crypto';
import { z } from 'zod';
import { InvalidRequestError, LeaseOpsError } from '../../errors.ts';
import { luaCommand, type LuaCommand } from '../../queues/lua-scripts.ts';
import type { RedisClient } from '../../queues/redis.ts';
import { fingerprintOf, instanceAad, type MasterKeys, rewrap, seal, type Sealed, SealedSchema } from './sealing.ts';
import {
  apiUrlAllowed,
  checkConfig,
  type Credentials,
  type InstanceCreate,
  InstanceCreateSchema,
  type InstancePatch,
  InstancePatchSchema,
  INSTANCE_TYPES,
  type InstanceType,
  type InstanceView,
} from './schemas.ts';

/** A provider instance could not be saved, found or opened; `status` is the HTTP status the API answers. */
export class ProviderInstanceError extends LeaseOpsError {
  override name = 'ProviderInstanceError';
  constructor(
    code: string,
    readonly status: number,
    message: string,
  ) {
    super(code, message);
  }
}

export const instanceNotFound = (name: string) => new ProviderInstanceError('unknown_provider', 404, `no provider named "${name}"`);

/** How long a deleted instance's name answers provider_deleted to the operations that still name it. */
const TOMBSTONE_S = 30 * 24 * 3_600;
/** How long a draft (an instance being probed before it is saved) lives. */
const DRAFT_S = 120;

/** What a worker needs to build an instance's provider (the credentials still sealed). */
export interface InstanceRecord {
  companyId: string;
  name: string;
  type: InstanceType;
  config: Record<string, unknown>;
  environmentIds: string[] | null;
  sealed: Sealed;
  /** The fingerprint saved beside the sealed credentials (bound into their encryption). */
  fingerprint: string;
  rev: number;
}

const RecordSchema = z.object({
  companyId: z.string(),
  name: z.string(),
  type: z.enum(INSTANCE_TYPES),
  config: z.string(),
  envs: z.string(),
  sealed: z.string(),
  fingerprint: z.string(),
  by: z.string(),
  rev: z.coerce.number(),
  createdAt: z.coerce.number(),
  updatedAt: z.coerce.number(),
});

/** A record's stored fields, checked: a record that is not one (altered by hand) reads as unreadable, not as a crash. */
function parseRecord(fields: Record<string, string>): z.infer<typeof RecordSchema> | null {
  const parsed = RecordSchema.safeParse(fields);
  return parsed.success ? parsed.data : null;
}

const enc = (part: string) => encodeURIComponent(part);

/**
 * The provider registry in Redis: instances saved at run time, each belonging to a company
 * (and maybe some of its environments), their credentials sealed (sealing.ts). Keys, under
 * the deployment's prefix:
 *   provider-instance:<company>:<name>          the record (hash)
 *   provider-instances:<company>                the company's names (zset, by name)
 *   provider-instances                          every <company>/<name> (zset, by name)
 *   provider-instance-kids                      instances per master key id (hash)
 *   provider-instance-rev                       the revision counter
 *   provider-instance-deleted:<company>:<name>  a deleted instance's tombstone (30 days)
 *   provider-instance-draft:<id>                an instance being probed before its save (2 min)
 * (company ids percent-encoded.)
 */
export class ProviderInstanceStore {
  private readonly saveScript: LuaCommand;
  private readonly deleteScript: LuaCommand;
  private readonly rewrapScript: LuaCommand;

  constructor(
    private readonly redis: RedisClient,
    private readonly prefix: string,
    private readonly options: {
      /** Null: this process holds no master key, and can list instances but not save them. */
      keys: MasterKeys | null;
      /** API addresses besides the services' public ones (LEASE_OPS_INSTANCE_API_URLS). */
      allowedApiUrls: readonly string[];
      /** Instances one company may hold (LEASE_OPS_MAX_PROVIDER_INSTANCES_PER_COMPANY; 0 or unset: no limit). */
      maxPerCompany?: number;
    },
  ) {
    this.saveScript = luaCommand(redis, 'instance-save', 6);
    this.deleteScript = luaCommand(redis, 'instance-delete', 5);
    this.rewrapScript = luaCommand(redis, 'instance-rewrap', 2);
  }

  get keys(): MasterKeys | null {
    return this.options.keys;
  }

  private recordKey = (companyId: string, name: string) => `${this.prefix}:provider-instance:${enc(companyId)}:${name}`;
  private companyIndex = (companyId: string) => `${this.prefix}:provider-instances:${enc(companyId)}`;
  private get allIndex() {
    return `${this.prefix}:provider-instances`;
  }
  private get kidsKey() {
    return `${this.prefix}:provider-instance-kids`;
  }
  private tombstoneKey = (companyId: string, name: string) => `${this.prefix}:provider-instance-deleted:${enc(companyId)}:${name}`;
  private draftKey = (id: string) => `${this.prefix}:provider-instance-draft:${id}`;

  private requireKeys(): MasterKeys {
    if (!this.options.keys) throw new ProviderInstanceError('secrets_key_missing', 503, 'this process holds no master key (LEASE_OPS_SECRETS_KEY): it cannot save provider credentials');
    return this.options.keys;
  }

  /** Checks a create request: its shape, its settings for its type, and its address. */
  parseCreate(body: unknown): InstanceCreate {
    const parsed = InstanceCreateSchema.safeParse(body);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error, 'provider instance');
    this.checkApiUrl(parsed.data.type, parsed.data.config ?? {});
    return parsed.data;
  }

  private checkApiUrl(type: InstanceType, config: Record<string, unknown>): void {
    const apiUrl = config.apiUrl;
    if (typeof apiUrl === 'string' && !apiUrlAllowed(type, apiUrl, this.options.allowedApiUrls)) {
      throw new InvalidRequestError('invalid provider instance: config.apiUrl is not an address instances may use (the service\'s public one, or one LEASE_OPS_INSTANCE_API_URLS lists)', [
        { code: 'custom', path: ['config', 'apiUrl'], message: 'not an allowed address', input: undefined } as never,
      ]);
    }
  }

  /** The fields of a save: settings, environments and (sealed) credentials. */
  private fieldsOf(companyId: string, name: string, part: { config?: Record<string, unknown>; environmentIds?: string[] | null; credentials?: Credentials }, by: string): string[] {
    const fields: string[] = ['companyId', companyId, 'name', name, 'by', by];
    if (part.config !== undefined) fields.push('config', JSON.stringify(part.config));
    if (part.environmentIds !== undefined) fields.push('envs', part.environmentIds ? JSON.stringify(part.environmentIds) : '');
    if (part.credentials) {
      const fingerprint = fingerprintOf(part.credentials);
      const sealed = seal(this.requireKeys(), instanceAad(companyId, name, fingerprint), part.credentials);
      fields.push('sealed', JSON.stringify(sealed), 'kid', sealed.kid, 'fingerprint', fingerprint);
    }
    return fields;
  }

  private async runSave(mode: 'create' | 'update', companyId: string, name: string, fields: string[], expectedRev?: number): Promise<number> {
    const reply = (await this.saveScript(
      this.recordKey(companyId, name),
      this.companyIndex(companyId),
      this.allIndex,
      this.kidsKey,
      `${this.prefix}:provider-instance-rev`,
      this.tombstoneKey(companyId, name),
      mode,
      expectedRev === undefined ? '' : String(expectedRev),
      name,
      `${enc(companyId)}/${name}`,
      Date.now(),
      this.options.maxPerCompany ?? 0,
      ...fields,
    )) as [string, (string | number)?];
    switch (reply[0]) {
      case 'ok':
        return Number(reply[1]);
      case 'full':
        throw new ProviderInstanceError('company_providers_full', 429, `company ${companyId} holds ${reply[1]} provider instances already (LEASE_OPS_MAX_PROVIDER_INSTANCES_PER_COMPANY): delete one first`);
      case 'exists':
        throw new ProviderInstanceError('provider_exists', 409, `company ${companyId} has a provider named "${name}" already: update it, or choose another name`);
      case 'missing':
        throw instanceNotFound(name);
      default:
        throw new ProviderInstanceError('rev_conflict', 412, `the provider "${name}" changed meanwhile (now revision ${reply[1]}): read it again`);
    }
  }

  async create(companyId: string, input: InstanceCreate, by: string): Promise<InstanceView> {
    const fields = [
      ...this.fieldsOf(companyId, input.name, { config: input.config ?? {}, environmentIds: input.environmentIds ?? null, credentials: input.credentials }, by),
      'type',
      input.type,
    ];
    await this.runSave('create', companyId, input.name, fields);
    return (await this.get(companyId, input.name))!;
  }

  /** Checks a patch against the instance's type; returns what the save would write. */
  async parsePatch(companyId: string, name: string, body: unknown): Promise<{ patch: InstancePatch; current: InstanceView }> {
    const parsed = InstancePatchSchema.safeParse(body);
    if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error, 'provider instance update');
    const current = await this.get(companyId, name);
    if (!current) throw instanceNotFound(name);
    if (parsed.data.config) {
      const issues: z.core.$ZodIssue[] = [];
      checkConfig(current.type, parsed.data.config, { addIssue: (issue: unknown) => void issues.push(issue as z.core.$ZodIssue) } as unknown as z.RefinementCtx);
      if (issues.length > 0) throw InvalidRequestError.fromZod(new z.ZodError(issues), 'provider instance update');
      this.checkApiUrl(current.type, parsed.data.config);
    }
    return { patch: parsed.data, current };
  }

  async update(companyId: string, name: string, patch: InstancePatch, by: string, expectedRev?: number): Promise<InstanceView> {
    await this.runSave('update', companyId, name, this.fieldsOf(companyId, name, patch, by), expectedRev);
    const view = await this.get(companyId, name);
    if (!view) throw instanceNotFound(name);
    return view;
  }

  /**
   * Deletes an instance, leaving its tombstone; `takeBack` deletes a save that must not stand
   * (its name turned out to be a configured provider's) and leaves none: nothing was accepted for it.
   */
  async remove(companyId: string, name: string, expectedRev?: number, opts: { takeBack?: boolean } = {}): Promise<void> {
    const reply = (await this.deleteScript(
      this.recordKey(companyId, name),
      this.companyIndex(companyId),
      this.allIndex,
      this.kidsKey,
      this.tombstoneKey(companyId, name),
      name,
      `${enc(companyId)}/${name}`,
      opts.takeBack ? 0 : TOMBSTONE_S,
      expectedRev === undefined ? '' : String(expectedRev),
    )) as [string, string?];
    if (reply[0] === 'missing') throw instanceNotFound(name);
    if (reply[0] === 'conflict') throw new ProviderInstanceError('rev_conflict', 412, `the provider "${name}" changed meanwhile (now revision ${reply[1]}): read it again`);
  }

  private viewOf(record: z.infer<typeof RecordSchema>): InstanceView {
    return {
      name: record.name,
      type: record.type,
      companyId: record.companyId,
      environmentIds: record.envs ? (JSON.parse(record.envs) as string[]) : null,
      source: 'instance',
      config: JSON.parse(record.config) as Record<string, unknown>,
      credentials: { fingerprint: record.fingerprint },
      rev: record.rev,
      createdAt: new Date(record.createdAt).toISOString(),
      updatedAt: new Date(record.updatedAt).toISOString(),
      updatedBy: record.by,
    };
  }

  async get(companyId: string, name: string): Promise<InstanceView | null> {
    const record = parseRecord(await this.redis.hgetall(this.recordKey(companyId, name)));
    return record ? this.viewOf(record) : null;
  }

  /**
   * One page of instances, by name: a company's, or (companyId undefined) every company's
   * by company then name. `after` is the last entry of the previous page (nextCursor).
   */
  async list(opts: { companyId?: string; after?: string; limit: number }): Promise<{ instances: InstanceView[]; nextCursor: string | null }> {
    const index = opts.companyId === undefined ? this.allIndex : this.companyIndex(opts.companyId);
    const from = opts.after ? `(${opts.after}` : '-';
    const members = await this.redis.zrangebylex(index, from, '+', 'LIMIT', 0, opts.limit);
    const pipeline = this.redis.pipeline();
    for (const member of members) {
      const [company, name] = opts.companyId === undefined ? splitMember(member) : [opts.companyId, member];
      pipeline.hgetall(this.recordKey(company, name));
    }
    const replies = members.length > 0 ? ((await pipeline.exec()) ?? []) : [];
    const instances = replies.map(([, fields]) => parseRecord(fields as Record<string, string>)).filter((r) => r !== null).map((r) => this.viewOf(r));
    return { instances, nextCursor: members.length === opts.limit ? members[members.length - 1]! : null };
  }

  /** What a worker builds a provider from, or null when there is no such instance. */
  async record(companyId: string, name: string): Promise<InstanceRecord | 'unreadable' | null> {
    return this.recordAt(this.recordKey(companyId, name));
  }

  private async recordAt(key: string): Promise<InstanceRecord | 'unreadable' | null> {
    const fields = await this.redis.hgetall(key);
    if (Object.keys(fields).length === 0) return null;
    const record = parseRecord(fields);
    if (!record) return 'unreadable';
    const sealed = safeJson(record.sealed, SealedSchema);
    const config = safeJson(record.config, z.record(z.string(), z.unknown()));
    const envs = record.envs ? safeJson(record.envs, z.array(z.string())) : null;
    if (!sealed || !config || (record.envs && !envs)) return 'unreadable';
    return { companyId: record.companyId, name: record.name, type: record.type, config, environmentIds: envs, sealed, fingerprint: record.fingerprint, rev: record.rev };
  }

  /**
   * Whether a lease's company holds an instance of the lease's provider name for the lease's
   * environment: what an operation of that lease runs with when its caller did not say (the API
   * decides the same way, after what the caller may use). One read.
   */
  async holds(lease: { provider: string; companyId: string; environmentId: string }): Promise<boolean> {
    const [rev, envs] = await this.redis.hmget(this.recordKey(lease.companyId, lease.provider), 'rev', 'envs');
    return rev !== null && (!envs || (safeJson(envs, z.array(z.string()))?.includes(lease.environmentId) ?? false));
  }

  /** An instance's revision (what a worker compares with the provider it built), or null. */
  async rev(companyId: string, name: string): Promise<number | null> {
    const rev = await this.redis.hget(this.recordKey(companyId, name), 'rev');
    return rev === null ? null : Number(rev);
  }

  async wasDeleted(companyId: string, name: string): Promise<boolean> {
    return (await this.redis.exists(this.tombstoneKey(companyId, name))) === 1;
  }

  /** How many instances each master key id wraps. */
  async keysInUse(): Promise<Record<string, number>> {
    const counts = await this.redis.hgetall(this.kidsKey);
    return Object.fromEntries(Object.entries(counts).map(([kid, n]) => [kid, Number(n)]).filter(([, n]) => (n as number) > 0));
  }

  /**
   * Re-wraps every instance's data key under the current master key (a rotation's second
   * step). Each one is replaced only if unchanged since it was read; one that does not open
   * is counted, named and left as it is.
   */
  async rewrapAll(): Promise<{ rewrapped: number; current: number; failed: { companyId: string; name: string; reason: string }[] }> {
    const keys = this.requireKeys();
    const report = { rewrapped: 0, current: 0, failed: [] as { companyId: string; name: string; reason: string }[] };
    let after: string | undefined;
    for (;;) {
      const members = await this.redis.zrangebylex(this.allIndex, after ? `(${after}` : '-', '+', 'LIMIT', 0, 500);
      for (const member of members) {
        const [companyId, name] = splitMember(member);
        const key = this.recordKey(companyId, name);
        for (;;) {
          const [raw, fingerprint] = await this.redis.hmget(key, 'sealed', 'fingerprint');
          if (raw === null || raw === undefined) break;
          const sealed = safeJson(raw, SealedSchema);
          if (!sealed) {
            report.failed.push({ companyId, name, reason: 'its sealed credentials are not readable' });
            break;
          }
          if (sealed.kid === keys.currentKid) {
            report.current++;
            break;
          }
          let next: Sealed;
          try {
            next = rewrap(keys, instanceAad(companyId, name, fingerprint ?? ''), sealed);
          } catch (err) {
            report.failed.push({ companyId, name, reason: (err as Error).message });
            break;
          }
          if (Number(await this.rewrapScript(key, this.kidsKey, raw, JSON.stringify(next), next.kid)) === 1) {
            report.rewrapped++;
            break;
          }
          // Saved meanwhile: read it again.
        }
      }
      if (members.length < 500) return report;
      after = members[members.length - 1];
    }
  }

  /** Keeps an instance for a probe before it is saved; the probe's worker reads it by id. */
  async saveDraft(companyId: string, input: InstanceCreate): Promise<string> {
    const id = randomUUID();
    const sealed = seal(this.requireKeys(), instanceAad(companyId, input.name, fingerprintOf(input.credentials)), input.credentials);
    await this.redis
      .multi()
      .hset(this.draftKey(id), {
        companyId,
        name: input.name,
        type: input.type,
        config: JSON.stringify(input.config ?? {}),
        envs: '',
        sealed: JSON.stringify(sealed),
        fingerprint: fingerprintOf(input.credentials),
        by: 'draft',
        rev: 0,
        createdAt: Date.now(),
        updatedAt: Date.now(),
      })
      .expire(this.draftKey(id), DRAFT_S)
      .exec();
    return id;
  }

  async draft(id: string): Promise<InstanceRecord | 'unreadable' | null> {
    return this.recordAt(this.draftKey(id));
  }

  async dropDraft(id: string): Promise<void> {
    await this.redis.del(this.draftKey(id));
  }
}

function splitMember(member: string): [string, string] {
  const slash = member.lastIndexOf('/');
  return [decodeURIComponent(member.slice(0, slash)), member.slice(slash + 1)];
}

function safeJson<T extends z.ZodType>(text: string, schema: T): z.infer<T> | null {
  try {
    const parsed = schema.safeParse(JSON.parse(text));
    return parsed.success ? parsed.data : null;
  } catch {
    return null;
  }
}
