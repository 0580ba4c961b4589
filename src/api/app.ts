import { createBullBoard } from '@bull-board/api';
import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { ExpressAdapter } from '@bull-board/express';
import type { Queue } from 'bullmq';
import express, { type ErrorRequestHandler, type NextFunction, type Request, type Response } from 'express';
import { pinoHttp } from 'pino-http';
import { z } from 'zod';
import type { LeaseOpsClient } from '../client.ts';
import type { Config } from '../config.ts';
import { IdempotencyKeyReusedError, InvalidRequestError, LeaseOpsError, QueueFullError } from '../errors.ts';
import type { Logger } from '../logger.ts';
import { laneIdOfJobId } from '../lease.ts';
import { sweepEveryLane } from '../queues/sweep.ts';
import { canSee, metricsAllowed, type Principal, TokenAuthority } from './auth.ts';
import { openApiDocument } from './openapi.ts';
import { EnqueueBodySchema, IdempotencyHeaderSchema, LeasePathSchema, OperationPathSchema, WaitQuerySchema } from './schemas.ts';
import { redactQuery } from '../secrets.ts';

export interface ApiDeps {
  config: Pick<Config, 'LEASE_OPS_API_TOKENS' | 'LEASE_OPS_API_MAX_WAIT_MS' | 'LEASE_OPS_BOARD_READ_ONLY' | 'LEASE_OPS_METRICS_TOKEN'>;
  client: LeaseOpsClient;
  log: Logger;
  /** Queues Bull Board shows besides the operations queue (the maintenance queue). */
  boardQueues?: Queue[];
  /** Whether this deployment counts as ready: Redis answers and workers run. */
  readiness: () => Promise<{ ready: boolean; checks: Record<string, unknown> }>;
  /** The Prometheus exposition. */
  metrics: () => Promise<string>;
  version: string;
}

/** An error the API answers with its own status and stable code. */
export class HttpError extends LeaseOpsError {
  constructor(
    readonly status: number,
    code: string,
    message: string,
  ) {
    super(code, message);
  }
}

const BODY_LIMIT = '64kb';

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
function repairAfterBoardRemovals(ops: LeaseOpsClient['ops'], log: Logger) {
  // As Bull Board's express router matches them: any case, a trailing slash or not.
  const one = /^\/api\/queues\/([^/]+)\/([^/]+)\/clean\/?$/i;
  const many = /^\/api\/queues\/([^/]+)\/(?:clean\/[^/]+|empty|obliterate)\/?$/i;
  return (req: Request, res: Response, next: NextFunction): void => {
    if (req.method !== 'PUT') return next();
    const path = req.path;
    const single = one.exec(path);
    const bulk = single ? null : many.exec(path);
    const queueName = decodeURIComponent((single ?? bulk)?.[1] ?? '');
    if (queueName !== ops.queue.name) return next();
    res.on('finish', () => {
      if (res.statusCode >= 400) return;
      const repaired = single ? repairLaneOfJob(ops, decodeURIComponent(single[2]!)) : sweepEveryLane(ops, log);
      repaired.catch((err: unknown) => log.warn({ err }, 'repairing lanes after a removal in Bull Board failed; the sweep will'));
    });
    next();
  };
}

async function repairLaneOfJob(ops: LeaseOpsClient['ops'], jobId: string): Promise<void> {
  const laneId = laneIdOfJobId(jobId);
  if (laneId) await ops.lanes.repair(laneId);
}

/** The HTTP API, Bull Board and the operations endpoints, as one express 5 app. */
export function createApiApp(deps: ApiDeps): express.Express {
  const { client, log } = deps;
  const auth = new TokenAuthority(deps.config.LEASE_OPS_API_TOKENS);
  const app = express();
  app.disable('x-powered-by');
  app.set('query parser', 'simple');
  app.use(
    pinoHttp({
      logger: log,
      // Probes and scrapes are frequent and tell nothing; keep them out of the log.
      autoLogging: { ignore: (req) => ['/healthz', '/readyz', '/metrics'].includes(req.url ?? '') },
      customLogLevel: (_req, res, err) => (err || res.statusCode >= 500 ? 'error' : res.statusCode >= 400 ? 'warn' : 'info'),
      serializers: {
        // Only what helps; headers carry tokens and cookies.
        req: (req: { method: string; url: string; id: unknown }) => ({ id: req.id, method: req.method, url: redactQuery(req.url) }),
        res: (res: { statusCode: number }) => ({ statusCode: res.statusCode }),
      },
    }),
  );

  // Operations endpoints: no authentication, so probes and Prometheus can reach them.
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
  const document = openApiDocument(deps.version);
  app.get('/v1/openapi.json', (_req, res) => {
    res.json(document);
  });

  const authenticate =
    (challenge: 'Bearer' | 'Basic') =>
    (req: Request, res: Response, next: NextFunction): void => {
      const principal = auth.authenticate(req.headers.authorization);
      if (!principal) {
        res.setHeader('WWW-Authenticate', `${challenge} realm="lease-ops"`);
        throw new HttpError(401, 'unauthorized', 'a valid bearer token is required');
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
  createBullBoard({
    queues: [client.ops.queue, ...(deps.boardQueues ?? [])].map(
      (q) => new BullMQAdapter(q, { readOnlyMode: deps.config.LEASE_OPS_BOARD_READ_ONLY }),
    ),
    serverAdapter: board,
    options: { uiConfig: { boardTitle: 'lease-ops' } },
  });
  app.use('/board', sameOriginWrites, authenticate('Basic'), adminOnly, repairAfterBoardRemovals(client.ops, deps.log), board.getRouter() as express.Router);

  const v1 = express.Router();
  v1.use(authenticate('Bearer'));
  v1.use(express.json({ limit: BODY_LIMIT, strict: true }));

  v1.post('/leases/:provider/:companyId/:environmentId/:leaseId/operations', async (req, res) => {
    if (!req.is('application/json')) throw new HttpError(415, 'unsupported_media_type', 'send the operation as application/json');
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!canSee(res.locals.principal as Principal, lease)) throw leaseNotFound();
    const body = parse(EnqueueBodySchema, req.body, 'body');
    const header = parse(IdempotencyHeaderSchema, { 'idempotency-key': req.get('idempotency-key') }, 'Idempotency-Key header');
    const idempotencyKey = body.idempotencyKey ?? header['idempotency-key'];
    // A name no worker ever served is a typo, not a rollout: refused now, not failed later.
    // Until some worker said what it serves (none started yet, or Redis lost its data) there
    // is nothing to tell a typo by, and the request is taken; a request repeated under its
    // idempotency key gets its receipt whatever the workers say.
    const providers = await client.ops.announcedProviders();
    if (providers.length > 0 && !providers.includes(lease.provider) && !(idempotencyKey !== undefined && (await client.ops.idempotencyKeyUsed(lease, idempotencyKey)))) {
      throw new HttpError(422, 'unknown_provider', `no worker serves provider "${lease.provider}" (served: ${providers.sort().join(', ')})`);
    }
    const enqueued = await client.enqueue(body.op, lease, body.params, {
      ...(body.deadlineMs === undefined ? {} : { deadlineMs: body.deadlineMs }),
      // Keys are scoped to the lease's company and environment (the queue does it), which
      // a caller can only name if its token sees them.
      ...(idempotencyKey === undefined ? {} : { idempotencyKey }),
    });
    const location = `/v1/operations/${encodeURIComponent(enqueued.jobId)}`;
    res.status(202).location(location).json({ ...enqueued, location });
  });

  v1.get('/leases/:provider/:companyId/:environmentId/:leaseId', async (req, res) => {
    const lease = parse(LeasePathSchema, req.params, 'path');
    if (!canSee(res.locals.principal as Principal, lease)) throw leaseNotFound();
    res.json(await client.getLease(lease));
  });

  v1.get('/operations/:jobId', async (req, res) => {
    const { jobId } = parse(OperationPathSchema, req.params, 'path');
    const { waitMs } = parse(WaitQuerySchema, req.query, 'query');
    const principal = res.locals.principal as Principal;
    // Check the scope before waiting, so an out-of-scope id cannot be timed either.
    const first = await client.getOperation(jobId);
    if (!first || !canSee(principal, first.lease)) throw operationNotFound(jobId);
    const wait = Math.min(waitMs ?? 0, deps.config.LEASE_OPS_API_MAX_WAIT_MS);
    const view = wait > 0 ? await client.waitForEnd(first, wait) : first;
    if (!view) throw operationNotFound(jobId);
    res.json(view);
  });

  v1.get('/attention', async (_req, res) => {
    const principal = res.locals.principal as Principal;
    // Read with the scope, not filtered after: another company's items never crowd a caller's out.
    const items = await client.leasesNeedingAttention(200, (lease) => canSee(principal, lease));
    res.json({ items });
  });

  v1.get('/overview', adminOnly, async (_req, res) => {
    res.json(await client.overview());
  });

  app.use('/v1', v1);
  app.use((req, _res) => {
    throw new HttpError(404, 'not_found', `no route ${req.method} ${req.path}`);
  });
  app.use(errorHandler(log));
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

/** True for errors that mean Redis cannot be reached right now. */
function isRedisUnavailable(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = (err as NodeJS.ErrnoException).code;
  return (
    ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH'].includes(code ?? '') ||
    err.name === 'MaxRetriesPerRequestError' ||
    /Connection is closed|Stream isn't writeable|max retries per request|Command timed out|LOADING|enableOfflineQueue/i.test(err.message)
  );
}

function errorHandler(log: Logger): ErrorRequestHandler {
  return (err: unknown, req, res, _next) => {
    let status = 500;
    let body: { code: string; message: string; details?: unknown[] } = { code: 'internal_error', message: 'internal error' };
    if (err instanceof HttpError) {
      status = err.status;
      body = { code: err.code, message: err.message };
    } else if (err instanceof InvalidRequestError) {
      status = 400;
      body = { code: err.code, message: err.message, details: err.issues };
    } else if (err instanceof IdempotencyKeyReusedError) {
      status = 422;
      body = { code: err.code, message: err.message };
    } else if (err instanceof QueueFullError) {
      status = 429;
      body = { code: err.code, message: err.message };
      res.setHeader('Retry-After', String(Math.ceil(err.retryAfterMs / 1000)));
    } else if (isBodyParserError(err)) {
      status = err.status;
      body =
        err.type === 'entity.too.large'
          ? { code: 'payload_too_large', message: `the body is larger than ${BODY_LIMIT}` }
          : err.type === 'entity.parse.failed'
            ? { code: 'invalid_json', message: 'the body is not valid JSON' }
            : { code: 'invalid_body', message: err.message };
    } else if (isRedisUnavailable(err)) {
      status = 503;
      body = { code: 'redis_unavailable', message: 'Redis cannot be reached; retry later' };
      res.setHeader('Retry-After', '1');
    }
    if (status >= 500) (req.log ?? log).error({ err }, 'request failed');
    if (res.headersSent) return;
    res.status(status).json({ error: body });
  };
}

function isBodyParserError(err: unknown): err is { status: number; type: string; message: string } {
  return typeof err === 'object' && err !== null && 'type' in err && 'status' in err && typeof (err as { status: unknown }).status === 'number';
}
