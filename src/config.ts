import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { OperationNameSchema } from './operations.ts';
import { parsePartitionList } from './partitions.ts';
import { isClusterUrl } from './queues/redis.ts';
import { describeSetting } from './secrets.ts';

/** Thrown when an environment variable does not parse; the message names the variable. */
export class ConfigError extends Error {
  override name = 'ConfigError';
}

const int = (def: number, min = 0) => z.coerce.number().int().min(min).default(def);
const bool = (def: boolean) =>
  z
    .enum(['true', 'false', '1', '0', 'yes', 'no'])
    .default(def ? 'true' : 'false')
    .transform((v) => v === 'true' || v === '1' || v === 'yes');

/** An environment variable holding JSON, checked against `schema`. */
const jsonEnv = <T extends z.ZodType>(schema: T) =>
  z
    .string()
    .default('{}')
    .transform((text, ctx) => {
      try {
        return JSON.parse(text) as unknown;
      } catch {
        ctx.addIssue({ code: 'custom', message: 'must be JSON' });
        return z.NEVER;
      }
    })
    .pipe(schema);

/**
 * One API token. Without a company it is an admin token (every lease, and Bull Board);
 * with one, it sees only that company's leases (and only the listed environments, if any).
 */
export const ApiTokenSchema = z.strictObject({
  token: z.string().min(16, 'tokens must be at least 16 characters').max(256).regex(/^[\x21-\x7e]+$/, 'tokens are printable ASCII without spaces'),
  name: z.string().max(64).optional(),
  companyId: z.string().min(1).max(256).optional(),
  environmentIds: z.array(z.string().min(1).max(256)).min(1).optional(),
});
export type ApiToken = z.infer<typeof ApiTokenSchema>;

/** Comma-separated admin tokens, or a JSON array of ApiTokenSchema entries for scoped ones. */
const apiTokens = z
  .string()
  .default('')
  .transform((text, ctx) => {
    const trimmed = text.trim();
    if (trimmed === '') return [];
    if (!trimmed.startsWith('[')) return trimmed.split(',').map((token) => ({ token: token.trim() }));
    try {
      return JSON.parse(trimmed) as unknown;
    } catch {
      ctx.addIssue({ code: 'custom', message: 'must be comma-separated tokens or a JSON array' });
      return z.NEVER;
    }
  })
  .pipe(
    z.array(ApiTokenSchema).superRefine((tokens, ctx) => {
      // One token, one principal: listed twice, which entry applies would be a guess.
      const seen = new Map<string, number>();
      tokens.forEach(({ token }, i) => {
        const first = seen.get(token);
        if (first !== undefined) ctx.addIssue({ code: 'custom', message: `entries ${first + 1} and ${i + 1} hold the same token` });
        else seen.set(token, i);
      });
    }),
  );

const perOperation = <T extends z.ZodType>(value: T) => z.partialRecord(OperationNameSchema, value);
/** Default deadlines may also name lease-ops' own clean-up operation. */
const perJobOperation = <T extends z.ZodType>(value: T) => z.partialRecord(z.enum([...OperationNameSchema.options, 'abandon-acquire']), value);

/**
 * Every setting lease-ops reads from the environment. Names are the environment
 * variable names, so an error message can point at exactly what to fix.
 */
export const EnvSchema = z.object({
  /** One server (redis://, rediss://), or Redis Cluster seed nodes: redis+cluster://host:port,host:port */
  REDIS_URL: z
    .string()
    .refine(
      (url) => isClusterUrl(url) || (URL.canParse(url) && /^rediss?:$/.test(new URL(url).protocol)),
      'must be redis://host:port, rediss://host:port or redis+cluster://host:port,host:port',
    )
    .refine(
      (url) => isClusterUrl(url) || !URL.canParse(url) || /^\/?(\d|1[0-5])?$/.test(new URL(url).pathname),
      'the path after the host names a database from 0 to 15 (redis://host:port/0), or is left out',
    )
    .refine(
      (url) => !URL.canParse(url) || new URL(url).search === '',
      'takes no ?options (ioredis would read them as connection settings); the database goes in the path',
    )
    .default('redis://127.0.0.1:6379'),
  /** Key prefix for every key lease-ops and BullMQ write. Must hold a {hash tag} so one
   *  Redis Cluster slot owns the whole queue and its lanes (Lua scripts touch both). */
  LEASE_OPS_PREFIX: z
    .string()
    .regex(/^[^{}]*\{[^{}]+\}[^{}]*$/, 'must contain exactly one {hash tag}, e.g. {lease-ops}')
    .default('{lease-ops}'),
  LEASE_OPS_QUEUE: z
    .string()
    .regex(/^[A-Za-z0-9_-]+$/)
    .refine((name) => !QUEUE_NAMES_REFUSED.includes(name), 'names a family of lease-ops\' own keys under the prefix (BullMQ\'s keys of the queue, <prefix>:<queue>:..., would be among them): choose another name')
    .default('ops'),
  /** How many partitions the lanes are split over (see src/partitions.ts and docs/scaling.md).
   *  Every process of a deployment uses the same number; Redis holds it and refuses another. */
  LEASE_OPS_PARTITIONS: z.coerce.number().int().min(1).max(256).default(1),
  /** The partitions this worker serves: `all`, or indices and ranges such as `0,2-3`. */
  LEASE_OPS_WORKER_PARTITIONS: z.string().default('all'),
  /**
   * Operations one worker runs at once. Most of an operation is waiting (a provider call, a
   * sandbox in transition, a push): a slot costs a promise and a lock renewal, not CPU, and
   * sandboxes in transition at once each hold one while they wait (LEASE_OPS_SETTLE_WAITS).
   */
  LEASE_OPS_CONCURRENCY: int(200, 1),
  /** Commands (exec) one worker runs in sandboxes at once, beside its operations. */
  LEASE_OPS_EXEC_CONCURRENCY: int(100, 1),
  /** BullMQ lock: a job whose worker stops renewing it for this long is stalled and re-run. */
  LEASE_OPS_LOCK_MS: int(30_000, 1_000),
  // Short: a crashed worker's job runs again within LOCK_MS + 2 x this (BullMQ marks, then moves).
  LEASE_OPS_STALLED_INTERVAL_MS: int(5_000, 500),
  LEASE_OPS_MAX_STALLED: int(1, 0),
  /** How often the lane sweep runs, and how long a lane may show no progress before the
   *  sweep looks at its head. Together they bound how long a removed or crashed job can
   *  block its lease. */
  LEASE_OPS_SWEEP_INTERVAL_MS: int(5_000, 100),
  LEASE_OPS_SWEEP_STALE_MS: int(10_000, 0),
  /** The stuck-stop watchdog: how often it scans, after how long `stopping` counts as stuck
   *  (the host's graceful stop budget, 30 s), and how many force-stops it tries per episode. */
  LEASE_OPS_WATCHDOG: bool(true),
  LEASE_OPS_WATCHDOG_INTERVAL_MS: int(5_000, 100),
  LEASE_OPS_STUCK_STOPPING_MS: int(30_000, 0),
  /** After a request that may still be running at the cloud (timed out, cut), the lane waits this long before its next call; 0 = no wait. */
  LEASE_OPS_INFLIGHT_GRACE_MS: int(5_000, 0),
  /**
   * How long an attempt that met a settling sandbox waits, holding its lane, for the provider
   * to push the sandbox's next state (Daytona's notification gateway) before it backs off as
   * usual; 0 = never waits. Only providers that can push wait at all.
   */
  LEASE_OPS_SETTLE_WAIT_MS: int(5_000, 0),
  /** How many attempts of a worker may wait for a push at once (each holds a worker slot); unset: half of LEASE_OPS_CONCURRENCY. */
  LEASE_OPS_SETTLE_WAITS: z.coerce.number().int().min(0).optional(),
  LEASE_OPS_WATCHDOG_MAX_FORCE: int(5, 1),
  /** Retry backoff for settling and transient errors (brief: 250 ms doubling to 5 s). */
  LEASE_OPS_BACKOFF_BASE_MS: int(250, 1),
  LEASE_OPS_BACKOFF_CAP_MS: int(5_000, 1),
  /** Per-operation overrides, e.g. {"resume":{"baseMs":100,"capMs":2000}}. */
  LEASE_OPS_BACKOFF_BY_OP: jsonEnv(
    perOperation(z.strictObject({ baseMs: z.number().int().positive().optional(), capMs: z.number().int().positive().optional() })),
  ),
  /** Default deadlines per operation in ms, e.g. {"stop":60000} (brief: acquire 300 s, resume 60 s). */
  LEASE_OPS_DEADLINES_MS: jsonEnv(perJobOperation(z.number().int().positive().max(7 * 24 * 3_600_000))),
  /** Enqueue refuses (HTTP 429) past these: operations queued in one lease's lane (force-stops
   *  are never refused), and operations waiting, parked or backing off in all. 0 = no limit. */
  /** How long the client, the CLI and the API wait for Redis before answering that it is unavailable. */
  LEASE_OPS_REDIS_TIMEOUT_MS: int(2_000, 100),
  LEASE_OPS_MAX_QUEUED_PER_LEASE: int(1_000, 0),
  LEASE_OPS_MAX_QUEUED: int(1_000_000, 0),
  /** Operations one company's lanes may hold, and one environment's (0 = no limit of its
   *  own). Past LEASE_OPS_MAX_QUEUED, a company under its fair share still gets in. */
  LEASE_OPS_MAX_QUEUED_PER_COMPANY: int(100_000, 0),
  LEASE_OPS_MAX_QUEUED_PER_ENVIRONMENT: int(0, 0),
  /**
   * Redis bytes one company's operations may hold: each counted as its data plus an allowance
   * for its job and history, until it is gone. At the budget its oldest ended operations' records
   * go before their retention; live ones alone past it: 429 company_bytes_full. 0 = no limit.
   */
  LEASE_OPS_MAX_BYTES_PER_COMPANY: int(256 * 1024 * 1024, 0),
  /** Provider instances one company may save (429 company_providers_full past it). 0 = no limit. */
  LEASE_OPS_MAX_PROVIDER_INSTANCES_PER_COMPANY: int(100, 0),
  /** Per-company overrides, e.g. {"acme":{"maxQueued":500000,"maxQueuedPerEnvironment":0,"environments":{"prod":400000},"maxBytes":268435456}}. */
  LEASE_OPS_QUEUE_LIMITS: jsonEnv(
    z.record(
      z.string().min(1),
      z.strictObject({
        maxQueued: z.number().int().min(0).optional(),
        maxQueuedPerEnvironment: z.number().int().min(0).optional(),
        maxBytes: z.number().int().min(0).optional(),
        environments: z.record(z.string().min(1), z.number().int().min(0)).optional(),
      }),
    ),
  ),
  LEASE_OPS_KEEP_COMPLETED_S: int(3_600, 0),
  LEASE_OPS_KEEP_FAILED_S: int(7 * 24 * 3_600, 0),
  /** Built-in provider names or module paths, comma separated (see README, providers). */
  LEASE_OPS_PROVIDERS: z.string().default('simulated'),
  /**
   * Addresses provider instances saved at run time may use besides the services' public ones
   * (comma-separated URL prefixes): a tenant cannot point the workers anywhere else.
   */
  LEASE_OPS_INSTANCE_API_URLS: z.string().default(''),
  /**
   * The configured providers (LEASE_OPS_PROVIDERS, the providers file) that company-scoped
   * API tokens may use: `*` (all, the default) or a comma-separated list; the others are
   * admin-only (to a scoped token they do not exist).
   */
  LEASE_OPS_SHARED_PROVIDERS: z.string().default('*'),
  /** Instance providers a worker keeps built (least recently used go first). */
  LEASE_OPS_INSTANCE_CACHE: int(1_000, 1),
  /** The HTTP API with Bull Board (`lease-ops api`, `lease-ops start`). */
  LEASE_OPS_API_HOST: z.string().min(1).default('127.0.0.1'),
  LEASE_OPS_API_PORT: z.coerce.number().int().min(0).max(65_535).default(3000),
  /** Bearer tokens for the API (secrets: never logged). Required by `lease-ops api`. */
  LEASE_OPS_API_TOKENS: apiTokens,
  /** Upper bound of ?waitMs on GET /v1/operations/{jobId}. */
  LEASE_OPS_API_MAX_WAIT_MS: int(30_000, 0),
  /** A client has this long to send a request's headers, and this long for the whole request (body included). */
  LEASE_OPS_API_HEADERS_TIMEOUT_MS: int(10_000, 1),
  LEASE_OPS_API_REQUEST_TIMEOUT_MS: int(15_000, 1),
  /** An idle keep-alive connection is closed after this long. */
  LEASE_OPS_API_KEEPALIVE_TIMEOUT_MS: int(5_000, 1),
  /** Connections the API holds at once; more are refused until some close. */
  LEASE_OPS_API_MAX_CONNECTIONS: int(1_000, 1),
  /**
   * Requests that hold their connection while they wait (?waitMs, Prefer: wait, exec): at most
   * this many at once in all (fewer than LEASE_OPS_API_MAX_CONNECTIONS, so other requests and
   * the probes always find a connection), and per company (429 company_waits_full past it).
   */
  LEASE_OPS_API_MAX_WAITS: int(500, 1),
  LEASE_OPS_API_MAX_WAITS_PER_COMPANY: int(100, 1),
  /**
   * Requests a company's tokens may have in progress in one API process at once; the next wait
   * their turn, in order, before their body is read (a request waiting for an operation gives
   * its turn back meanwhile). 0: no limit.
   */
  LEASE_OPS_API_REQUESTS_PER_COMPANY: int(4, 0),
  /**
   * Worker threads `lease-ops api` runs tenants' walks in (attention, timelines), each with its
   * own Redis connection, started at the first walk; a company has one walk in them at a time
   * and at most 4 waiting (429 company_walks_full past them). 0: walks run in the API's own
   * event loop, where one company's walks delay every other request. At most 16.
   */
  LEASE_OPS_API_WALK_THREADS: int(2, 0).pipe(z.number().max(16, 'at most 16: each thread holds its own copy of the client (about 50 MB) and Redis connections')),
  /** Lanes a company may hold paused at once (429 company_pauses_full past it; an admin token goes past it, and is told). 0: no limit. */
  LEASE_OPS_MAX_PAUSED_PER_COMPANY: int(100, 0),
  /**
   * Requests a scoped token's company may send this API replica, per class: cheap reads, walks
   * (attention, timelines) and changes, e.g. {"walk":{"perSecond":2,"burst":4}}; a rate of 0
   * turns that class's limit off. Admin tokens are not limited.
   */
  LEASE_OPS_API_COMPANY_RATES: jsonEnv(z.partialRecord(z.enum(['read', 'walk', 'write']), z.strictObject({ perSecond: z.number().min(0).max(1e6), burst: z.number().int().min(1).max(1e7) }))),
  /** Bull Board shows but cannot change jobs (retry, remove, promote) while this is on. */
  LEASE_OPS_BOARD_READ_ONLY: bool(true),
  /** BullMQ's own per-minute completed/failed counts (bullmq_job_*_total on /metrics). Off by
   *  default: they cost a few Redis writes per job, and lease_ops_operations_total counts the same. */
  LEASE_OPS_BULLMQ_METRICS: bool(false),
  /**
   * When set, /metrics (the API's and each worker's) answers only `Authorization: Bearer
   * <this>`; unset, anyone who reaches the port reads every tenant's counts.
   */
  LEASE_OPS_METRICS_TOKEN: z.string().min(16, 'the metrics token must be at least 16 characters').regex(/^[\x21-\x7e]+$/, 'the metrics token is printable ASCII without spaces').optional(),
  /** A worker replica serves /healthz, /readyz and /metrics on this port; 0 = off. */
  LEASE_OPS_METRICS_PORT: z.coerce.number().int().min(0).max(65_535).default(0),
  LEASE_OPS_LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
  /** Log lines as JSON (collectors) or pretty (a person); `auto`: pretty on a terminal, JSON otherwise. */
  LEASE_OPS_LOG_FORMAT: z.enum(['auto', 'json', 'pretty']).default('auto'),
});

export type Config = z.infer<typeof EnvSchema>;

/** Settings that are secrets: each may come from the file its `_FILE` variable names instead. */
export const FILE_SECRETS = ['LEASE_OPS_API_TOKENS', 'LEASE_OPS_METRICS_TOKEN'] as const;

/**
 * A secret from its variable, or from the file its `<variable>_FILE` names (a Docker or
 * Kubernetes secret mounted as a file; one trailing newline dropped); not both. Undefined
 * when neither is set. Errors name the variable and the file, never the value.
 */
export function secretSetting(env: NodeJS.ProcessEnv, variable: string): string | undefined {
  const direct = env[variable];
  const file = env[`${variable}_FILE`];
  if (direct !== undefined && direct !== '' && file) throw new ConfigError(`set ${variable} or ${variable}_FILE, not both`);
  if (!file) return direct;
  try {
    return readFileSync(file, 'utf8').replace(/\r?\n$/, '');
  } catch (err) {
    throw new ConfigError(`${variable}_FILE=${file}: cannot read it (${(err as NodeJS.ErrnoException).code ?? 'error'})`);
  }
}

/**
 * The families of lease-ops' keys under the prefix whose last parts a caller names (a company,
 * a provider account's scope: the key table of docs/design.md, held against it by
 * test/config.test.ts). A queue of one of these names would have BullMQ's keys among them
 * (helper-33: a queue named `deadlines` made company `meta`'s index BullMQ's meta hash, and its
 * enqueues failed half done). Families keyed by lane id or a hash cannot meet BullMQ's names.
 */
export const QUEUE_NAMES_REFUSED: readonly string[] = ['bytes', 'bytes-order', 'deadlines', 'pace', 'provider-instance', 'provider-instance-deleted', 'provider-instances', 'reruns'];

export function loadConfig(env: NodeJS.ProcessEnv = process.env): Config {
  const fromFiles: Record<string, string> = {};
  for (const variable of FILE_SECRETS) {
    const value = secretSetting(env, variable);
    if (value !== undefined) fromFiles[variable] = value;
  }
  const parsed = EnvSchema.safeParse({ ...env, ...fromFiles });
  if (!parsed.success) {
    const lines = parsed.error.issues.map((issue) => {
      const variable = String(issue.path[0] ?? '');
      // Where inside a structured value (a JSON list of tokens, say), by position only.
      const inside = issue.path.length > 1 ? ` at ${issue.path.slice(1).join('.')}` : '';
      return `  ${describeSetting(variable, fromFiles[variable] ?? env[variable])}${inside}: ${issue.message}`;
    });
    throw new ConfigError(`invalid configuration:\n${lines.join('\n')}`);
  }
  // Unset: 500, or half the connections where fewer are allowed.
  if (env.LEASE_OPS_API_MAX_WAITS === undefined) parsed.data.LEASE_OPS_API_MAX_WAITS = Math.max(1, Math.min(500, Math.floor(parsed.data.LEASE_OPS_API_MAX_CONNECTIONS / 2)));
  // Unset: 100, or a fifth of the server's waits where fewer are allowed, so one company never
  // holds them all (helper-18: with 50 connections, one company's 25 refused every other's).
  if (env.LEASE_OPS_API_MAX_WAITS_PER_COMPANY === undefined) parsed.data.LEASE_OPS_API_MAX_WAITS_PER_COMPANY = Math.max(1, Math.min(100, Math.floor(parsed.data.LEASE_OPS_API_MAX_WAITS / 5)));
  if (parsed.data.LEASE_OPS_API_MAX_WAITS >= parsed.data.LEASE_OPS_API_MAX_CONNECTIONS) {
    throw new ConfigError(
      `invalid configuration:\n  LEASE_OPS_API_MAX_WAITS=${parsed.data.LEASE_OPS_API_MAX_WAITS}: must be below LEASE_OPS_API_MAX_CONNECTIONS (${parsed.data.LEASE_OPS_API_MAX_CONNECTIONS}), so requests that do not wait (and /healthz) always find a connection`,
    );
  }
  const served = parsePartitionList(parsed.data.LEASE_OPS_WORKER_PARTITIONS, parsed.data.LEASE_OPS_PARTITIONS);
  if (typeof served === 'string') throw new ConfigError(`invalid configuration:\n  LEASE_OPS_WORKER_PARTITIONS: ${served}`);
  return parsed.data;
}

/** The master key of the provider registry (providers/instances/sealing.ts): read there, never kept in the config. */
export const SECRETS_KEY_VARIABLES = ['LEASE_OPS_SECRETS_KEY', 'LEASE_OPS_SECRETS_KEY_FILE', 'LEASE_OPS_SECRETS_KEY_PREVIOUS', 'LEASE_OPS_SECRETS_KEY_PREVIOUS_FILE'] as const;

/** LEASE_OPS_ variables read outside this schema (by the providers, the fault points, the tests and tools). */
const READ_ELSEWHERE = [...SECRETS_KEY_VARIABLES, ...FILE_SECRETS.map((v) => `${v}_FILE`), 'LEASE_OPS_PROVIDERS_FILE', 'LEASE_OPS_SIMULATED_URL', 'LEASE_OPS_SIMULATED_EXEC', 'LEASE_OPS_FAULT_POINTS', 'LEASE_OPS_CHAOS', 'LEASE_OPS_CHROMIUM', 'LEASE_OPS_FUZZ_REPORT', 'LEASE_OPS_TEST_BUILT'];

/**
 * LEASE_OPS_ variables set in `env` that lease-ops does not read (a misspelling, most
 * likely), each with the known name closest to it: the commands warn about them.
 */
export function unknownSettings(env: NodeJS.ProcessEnv = process.env): { name: string; closest: string }[] {
  const known = [...Object.keys(EnvSchema.shape), ...READ_ELSEWHERE];
  return Object.keys(env)
    .filter((name) => name.startsWith('LEASE_OPS_') && !known.includes(name))
    .map((name) => ({ name, closest: known.reduce((best, k) => (editDistance(name, k) < editDistance(name, best) ? k : best)) }));
}

/** Levenshtein distance, one row at a time. */
function editDistance(a: string, b: string): number {
  let row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const next = [i];
    for (let j = 1; j <= b.length; j++) next[j] = Math.min(row[j]! + 1, next[j - 1]! + 1, row[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    row = next;
  }
  return row[b.length]!;
}
