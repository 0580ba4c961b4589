import { createHash } from 'node:crypto';
import { createBullBoard } from '@bull-board/api';
import { LeaseOpsBoardAdapter } from './board-adapter.ts';
import { HttpError } from './http-error.ts';
import { WaitBudget } from './wait-budget.ts';
import { CompanyTurns } from './company-turns.ts';
import { RefusalLog } from './refusal-log.ts';
import { requestLog, requestLogger } from './request-log.ts';
import { walksInProcess, type Walks } from './walks.ts';
import { CompanyRateLimiter, costOfBody, DEFAULT_COMPANY_RATES, RETRY_SPREAD_S, type RequestClass } from './company-rates.ts';
import { actionPage, attentionPage, PAGE_CSP, timelinePage, timelinePath } from './pages.ts';
import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { ExpressAdapter } from '@bull-board/express';
import type { Queue } from 'bullmq';
import express, { type ErrorRequestHandler, type NextFunction, type Request, type Response } from 'express';
import { z } from 'zod';
import type { ClientPartition, LeaseOpsClient } from '../client.ts';
import type { OperationView } from '../queues/inspect.ts';
import { LayoutError } from '../queues/layout.ts';
import type { Config } from '../config.ts';
import {
  ActivityNotFoundError,
  ExecError,
  IdempotencyKeyReusedError,
  InvalidRequestError,
  LeaseClosingError,
  LeaseHasSandboxError,
  LeaseOpsError,
  PausesFullError,
  QueueFullError,
  CompanyBytesFullError,
  RedisUnavailableError,
  ClientClosedError,
} from '../errors.ts';
import type { Logger } from '../logger.ts';
import { laneIdOfJobId, type LeaseIdentity } from '../lease.ts';
import { isRedisUnavailable } from '../queues/redis.ts';
import { OperatorActionRefusedError } from '../queues/operator-actions.ts';
import { sweepEveryLane } from '../queues/sweep.ts';
import { canSee, metricsAllowed, type Principal, TokenAuthority } from './auth.ts';
import { openApiDocument } from './openapi.ts';
import {
  ActivityBodySchema,
  ActivityPathSchema,
  AttentionQuerySchema,
  HeartbeatBodySchema,
  EnqueueBodySchema,
  IdempotencyHeaderSchema,
  LeasePathSchema,
  OperationPathSchema,
  preferredWaitMs,
  IfMatchHeaderSchema,
  ExecBodySchema,
  InstanceDeleteQuerySchema,
  InstanceSaveQuerySchema,
  ProbeQuerySchema,
  ProviderListQuerySchema,
  ProviderPathSchema,
  WaitQuerySchema,
} from './schemas.ts';
import { redactQuery } from '../secrets.ts';
import { CredentialsRefusedError } from '../providers/instances/manager.ts';
import { instanceCapabilities } from '../providers/instances/resolver.ts';
import type { InstanceView } from '../providers/instances/schemas.ts';
import { instanceNotFound, ProviderInstanceError } from '../providers/instances/store.ts';

export interface ApiDeps {
  config: Pick<Config, 'LEASE_OPS_API_TOKENS' | 'LEASE_OPS_API_MAX_WAIT_MS' | 'LEASE_OPS_BOARD_READ_ONLY' | 'LEASE_OPS_METRICS_TOKEN'> &
    Partial<Pick<Config, 'LEASE_OPS_SHARED_PROVIDERS' | 'LEASE_OPS_API_MAX_WAITS' | 'LEASE_OPS_API_MAX_WAITS_PER_COMPANY' | 'LEASE_OPS_API_COMPANY_RATES' | 'LEASE_OPS_API_REQUESTS_PER_COMPANY'>>;
  /** The companies' request rates (shared with /metrics); one of its own when not given. */
  rates?: CompanyRateLimiter;
  /** The waits the API holds (shared with /metrics); one of its own when not given. */
  waits?: WaitBudget;
  /** Requests each company has in progress (shared with /metrics); one of its own when not given. */
  turns?: CompanyTurns;
  /** Where refusals at a company's budgets are counted for the log (flushed by the server at close); one of its own when not given. */
  refusals?: RefusalLog;
  client: LeaseOpsClient;
  /** Where tenants' walks (attention, timelines) run: worker threads in `lease-ops api`; this event loop when left out. */
  walks?: Walks;
  log: Logger;
  /** Queues Bull Board shows besides the operations queue (the maintenance queue). */
  /** More queues for Bull Board (the maintenance queues), each with a prefix for its name there. */
  boardQueues?: { queue: Queue; prefix?: string }[];
  /** Whether this deployment counts as ready: Redis answers and workers run. */
  readiness: () => Promise<{ ready: boolean; checks: Record<string, unknown> }>;
  /** The Prometheus exposition. */
  metrics: () => Promise<string>;
  version: string;
}

/** An error the API answers with its own status and stable code. */
export { HttpError };

const BODY_LIMIT = '64kb';

/** The board's pages: its own scripts and styles only, never inside another site's frame. */
export const BOARD_CSP =
  "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'self'; form-action 'self'";

/** Bull Board's page links Google Fonts; lease-ops serves it without (its CSP would refuse them anyway). */
const EXTERNAL_STYLESHEET = /<link href="https:\/\/fonts\.googleapis\.com[^>]*>\s*/g;

/**
 * Headers for every board response (no framing: two clicks in a framed board could rerun a
 * job), and its page rendered without the font links that would tell Google who opened it.
 */
function boardHeaders(_req: Request, res: Response, next: NextFunction): void {
  res.set({ 'x-frame-options': 'DENY', 'content-security-policy': BOARD_CSP, 'x-content-type-options': 'nosniff', 'referrer-policy': 'same-origin' });
  const render = res.render.bind(res);
  res.render = ((view: string, options?: object) =>
    render(view, options ?? {}, (err: Error | null, html?: string) => {
      if (err) return next(err);
      res.type('html').send((html ?? '').replace(EXTERNAL_STYLESHEET, ''));
    })) as Response['render'];
  next();
}

/**
 * Browsers send Basic credentials with cross-site requests too: a page elsewhere could post
 * a form (`text/plain`, form encodings) to a read-write board. A request that changes
 * anything must come from the board's own origin when the browser says where it comes from
 * (Origin, Sec-Fetch-Site), and carry JSON; clients that are not browsers send neither
 * header and are let through to authentication as before.
 */
function sameOriginWrites(req: Request, _res: Response, next: NextFunction): void {
  if (req.method === 'GET' || req.method === 'HEAD' || req.method === 'OPTIONS') return next();
  const site = req.headers['sec-fetch-site'];
  if (site !== undefined && site !== 'same-origin' && site !== 'none') {
    throw new HttpError(403, 'cross_site_request', 'the board takes changes only from its own pages');
  }
  const origin = req.headers.origin;
  // The host only: behind a TLS-terminating proxy the scheme seen here is not the browser's.
  if (origin !== undefined && (!URL.canParse(origin) || new URL(origin).host !== req.headers.host)) {
    throw new HttpError(403, 'cross_site_request', 'the board takes changes only from its own pages');
  }
  const type = req.headers['content-type'];
  if (type !== undefined && !/^application\/json\b/i.test(type)) {
    throw new HttpError(415, 'unsupported_media_type', 'the board takes JSON');
  }
  next();
}

/**
 * An operator who removes a job from Bull Board may remove a lane's head: the lane would
 * then wait for the sweep, or, if the head was backing off, until its retry came due. So
 * once the board says it removed a job of the operations queue, that job's lane (its id
 * names it) gets the sweep's repair at once; after a bulk clean or an empty, every lane.
 * Bull Board's routes (@bull-board/api routes.js): PUT queues/:queue/:jobId/clean removes
 * one job; PUT queues/:queue/clean/:status, .../empty and .../obliterate remove many.
 */
/** A partition's name in Bull Board: the queue's own with one partition, else prefixed with its index. */
export function boardQueueName(partition: ClientPartition, partitions: number): string {
  return `${boardPrefix(partition, partitions)}${partition.ops.queue.name}`;
}

function boardPrefix(partition: ClientPartition, partitions: number): string {
  return partitions === 1 ? '' : `p${partition.index}:`;
}

function partitionOnBoard(client: LeaseOpsClient, name: string): ClientPartition | undefined {
  return client.partitions.find((p) => boardQueueName(p, client.partitions.length) === name);
}

function repairAfterBoardRemovals(client: LeaseOpsClient, log: Logger) {
  // As Bull Board's express router matches them: any case, a trailing slash or not.
  const one = /^\/api\/queues\/([^/]+)\/([^/]+)\/clean\/?$/i;
  const many = /^\/api\/queues\/([^/]+)\/(?:clean\/[^/]+|empty|obliterate)\/?$/i;
  return (req: Request, res: Response, next: NextFunction): void => {
    if (req.method !== 'PUT') return next();
    const path = req.path;
    const single = one.exec(path);
    const bulk = single ? null : many.exec(path);
    const ops = partitionOnBoard(client, decodeURIComponent((single ?? bulk)?.[1] ?? ''))?.ops;
    if (!ops) return next();
    res.on('finish', () => {
      if (res.statusCode >= 400) return;
      const repaired = single ? repairLaneOfJob(ops, decodeURIComponent(single[2]!)) : repairEveryLane(ops, log);
      repaired.catch((err: unknown) => log.warn({ err }, 'repairing lanes after a removal in Bull Board failed; the sweep will'));
    });
    next();
  };
}

/**
 * Bull Board's retry of a failed operation is lease-ops' rerun: with its original time budget
 * from now (BullMQ's own retry would keep a deadline long past and fail it again at once),
 * its attempts counted from zero, and a mark on the lease's timeline. Route as in
 * @bull-board/api routes.js: PUT queues/:queueName/:jobId/retry.
 */
function rerunOnBoardRetry(client: LeaseOpsClient, readOnly: boolean) {
  const retry = /^\/api\/queues\/([^/]+)\/([^/]+)\/retry\/?$/i;
  const retryAll = /^\/api\/queues\/([^/]+)\/retry\/failed\/?$/i;
  return async (req: Request, res: Response, next: NextFunction): Promise<void> => {
    const all = req.method === 'PUT' && !readOnly ? retryAll.exec(req.path) : null;
    const allOf = all ? partitionOnBoard(client, decodeURIComponent(all[1]!))?.ops : undefined;
    if (allOf) {
      // "Retry all failed": each one a rerun (acquires are refused: skipped and counted).
      const by = `${(res.locals.principal as Principal).name} (Bull Board)`;
      let retried = 0;
      let skipped = 0;
      // The ids first (BullMQ's failed set), then each rerun: reruns leave the set as they go.
      for (const id of await allOf.connection.zrange(allOf.queue.toKey('failed'), 0, -1)) {
        const done = await client.rerunOperation(id, by, { override: true }).catch((err: unknown) => (err instanceof OperatorActionRefusedError ? null : Promise.reject(err)));
        if (done) retried++;
        else skipped++;
      }
      res.json({ retried, skipped });
      return;
    }
    const match = req.method === 'PUT' && !readOnly ? retry.exec(req.path) : null;
    const ops = match ? partitionOnBoard(client, decodeURIComponent(match[1]!))?.ops : undefined;
    if (!match || !ops) return next();
    const jobId = decodeURIComponent(match[2]!);
    if ((await ops.queue.getJobState(jobId)) !== 'failed') return next();
    // The board is for admins: a rerun there goes past the queue limits (an admin may).
    await client.rerunOperation(jobId, `${(res.locals.principal as Principal).name} (Bull Board)`, { override: true });
    res.status(204).end();
  };
}

async function repairLaneOfJob(ops: LeaseOpsClient['ops'], jobId: string): Promise<void> {
  const laneId = laneIdOfJobId(jobId);
  if (!laneId) return;
  // A waiting job leaves its lane (and the counts) now; a head is the repair's.
  await ops.lanes.forgetRemoved(laneId, jobId);
  ops.history.append(laneId, { kind: 'removed', jobId, message: 'removed by an operator in Bull Board' });
  await ops.lanes.repair(laneId);
}

/**
 * After a bulk removal: every lane's removed waiting jobs go, then every lane is repaired. The
 * lanes are asked a few at a time: one after another, a new operation on one of 525 cleaned
 * lanes was not handed off within 20 s on a loaded machine; 200 at a time held the API's own
 * connection (Redis runs them back to back) for up to 1.5 s with long lanes, and gave the last
 * of a batch the wait of all before it inside its command timeout (helper-42). A lane that
 * fails stops neither the others nor the repair after them.
 */
async function repairEveryLane(ops: LeaseOpsClient['ops'], log: Logger): Promise<void> {
  const lanes = await ops.lanes.allLanes();
  let failed = 0;
  let first: { laneId: string; err: unknown } | null = null;
  for (let from = 0; from < lanes.length; from += FORGET_AT_ONCE) {
    const batch = lanes.slice(from, from + FORGET_AT_ONCE);
    const results = await Promise.allSettled(batch.map((laneId) => ops.lanes.forgetRemoved(laneId)));
    for (const [i, r] of results.entries()) {
      if (r.status === 'fulfilled') continue;
      failed++;
      first ??= { laneId: batch[i]!, err: r.reason };
    }
  }
  if (first) log.warn({ err: first.err, laneId: first.laneId, failed, lanes: lanes.length }, 'some lanes kept their removed jobs after a removal in Bull Board');
  await sweepEveryLane(ops, log, lanes);
}
const FORGET_AT_ONCE = 20;

/** The class of a request for its company's rate: a change, a walk over many records, or a read. */
function classOf(method: string, path: string, onPages: boolean): RequestClass {
  if (method !== 'GET' && method !== 'HEAD') return 'write';
  // Express matches routes whatever their case: so does the class (`/v1/ATTENTION` is a walk).
  const lower = path.toLowerCase();
  return /\/(attention|timeline|overview)\/?$/.test(lower) || (onPages && /^\/leases\//.test(lower)) ? 'walk' : 'read';
}

const REQUESTS_FULL = {
  code: 'company_requests_full',
  message: 'the company already has its requests in progress and its line of waiting ones full (LEASE_OPS_API_REQUESTS_PER_COMPANY, four times as many may wait): retry',
};

/** 1 s and up to RETRY_SPREAD_S more at random: a company's requests refused together do not come back together. */
const spreadRetryAfterS = () => 1 + Math.floor(Math.random() * (RETRY_SPREAD_S + 1));

/**
 * Query parameters the API and the board read: their values are logged. Any other
 * parameter's value is masked in the request log, whatever its name (a token sent as `?t=`).
 */
const LOGGED_QUERY_PARAMS: ReadonlySet<string> = new Set(['waitMs', 'offset', 'limit', 'probe', 'companyId', 'cursor', 'activeQueue', 'status', 'page', 'jobsPerPage', 'action']);

/** An activity's token in a route's path (its heartbeat, its end): masked in the request log. */
const ACTIVITY_TOKEN_IN_PATH = /(\/activities\/)[^/?;]+/gi;

/** A request on its log line: its id, method and URL, with only the query values it reads, and no activity token. */
const describeRequest = (req: Request) => ({ id: (req as Request & { id?: unknown }).id, method: req.method, url: redactQuery(withoutFragment(req.originalUrl ?? req.url), LOGGED_QUERY_PARAMS).replace(ACTIVITY_TOKEN_IN_PATH, '$1***') });

/** The logger of one request, bound to it as its line in the request log is. */
const lineOf = (log: Logger, req: Request) => requestLogger(log, req, describeRequest);

/** A raw client may send a `#fragment`, which the API never reads: masked whole. */
const withoutFragment = (url: string) => {
  const hash = url.indexOf('#');
  return hash < 0 ? url : `${url.slice(0, hash)}#***`;
};

/** The HTTP API, Bull Board and the operations endpoints, as one express 5 app. */
export function createApiApp(deps: ApiDeps): express.Express {
  const { client, log } = deps;
  const walks = deps.walks ?? walksInProcess(client);
  const auth = new TokenAuthority(deps.config.LEASE_OPS_API_TOKENS);
  const waits = deps.waits ?? new WaitBudget({ perCompany: deps.config.LEASE_OPS_API_MAX_WAITS_PER_COMPANY ?? 100, total: deps.config.LEASE_OPS_API_MAX_WAITS ?? 500 });
  const rates = deps.rates ?? new CompanyRateLimiter({ ...DEFAULT_COMPANY_RATES, ...deps.config.LEASE_OPS_API_COMPANY_RATES });
  /**
   * A scoped token's request takes a token of its company's rate for its class (admins are
   * not limited): a walk over many records (attention, a timeline), a change, or a read.
   */
  const rated = (req: Request, res: Response, next: NextFunction): void => {
    const principal = res.locals.principal as Principal | undefined;
    if (res.locals.admitted === true || !principal || principal.admin || principal.companyId === undefined) return next();
    res.locals.rateGiveBack = rates.take(principal.companyId, classOf(req.method, req.path, req.baseUrl.toLowerCase() === '/ui'), req.method !== 'GET' && req.method !== 'HEAD' ? costOfBody(req.headers) : 1);
    next();
  };
  const turns = deps.turns ?? new CompanyTurns(deps.config.LEASE_OPS_API_REQUESTS_PER_COMPANY ?? 4);
  /**
   * A scoped token's request waits for a turn of its company (CompanyTurns) before anything
   * of it is read or done; the turn goes back when the answer is sent, the caller hangs up, or
   * the request starts to wait for an operation (givesTurnBack).
   */
  const turned = (req: Request, res: Response, next: NextFunction): void => {
    const principal = res.locals.principal as Principal | undefined;
    if (res.locals.admitted === true || !principal || principal.admin || principal.companyId === undefined) return next();
    if (!takeTurn(req, res, principal.companyId, next)) {
      // Refused before anything was done: the rate's tokens are not spent (a full line is not a request worked on).
      (res.locals.rateGiveBack as (() => void) | undefined)?.();
      throw new HttpError(429, REQUESTS_FULL.code, REQUESTS_FULL.message, { retryAfterS: spreadRetryAfterS() });
    }
  };
  /**
   * Takes a turn of `companyId` for this request: `go` runs once it has one (never inside this
   * call). False when the company's line is full. The turn goes back when the answer is
   * complete, the request starts to wait for an operation, or the caller hangs up.
   */
  const takeTurn = (req: Request, res: Response, companyId: string, go: () => void): boolean => {
    const turn = turns.take(companyId, () => (req.socket.destroyed ? turn?.done() : go()));
    if (!turn) return false;
    const { done } = turn;
    // The socket's close too: a pipelined request whose answer waits behind another's never
    // gets its response's close when the caller hangs up (helper-16: a company lost its turns).
    const socket = req.socket;
    const onSocketClose = () => finish();
    const finish = () => {
      socket.removeListener('close', onSocketClose);
      done();
    };
    // A pipelined socket may hold a few such listeners at once (its requests with a turn or in
    // line: 20 at most for one company), each removed at its request's end.
    socket.setMaxListeners(Math.max(socket.getMaxListeners(), 32));
    socket.once('close', onSocketClose);
    res.locals.turnDone = finish;
    // The turn is given back when the answer is complete, not when it has been written: an
    // answer pipelined behind a long poll's is written only after it (helper-17: four cheap
    // reads behind one long poll held their company's turns for the whole wait).
    const end = res.end.bind(res) as (...args: unknown[]) => Response;
    res.end = ((...args: unknown[]) => {
      finish();
      return end(...args);
    }) as typeof res.end;
    res.once('close', finish);
    return true;
  };
  /**
   * A scoped token's /v1 request is rated and waits for its company's turn before the router
   * sees it, and a refusal there is written at once, without the router, an error object or
   * the error handler (issue 27: a burst of 200 refused polls cost the API about a quarter
   * more CPU through them). The /v1 router's own rate and turn stay for any request this did
   * not admit.
   */
  const admitFirst = (req: Request, res: Response, next: NextFunction): void => {
    // The path Express routes on (no query, no fragment, an absolute-form target's path):
    // a class read off another would let `/v1/attention#x` pass as a read (helper-53).
    const path = req.path.toLowerCase();
    // The /v1 router's requests only: not its OPTIONS (refused before its authentication) nor the document (served before it).
    if ((path !== '/v1' && !path.startsWith('/v1/')) || req.method === 'OPTIONS' || /^\/v1\/openapi\.json\/?$/.test(path)) return next();
    // The same check as the /v1 router's (which makes it again): Bearer only.
    const principal = auth.authenticate(req.headers.authorization, { basic: false });
    if (!principal || principal.admin || principal.companyId === undefined) return next();
    const companyId = principal.companyId;
    let giveBack: () => void;
    try {
      giveBack = rates.take(companyId, classOf(req.method, path.slice(3), false), req.method !== 'GET' && req.method !== 'HEAD' ? costOfBody(req.headers) : 1);
    } catch (err) {
      if (!(err instanceof HttpError)) throw err;
      return refuseAtOnce(res, principal, err.code, err.message, err.opts.retryAfterS ?? 1);
    }
    if (!takeTurn(req, res, companyId, next)) {
      giveBack();
      return refuseAtOnce(res, principal, REQUESTS_FULL.code, REQUESTS_FULL.message, spreadRetryAfterS());
    }
    // Before its turn comes (takeTurn runs `next` later, never inside the call).
    res.locals.admitted = true;
    res.locals.rateGiveBack = giveBack;
  };
  /**
   * A company's request refused at its budget, answered as the error handler would, without
   * it. The request log (before this) counts it as it counts the handler's refusals.
   */
  const refuseAtOnce = (res: Response, principal: Principal, code: string, message: string, retryAfterS: number): void => {
    res.locals.principal = principal;
    res.locals.errorCode = code;
    const body = JSON.stringify({ error: { code, message } });
    res.writeHead(429, {
      'content-type': 'application/json; charset=utf-8',
      'content-length': Buffer.byteLength(body),
      'retry-after': String(retryAfterS),
      ...(client.isClosed ? { connection: 'close' } : {}),
    });
    res.end(body);
  };
  /** A request about to wait for an operation gives its company's turn back meanwhile. */
  const givesTurnBack = (res: Response) => (res.locals.turnDone as (() => void) | undefined)?.();
  /** Whose budget a request's wait counts against: its company, or the admin token's own. */
  const waiter = (principal: Principal) => principal.companyId ?? `admin:${principal.name}`;
  const refusals = deps.refusals ?? new RefusalLog(log);
  const app = express();
  app.disable('x-powered-by');
  app.set('query parser', 'simple');
  app.use(
    requestLog(log, {
      // Probes and scrapes are frequent and tell nothing; keep them out of the log.
      ignore: (req) => ['/healthz', '/readyz', '/metrics'].includes(req.url),
      describe: describeRequest,
      // Whose request it was, on its line (a company's token).
      props: (res) => {
        const companyId = (res.locals?.principal as Principal | undefined)?.companyId;
        return companyId === undefined ? {} : { companyId };
      },
      level: (res, err) => {
        // A 5xx the API chose to give (closing, Redis away, a walk it dropped): a warning.
        if (!err && res.statusCode >= 500 && res.locals?.chosenAnswer === true) return 'warn';
        if (err || res.statusCode >= 500) return 'error';
        if (res.statusCode === 429) {
          // A company past its budget: counted, one line per interval (RefusalLog).
          const code = res.locals?.errorCode as string | undefined;
          const companyId = (res.locals?.principal as Principal | undefined)?.companyId;
          if (code?.startsWith('company_') && companyId !== undefined) {
            refusals.note(companyId, code);
            return 'silent';
          }
        }
        return res.statusCode >= 400 ? 'warn' : 'info';
      },
      // An answer the API chose is its code, not an Error made up for it (and its stack).
      errorFields: (res, fields) => {
        if (res.locals?.chosenAnswer !== true) return fields;
        const { err: _madeUp, ...rest } = fields;
        return { ...rest, code: res.locals.errorCode };
      },
      errorMessage: (res) => (res.locals?.chosenAnswer === true ? `answered ${res.statusCode}` : 'request errored'),
    }),
  );
  // After the request log: a request's line counts its time in its company's line, and one
  // whose caller hung up there is logged as aborted (helper-53).
  app.use(admitFirst);

  // Operations endpoints: no authentication, so probes and Prometheus can reach them.
  // The front door: the operator's pages (they ask for the token as a password).
  app.get('/', (_req, res) => {
    res.redirect(302, '/ui/attention');
  });
  app.get('/healthz', (_req, res) => {
    res.json({ status: 'ok' });
  });
  app.get('/readyz', async (_req, res) => {
    const report = await deps.readiness();
    res.status(report.ready ? 200 : 503).json({ status: report.ready ? 'ready' : 'not_ready', ...report.checks });
  });
  app.get('/metrics', async (req, res) => {
    if (!metricsAllowed(req.headers.authorization, deps.config.LEASE_OPS_METRICS_TOKEN)) {
      res.status(401).set('www-authenticate', 'Bearer').json({ error: { code: 'unauthorized', message: 'send LEASE_OPS_METRICS_TOKEN as a Bearer token' } });
      return;
    }
    res.type('text/plain; version=0.0.4').send(await deps.metrics());
  });
  // Serialised once (121 KB): a client pipelining requests for it and reading nothing made the
  // API serialise and hold a copy per request (helper-18: 1.7 GB from 500 KB sent).
  const document = Buffer.from(JSON.stringify(openApiDocument(deps.version)));
  const documentTag = `"${createHash('sha1').update(document).digest('base64url')}"`;
  app.get('/v1/openapi.json', (_req, res) => {
    res.type('application/json').set('ETag', documentTag).send(document);
  });

  const authenticate =
    (challenge: 'Bearer' | 'Basic') =>
    (req: Request, res: Response, next: NextFunction): void => {
      // /v1 takes Bearer only: a browser's ambient Basic credentials (an operator signed in at
      // /board) cannot drive it from another site's form.
      const principal = auth.authenticate(req.headers.authorization, { basic: challenge === 'Basic' });
      if (!principal) {
        res.setHeader('WWW-Authenticate', `${challenge} realm="lease-ops"`);
        throw new HttpError(401, 'unauthorized', challenge === 'Bearer' ? 'a valid bearer token is required (Authorization: Bearer <token>)' : 'a valid token is required (as the password)');
      }
      res.locals.principal = principal;
      next();
    };
  const adminOnly = (_req: Request, res: Response, next: NextFunction): void => {
    if (!(res.locals.principal as Principal).admin) throw new HttpError(403, 'forbidden', 'this needs an admin token');
    next();
  };

  // Bull Board: admins only; read-only unless LEASE_OPS_BOARD_READ_ONLY=false.
  const board = new ExpressAdapter();
  board.setBasePath('/board');
  // Its own express app says X-Powered-By: Express on every board response otherwise.
  (board as unknown as { app: express.Express }).app.disable('x-powered-by');
  createBullBoard({
    queues: [
      ...client.partitions.map(
        (p) =>
          new LeaseOpsBoardAdapter(p.ops, {
            readOnlyMode: deps.config.LEASE_OPS_BOARD_READ_ONLY,
            ...(client.partitions.length > 1 ? { prefix: boardPrefix(p, client.partitions.length), displayName: `${p.ops.queue.name} · partition ${p.index}` } : {}),
          }),
      ),
      ...(deps.boardQueues ?? []).map(({ queue, prefix }) => new BullMQAdapter(queue, { readOnlyMode: deps.config.LEASE_OPS_BOARD_READ_ONLY, ...(prefix ? { prefix } : {}) })),
    ],
    serverAdapter: board,
    options: { uiConfig: { boardTitle: 'lease-ops' } },
  });
  app.use(
    '/board',
    boardHeaders,
    sameOriginWrites,
    authenticate('Basic'),
    adminOnly,
    // With another partition count than the deployment's, the board would show other queues.
    (_req: Request, _res: Response, next: NextFunction) => void client.layoutChecked().then(() => next(), next),
    repairAfterBoardRemovals(client, deps.log),
    rerunOnBoardRetry(client, deps.config.LEASE_OPS_BOARD_READ_ONLY),
    board.getRouter() as express.Router,
  );

  const v1 = express.Router();
  // No CORS here: OPTIONS is a method like any other the API does not serve (express would
  // answer it with an Allow list).
  v1.use((req, _res, next) => {
    if (req.method === 'OPTIONS') throw new HttpError(404, 'not_found', `no route ${req.method} ${req.path}`);
    next();
  });
  v1.use(authenticate('Bearer'));
  v1.use(rated);
  v1.use(turned);
  // The API listens whether or not Redis answers; while it does not, /v1 says so at once.
  v1.use((_req, res, next) => {
    if (client.redisReady) return next();
    // Closing, the API's connection is down by its own hand: 503 client_closed, not Redis away.
    if (client.isClosed) throw new ClientClosedError();
    res.setHeader('Retry-After', '1');
    throw new HttpError(503, 'redis_unavailable', 'Redis cannot be reached; retry later');
  });
  // Only the route that takes a body reads one: a body sent with a GET is ignored, so GETs
  // answer exactly the statuses the OpenAPI document lists for them.
  const jsonBody = express.json({ limit: BODY_LIMIT, strict: true });

  // The path and the token's scope are checked before the body is read: a lease out of
  // scope answers 404 whatever the body holds.
  const leaseInScope = (req: Request, res: Response, next: NextFunction): void => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!canSee(res.locals.principal as Principal, lease)) throw leaseNotFound();
    next();
  };

  // The providers a token may use: the workers' configured ones (shared, or admin-only as
  // LEASE_OPS_SHARED_PROVIDERS says), and its company's instances saved at run time.
  const sharedProviders = (deps.config.LEASE_OPS_SHARED_PROVIDERS ?? '*').split(',').map((s) => s.trim()).filter(Boolean);
  const mayUseConfigured = (principal: Principal, name: string) => principal.admin || sharedProviders.includes('*') || sharedProviders.includes(name);
  /**
   * Decides the provider a principal's operation on a lease runs with, and refuses (422
   * unknown_provider) one it cannot have: true for the lease's company's instance of that name
   * (the operation is accepted for it: OperationJobData's `instance`), false for a configured
   * provider. The company's instance for the lease's environment comes first, where a
   * configured provider bears its name too (one saved before the operator configured that
   * name); an admin-only configured provider does not exist for a scoped token. Decided here,
   * once, and kept with the operation: no later deletion, narrowing or configuration hands it
   * to another provider (helper-58, helper-59, helper-60).
   * A name no worker ever served is a typo, not a rollout: refused now, not failed later.
   * Until some worker said what it serves (none started yet, or Redis lost its data) there is
   * nothing to tell a typo by, and the name is taken, except from a scoped token a name it may
   * not use as a configured provider: that one is its company's instance or nothing (helper-57:
   * with the announcements gone, a tenant's enqueue of an admin-only provider was taken, and a
   * worker ran it with the operator's key). A request repeated under its idempotency key gets
   * its receipt whatever the workers say.
   */
  const providerUsable = async (lease: LeaseIdentity, principal: Principal, idempotencyKey?: string): Promise<boolean> => {
    const ops = client.partitionOf(lease).ops;
    const announced = await ops.announcedProviders(lease.provider);
    const providers = announced.filter((name) => mayUseConfigured(principal, name));
    const configuredUsable = providers.includes(lease.provider);
    // The library's own rule, by the same read (helper-64: an unreadable record was "none" here and
    // "held" there; it is held, and its operations fail provider_credentials_unreadable).
    if (await client.holdsInstance(lease)) return true;
    if (configuredUsable) return false;
    // An admin-only name is its company's instance or nothing, a repeated request's too.
    const adminOnly = announced.includes(lease.provider) && !mayUseConfigured(principal, lease.provider);
    if (!adminOnly && idempotencyKey !== undefined && (await ops.idempotencyKeyUsed(lease, idempotencyKey))) return false;
    if (announced.length > 0 || !mayUseConfigured(principal, lease.provider)) {
      const served = providers.length > 0 ? ` (served: ${providers.sort().join(', ')})` : '';
      throw new HttpError(422, 'unknown_provider', `no worker serves provider "${lease.provider}", and company ${lease.companyId} has no provider instance of that name for environment ${lease.environmentId}${served}`);
    }
    return false;
  };
  /** Whether a principal sees an instance: its company's, and (an environment-scoped token) only one bound to its environments. */
  const seesInstance = (principal: Principal, instance: Pick<InstanceView, 'companyId' | 'environmentIds'>) =>
    principal.admin ||
    (instance.companyId === principal.companyId && (!principal.environmentIds || (instance.environmentIds !== null && instance.environmentIds.every((e) => principal.environmentIds!.includes(e)))));
  /** The company an instance route acts for: a scoped token's own (naming another reads as missing), an admin's ?companyId. */
  const companyFor = (principal: Principal, requested: string | undefined, name: string): string => {
    if (principal.admin) {
      if (requested === undefined) throw new HttpError(400, 'invalid_request', 'an admin token names the company: ?companyId=');
      return requested;
    }
    if (requested !== undefined && requested !== principal.companyId) throw instanceNotFound(name);
    return principal.companyId!;
  };
  const withCapabilities = (view: InstanceView) => ({ ...view, capabilities: instanceCapabilities(view.type) });

  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/operations', leaseInScope, jsonBody, async (req, res) => {
    const type = req.is('application/json');
    // req.is says null when there is no body at all.
    if (type === null || req.headers['content-length'] === '0') throw new HttpError(400, 'invalid_request', 'the request has no body: send the operation as JSON');
    if (!type) throw new HttpError(415, 'unsupported_media_type', 'send the operation as application/json');
    const lease = parse(LeasePathSchema, req.params, 'path');
    const body = parse(EnqueueBodySchema, req.body, 'body');
    const header = parse(IdempotencyHeaderSchema, { 'idempotency-key': req.get('idempotency-key') }, 'Idempotency-Key header');
    const idempotencyKey = body.idempotencyKey ?? header['idempotency-key'];
    const principal = res.locals.principal as Principal;
    const companyInstance = await providerUsable(lease, principal, idempotencyKey);
    const enqueued = await client.enqueue(body.op, lease, body.params, {
      // Decided here, once: the client does not decide again (helper-62).
      companyInstance,
      ...(body.deadlineMs === undefined ? {} : { deadlineMs: body.deadlineMs }),
      // Keys are scoped to the lease's company and environment (the queue does it), which
      // a caller can only name if its token sees them.
      ...(idempotencyKey === undefined ? {} : { idempotencyKey }),
    });
    const location = `/v1/operations/${encodeURIComponent(enqueued.jobId)}`;
    // Prefer: wait=<s> (RFC 7240): answer with the ended operation if it ends in time.
    const preferred = preferredWaitMs(req.get('prefer'));
    // A preference: with the company's (or the server's) waits all held, it is not applied
    // and the answer is the 202 at once (the operation is accepted either way).
    const slot = preferred > 0 && !hungUp(req) ? waits.take(waiter(principal)) : null;
    if (slot && 'release' in slot) {
      givesTurnBack(res);
      // A caller that hangs up gives its wait back at once, not when the wait would have ended.
      res.on('close', slot.release);
      const wait = Math.min(preferred, deps.config.LEASE_OPS_API_MAX_WAIT_MS);
      res.set('Preference-Applied', `wait=${Math.floor(wait / 1_000)}`);
      // Accepted already: a wait that fails (the API closing at its cut, Redis away) is answered
      // with the 202 receipt, never an error that would have a caller enqueue it again (helper-38).
      // Just accepted: waited for without reading its view first (one that ended meanwhile is found at once).
      const view = await client
        .waitForEndOf(enqueued.jobId, waits.spread(wait))
        .catch((err: unknown) => {
          lineOf(log, req).warn({ jobId: enqueued.jobId, err: err instanceof Error ? err.message : String(err) }, 'the wait of an accepted enqueue failed: answered with its receipt');
          return null;
        })
        .finally(slot.release);
      if (view && (view.state === 'completed' || view.state === 'failed')) {
        res.status(200).location(location).json({ ...view, ...(enqueued.deduplicated ? { deduplicated: enqueued.deduplicated } : {}), location });
        return;
      }
    }
    res.status(202).location(location).json({ ...enqueued, location });
  });

  // Activity gates: work inside a lease's sandbox that its stops wait for.
  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/activities', leaseInScope, jsonBody, async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    const body = parse(ActivityBodySchema, req.body, 'body');
    res.status(201).json(await client.beginActivity(lease, body.kind, body.ttlMs));
  });
  // A command in the lease's sandbox, bracketed by an activity (README, Activity gates): the
  // answer is how it ended. Refused (409 lease_closing) while a stop, release or destroy of the
  // lease is queued or runs.
  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/exec', leaseInScope, jsonBody, async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!req.is('application/json')) throw new HttpError(415, 'unsupported_media_type', 'send the command as application/json');
    const body = parse(ExecBodySchema, req.body, 'body');
    // As an enqueue is (helper-58: a tenant ran commands through an admin-only provider, and a
    // name nobody serves went round the workers for 3 s).
    const companyInstance = await providerUsable(lease, res.locals.principal as Principal);
    // A caller that hangs up cancels the command (its activity ends; the worker sees it go).
    const gone = new AbortController();
    res.on('close', () => res.writableFinished || gone.abort());
    const release = waits.takeOrRefuse(waiter(res.locals.principal as Principal));
    givesTurnBack(res);
    res.on('close', release);
    res.json(await client.exec(lease, body, { signal: gone.signal, companyInstance }).finally(release));
  });
  const activityInScope = async (token: string, principal: Principal) => {
    const lease = await client.activityLease(token);
    // Another company's activity is answered as one that does not exist.
    if (!lease || !canSee(principal, lease)) throw new ActivityNotFoundError();
  };
  v1.post('/activities/:token/heartbeat', jsonBody, async (req, res) => {
    const { token } = parse(ActivityPathSchema, req.params, 'path');
    const body = parse(HeartbeatBodySchema, req.body, 'body');
    await activityInScope(token, res.locals.principal as Principal);
    res.json(await client.heartbeatActivity(token, body.ttlMs));
  });
  v1.delete('/activities/:token', async (req, res) => {
    const { token } = parse(ActivityPathSchema, req.params, 'path');
    await activityInScope(token, res.locals.principal as Principal);
    if (!(await client.endActivity(token))) throw new ActivityNotFoundError();
    res.status(204).end();
  });

  v1.get('/leases/:provider/:companyId/:environmentId/:leaseId', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!canSee(res.locals.principal as Principal, lease)) throw leaseNotFound();
    res.json(await client.getLease(lease));
  });

  v1.get('/leases/:provider/:companyId/:environmentId/:leaseId/timeline', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!canSee(res.locals.principal as Principal, lease)) throw leaseNotFound();
    res.json(await walks.timeline(lease, res.locals.principal as Principal, goneSignal(res)));
  });

  // Operator actions: any token, on its own leases; each is recorded on the lease's timeline.
  const actor = (principal: Principal) => `${principal.name} (API)`;
  const operationInScope = async (jobId: string, principal: Principal) => {
    const view = await client.getOperation(jobId);
    if (!view || !canSee(principal, view.lease)) throw operationNotFound(jobId);
    return view.lease;
  };
  v1.post('/operations/:jobId/cancel', async (req, res) => {
    const { jobId } = parse(OperationPathSchema, req.params, 'path');
    const principal = res.locals.principal as Principal;
    await operationInScope(jobId, principal);
    const done = await client.cancelOperation(jobId, actor(principal));
    if (!done) throw operationNotFound(jobId);
    res.json(done);
  });
  v1.post('/operations/:jobId/rerun', async (req, res) => {
    const { jobId } = parse(OperationPathSchema, req.params, 'path');
    const principal = res.locals.principal as Principal;
    const lease = await operationInScope(jobId, principal);
    // A rerun keeps the provider it was accepted for; it is checked as an enqueue is all the
    // same (helper-59): a company cannot run again what it could not enqueue now.
    if (lease) await providerUsable(lease, principal);
    const done = await client.rerunOperation(jobId, actor(principal), { override: principal.admin });
    if (!done) throw operationNotFound(jobId);
    const location = `/v1/operations/${encodeURIComponent(jobId)}`;
    res.status(202).location(location).json({ ...done, location });
  });
  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/pause', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    const principal = res.locals.principal as Principal;
    if (!canSee(principal, lease)) throw leaseNotFound();
    // An admin goes past the company's limit of paused lanes, and is told (overLimit).
    res.json(await client.pauseLane(lease, actor(principal), { override: principal.admin }));
  });
  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/acknowledge', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    const principal = res.locals.principal as Principal;
    if (!canSee(principal, lease)) throw leaseNotFound();
    res.json(await client.acknowledgeFailures(lease, actor(principal)));
  });
  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/unpause', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    const principal = res.locals.principal as Principal;
    if (!canSee(principal, lease)) throw leaseNotFound();
    res.json(await client.unpauseLane(lease, actor(principal)));
  });

  v1.get('/operations/:jobId', async (req, res) => {
    const { jobId } = parse(OperationPathSchema, req.params, 'path');
    const { waitMs } = parse(WaitQuerySchema, req.query, 'query');
    const principal = res.locals.principal as Principal;
    const wait = Math.min(waitMs ?? 0, deps.config.LEASE_OPS_API_MAX_WAIT_MS);
    /** Waits (in the company's budget, its turn given back meanwhile) and answers with the operation as it is then. */
    const waitAndAnswer = async (waitFor: (ms: number) => Promise<OperationView | null>): Promise<void> => {
      // One that hung up while its operation was read has no one to wait for (and its close
      // came before a listener could give the wait back).
      if (hungUp(req)) return;
      const release = waits.takeOrRefuse(waiter(principal));
      givesTurnBack(res);
      res.on('close', release);
      const view = await waitFor(waits.spread(wait)).finally(release);
      if (!view) throw operationNotFound(jobId);
      res.json(view);
    };
    let peeked = false;
    if (wait > 0) {
      // A wait reads two fields of its job first (its lease, whether it ended), not its whole
      // view: its scope is checked before it waits, so an out-of-scope id cannot be timed, and
      // a company past its waits, asking again and again, costs the API and Redis little
      // (issue 27: 100 such a second read 100 views). No such job and another company's answer
      // alike, after that one read (helper-54: a missing id took a view's read more).
      const peek = await client.peekOperation(jobId);
      if (!peek || !canSee(principal, peek.lease)) throw operationNotFound(jobId);
      if (peek.lease && !peek.finished) return waitAndAnswer((ms) => client.waitForEndOf(jobId, ms));
      peeked = peek.lease !== null;
    }
    const view = await client.getOperation(jobId);
    if (!view || !canSee(principal, view.lease)) throw operationNotFound(jobId);
    // An admin's wait on a job whose data names no lease (the peek could not tell): waited for from its view.
    if (wait > 0 && !peeked && view.state !== 'completed' && view.state !== 'failed') return waitAndAnswer((ms) => client.waitForEnd(view, ms));
    res.json(view);
  });

  v1.get('/providers', async (req, res) => {
    // `/providers/` is the one-provider route with no name (Express matches it here).
    if (req.path.endsWith('/')) parse(ProviderPathSchema, { name: '' }, 'path');
    const principal = res.locals.principal as Principal;
    const query = parse(ProviderListQuerySchema, req.query, 'query');
    const companyId = principal.admin ? query.companyId : principal.companyId;
    if (!principal.admin && query.companyId !== undefined && query.companyId !== principal.companyId) throw new HttpError(403, 'forbidden', 'this token lists only its own company');
    const page = await client.instances.list({ ...(companyId === undefined ? {} : { companyId }), ...(query.cursor ? { after: query.cursor } : {}), limit: query.limit ?? 100 });
    res.json({
      providers: query.cursor ? [] : (await client.providers()).filter((p) => mayUseConfigured(principal, p.name)),
      instances: page.instances.filter((i) => seesInstance(principal, i)).map(withCapabilities),
      nextCursor: page.nextCursor,
    });
  });
  v1.post('/providers', jsonBody, async (req, res) => {
    const principal = res.locals.principal as Principal;
    const { probe } = parse(InstanceSaveQuerySchema, req.query, 'query');
    if (!req.is('application/json')) throw new HttpError(415, 'unsupported_media_type', 'send the instance as application/json');
    const body = (typeof req.body === 'object' && req.body !== null ? req.body : {}) as Record<string, unknown>;
    if (!principal.admin) {
      if (body.companyId !== undefined && body.companyId !== principal.companyId) throw new HttpError(403, 'forbidden', `this token manages only company ${principal.companyId}'s providers`);
      const envs = body.environmentIds;
      if (principal.environmentIds && !(Array.isArray(envs) && envs.length > 0 && envs.every((e) => principal.environmentIds!.includes(e as string)))) {
        throw new HttpError(403, 'forbidden', `this token is scoped to environments ${principal.environmentIds.join(', ')}: an instance it saves names environmentIds among them`);
      }
    }
    const saved = await client.instances.create({ ...body, companyId: principal.admin ? body.companyId : principal.companyId }, { by: principal.name, probe: probe !== 'false' });
    res.status(201).location(`/v1/providers/${encodeURIComponent(saved.instance.name)}`).json({ ...withCapabilities(saved.instance), ...(saved.probe ? { probe: saved.probe } : {}) });
  });
  v1.get('/providers/:name', async (req, res) => {
    const principal = res.locals.principal as Principal;
    const { name } = parse(ProviderPathSchema, req.params, 'path');
    const { probe, companyId: requested } = parse(ProbeQuerySchema, req.query, 'query');
    const configured = (await client.providers()).find((p) => p.name === name);
    // A company's own instance of the name comes first for its token, as its operations' does
    // (helper-62: its probe asked the operator's provider, with the operator's key).
    const own = configured && !principal.admin && principal.companyId ? await client.instances.get(principal.companyId, name) : null;
    if (configured && mayUseConfigured(principal, name) && (requested === undefined || !principal.admin) && !(own && seesInstance(principal, own))) {
      res.json(probe === 'true' ? { ...configured, probe: await client.probeProvider(name) } : configured);
      return;
    }
    if (principal.admin && requested === undefined) throw instanceNotFound(name);
    const companyId = companyFor(principal, requested, name);
    const instance = await client.instances.get(companyId, name);
    if (!instance || !seesInstance(principal, instance)) throw instanceNotFound(name);
    // Probed as a lease of one of its environments would use it.
    res.json(probe === 'true' ? { ...withCapabilities(instance), probe: await client.instances.probe(companyId, name, instance.environmentIds?.[0], instance.rev) } : withCapabilities(instance));
  });
  v1.patch('/providers/:name', jsonBody, async (req, res) => {
    const principal = res.locals.principal as Principal;
    const { name } = parse(ProviderPathSchema, req.params, 'path');
    const { probe, companyId: requested } = parse(InstanceSaveQuerySchema, req.query, 'query');
    const { 'if-match': expectedRev } = parse(IfMatchHeaderSchema, { 'if-match': req.get('if-match') }, 'If-Match header');
    if (!req.is('application/json')) throw new HttpError(415, 'unsupported_media_type', 'send the changes as application/json');
    const companyId = companyFor(principal, requested, name);
    const current = await client.instances.get(companyId, name);
    if (!current || !seesInstance(principal, current)) throw instanceNotFound(name);
    const body = req.body as Record<string, unknown>;
    if (principal.environmentIds && body && 'environmentIds' in body) {
      const envs = body.environmentIds;
      if (!(Array.isArray(envs) && envs.length > 0 && envs.every((e) => principal.environmentIds!.includes(e as string)))) {
        throw new HttpError(403, 'forbidden', `this token is scoped to environments ${principal.environmentIds.join(', ')}: an instance it saves names environmentIds among them`);
      }
    }
    const saved = await client.instances.update(companyId, name, body, { by: principal.name, probe: probe !== 'false', ...(expectedRev === undefined ? {} : { expectedRev }) });
    res.json({ ...withCapabilities(saved.instance), ...(saved.probe ? { probe: saved.probe } : {}) });
  });
  v1.delete('/providers/:name', async (req, res) => {
    const principal = res.locals.principal as Principal;
    const { name } = parse(ProviderPathSchema, req.params, 'path');
    const { companyId: requested } = parse(InstanceDeleteQuerySchema, req.query, 'query');
    const { 'if-match': expectedRev } = parse(IfMatchHeaderSchema, { 'if-match': req.get('if-match') }, 'If-Match header');
    const companyId = companyFor(principal, requested, name);
    const current = await client.instances.get(companyId, name);
    if (!current || !seesInstance(principal, current)) throw instanceNotFound(name);
    await client.instances.remove(companyId, name, expectedRev);
    res.status(204).end();
  });

  v1.get('/attention', async (req, res) => {
    const principal = res.locals.principal as Principal;
    const { offset, limit } = parse(AttentionQuerySchema, req.query, 'query');
    // Read with the scope, not filtered after: another company's items never crowd a caller's out.
    res.json(await walks.attentionPage(offset ?? 0, limit ?? 200, principal, goneSignal(res)));
  });

  v1.get('/overview', adminOnly, async (_req, res) => {
    // It reads every company's first attention items: in a walk thread, as their lists are.
    res.json(await walks.overview(res.locals.principal as Principal, goneSignal(res)));
  });

  app.use('/v1', v1);

  // The operator's pages: the same tokens as /v1, sent by a browser as Basic auth (any user
  // name, the token as password); a scoped token sees only its own leases.
  const ui = express.Router();
  ui.use(authenticate('Basic'));
  ui.use(rated);
  ui.use(turned);
  ui.use((_req, res, next) => {
    // same-origin, not no-referrer: with no-referrer a browser's form post says `Origin: null`.
    res.set({ 'content-security-policy': PAGE_CSP, 'x-content-type-options': 'nosniff', 'cache-control': 'no-store', 'referrer-policy': 'same-origin' });
    if (client.redisReady) return next();
    if (client.isClosed) throw new ClientClosedError();
    res.setHeader('Retry-After', '1');
    throw new HttpError(503, 'redis_unavailable', 'Redis cannot be reached; retry later');
  });
  ui.get('/', (_req, res) => {
    res.redirect(302, '/ui/attention');
  });
  ui.get('/attention', async (req, res) => {
    const principal = res.locals.principal as Principal;
    const { offset, limit } = parse(AttentionQuerySchema, req.query, 'query');
    const page = await walks.attentionPage(offset ?? 0, limit ?? 200, principal, goneSignal(res));
    res.type('html').send(attentionPage(page.items, page.next, Date.now(), offset ?? 0));
  });
  ui.get('/leases/:provider/:companyId/:environmentId/:leaseId', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!canSee(res.locals.principal as Principal, lease)) throw leaseNotFound();
    res.type('html').send(timelinePage(await walks.timeline(lease, res.locals.principal as Principal, goneSignal(res))));
  });
  // The pages' buttons. A browser sends Basic credentials with any request to this origin,
  // a cross-site form's too: a change is taken only with an Origin header naming this host
  // (browsers send it with every form post), never without one.
  const samePageOrigin = (req: Request, _res: Response, next: NextFunction): void => {
    const origin = req.headers.origin;
    const site = req.headers['sec-fetch-site'];
    if (origin === undefined || !URL.canParse(origin) || new URL(origin).host !== req.headers.host || (site !== undefined && site !== 'same-origin')) {
      throw new HttpError(403, 'cross_site_request', 'these pages take changes only from their own forms; use /v1 from programs');
    }
    next();
  };
  const acted = (res: Response, back: string) => res.redirect(303, back);
  const refused = (res: Response, err: unknown, back: string) => {
    if (!(err instanceof OperatorActionRefusedError)) throw err;
    res.status(409).type('html').send(actionPage('Refused', `${err.code}: ${err.message}`, back));
  };
  ui.post('/leases/:provider/:companyId/:environmentId/:leaseId/:action', samePageOrigin, async (req, res) => {
    const { action, ...path } = req.params as Record<string, string>;
    const lease = parse(LeasePathSchema, path, 'path');
    const principal = res.locals.principal as Principal;
    if (!canSee(principal, lease)) throw leaseNotFound();
    const by = `${principal.name} (page)`;
    if (action === 'pause') await client.pauseLane(lease, by, { override: principal.admin });
    else if (action === 'unpause') await client.unpauseLane(lease, by);
    else if (action === 'acknowledge') await client.acknowledgeFailures(lease, by);
    else throw new HttpError(404, 'not_found', `no action ${action}`);
    acted(res, timelinePath(lease));
  });
  ui.post('/operations/:jobId/:action', samePageOrigin, async (req, res) => {
    const { jobId } = parse(OperationPathSchema, { jobId: req.params.jobId }, 'path');
    const action = req.params.action;
    const principal = res.locals.principal as Principal;
    const view = await client.getOperation(jobId);
    if (!view?.lease || !canSee(principal, view.lease)) throw operationNotFound(jobId);
    if (action !== 'cancel' && action !== 'rerun') throw new HttpError(404, 'not_found', `no action ${action}`);
    const back = timelinePath(view.lease);
    try {
      await (action === 'cancel' ? client.cancelOperation(jobId, `${principal.name} (page)`) : client.rerunOperation(jobId, `${principal.name} (page)`, { override: principal.admin }));
      acted(res, back);
    } catch (err) {
      refused(res, err, back);
    }
  });
  app.use('/ui', ui);
  app.use((req, _res) => {
    throw new HttpError(404, 'not_found', `no route ${req.method} ${req.path}`);
  });
  app.use(errorHandler(log, () => client.isClosed));
  return app;
}

function parse<T extends z.ZodType>(schema: T, value: unknown, where: string): z.infer<T> {
  const parsed = schema.safeParse(value);
  if (!parsed.success) throw InvalidRequestError.fromZod(parsed.error, where);
  return parsed.data;
}

const leaseNotFound = () => new HttpError(404, 'lease_not_found', 'no such lease');
const operationNotFound = (jobId: string) => new HttpError(404, 'operation_not_found', `no operation ${jobId}`);

/** Idempotency keys are namespaced by who may use them. */

/** An exec's failure as HTTP: what the caller can fix (4xx), Redis or the key (503), the service or a worker (502, 504). */
const EXEC_STATUS: Record<string, number> = {
  secrets_key_missing: 503,
  // The API closed under it and could not cancel it: not a 503 to retry (it may still run).
  exec_cut: 502,
  exec_unsupported: 422,
  unknown_provider: 422,
  provider_deleted: 422,
  provider_credentials_unreadable: 422,
  provider_address_not_allowed: 422,
  sandbox_not_running: 409,
  sandbox_gone: 404,
  not_a_sandbox_id: 404,
  not_the_lease_sandbox: 404,
  activity_lapsed: 409,
  lease_environment_mismatch: 404,
  exec_timeout: 504,
};

function errorHandler(log: Logger, closing: () => boolean): ErrorRequestHandler {
  return (err: unknown, req, res, _next) => {
    let status = 500;
    let body: { code: string; message: string; details?: unknown[]; jobId?: string; probe?: unknown } = { code: 'internal_error', message: 'internal error' };
    if (err instanceof HttpError) {
      status = err.status;
      body = { code: err.code, message: err.message };
      if (err.opts.retryAfterS !== undefined) res.setHeader('Retry-After', String(err.opts.retryAfterS));
    } else if (err instanceof InvalidRequestError) {
      status = 400;
      body = { code: err.code, message: err.message, details: err.issues };
    } else if (err instanceof IdempotencyKeyReusedError) {
      status = 422;
      // The key is the caller's company's and environment's: the operation it names is theirs.
      body = { code: err.code, message: err.message, ...(err.earlierJobId ? { jobId: err.earlierJobId } : {}) };
    } else if (err instanceof OperatorActionRefusedError || err instanceof LeaseHasSandboxError) {
      status = 409;
      body = { code: err.code, message: err.message };
    } else if (err instanceof LeaseClosingError) {
      status = 409;
      body = { code: err.code, message: err.message };
      res.setHeader('Retry-After', String(Math.ceil(err.retryAfterMs / 1000)));
    } else if (err instanceof ProviderInstanceError) {
      status = err.status;
      body = { code: err.code, message: err.message, ...(err instanceof CredentialsRefusedError ? { probe: err.probe } : {}) };
    } else if (err instanceof ExecError) {
      status = EXEC_STATUS[err.code] ?? 502;
      body = { code: err.code, message: err.message };
    } else if (err instanceof ActivityNotFoundError) {
      status = 404;
      body = { code: err.code, message: err.message };
    } else if (err instanceof CompanyBytesFullError) {
      status = 429;
      body = { code: err.code, message: err.message };
      res.setHeader('Retry-After', String(Math.ceil(err.retryAfterMs / 1000)));
    } else if (err instanceof PausesFullError) {
      status = 429;
      body = { code: err.code, message: err.message };
    } else if (err instanceof QueueFullError) {
      status = 429;
      body = { code: err.code, message: err.message };
      res.setHeader('Retry-After', String(Math.ceil(err.retryAfterMs / 1000)));
    } else if (err instanceof URIError) {
      // The router could not percent-decode a path segment.
      status = 400;
      body = { code: 'invalid_request', message: 'the path is not valid percent-encoding' };
    } else if (isBodyParserError(err)) {
      // The parser's statuses, within what the document lists (a body that cannot be
      // inflated comes with 400 and no type).
      status = [400, 413, 415].includes(err.status) ? err.status : 400;
      body =
        err.type === 'entity.too.large'
          ? { code: 'payload_too_large', message: `the body is larger than ${BODY_LIMIT}` }
          : err.type === 'entity.parse.failed'
            ? { code: 'invalid_json', message: 'the body is not valid JSON' }
            : err.status === 415
              ? { code: 'unsupported_media_type', message: 'send the body as application/json in UTF-8' }
              : { code: 'invalid_body', message: err.message };
    } else if (err instanceof ClientClosedError) {
      // A request the API's closing cut short: its connection goes with the answer.
      status = 503;
      body = { code: err.code, message: 'the API is closing; retry' };
      res.setHeader('Retry-After', '1');
      res.setHeader('Connection', 'close');
    } else if (err instanceof RedisUnavailableError || isRedisUnavailable(err)) {
      status = 503;
      body = { code: 'redis_unavailable', message: 'Redis cannot be reached; retry later' };
      res.setHeader('Retry-After', '1');
      // Told as it is: the request's line says so at warn (the client reports Redis itself).
      res.locals.chosenAnswer = true;
    } else if (err instanceof LayoutError) {
      // A deployment fault, not the caller's: the operator sees the detail in the log.
      status = 503;
      body = { code: err.code, message: 'this API is configured with another partition count than the deployment; retry later' };
    }
    // A deployment fault is one line with what to do, not a stack per request.
    if (err instanceof LayoutError) lineOf(log, req).error({ code: err.code }, err.message);
    // An answer the API chose to give (503 walk_unavailable, say) is a line, not a stack.
    else if ((err instanceof HttpError || err instanceof ClientClosedError) && status >= 500) {
      // Its request's own line says it (the request log's errorFields); one whose caller left
      // is only "request aborted" there, so its code is a line of its own.
      res.locals.chosenAnswer = true;
      if (res.headersSent || res.destroyed) lineOf(log, req).warn({ code: err.code }, err.message);
    }
    else if (status >= 500 && res.locals.chosenAnswer !== true) lineOf(log, req).error({ err }, 'request failed');
    if (res.headersSent) return;
    // Closing: whatever it answers, the connection goes with it.
    if (closing()) res.setHeader('Connection', 'close');
    res.locals.errorCode = body.code;
    res.status(status).json({ error: body });
  };
}

/** Aborts when the caller hangs up before its answer is sent. */
function goneSignal(res: Response): AbortSignal {
  const gone = new AbortController();
  res.once('close', () => res.writableFinished || gone.abort());
  return gone.signal;
}

/** Whether the caller hung up already (its connection's close has been and gone). */
function hungUp(req: Request): boolean {
  return req.socket.destroyed;
}

/** An error body-parser (or the zlib stream under it) raised for the client's body: a 4xx status. */
function isBodyParserError(err: unknown): err is { status: number; type?: string; message: string } {
  const status = typeof err === 'object' && err !== null ? (err as { status?: unknown }).status : undefined;
  return typeof status === 'number' && status >= 400 && status < 500;
}
