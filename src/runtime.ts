import { once } from 'node:events';
import { createServer, type Server } from 'node:http';
import { ConfigError, unknownSettings, type Config } from './config.ts';
import { metricsAllowed } from './api/auth.ts';
import { enableProcessMetrics, registry } from './metrics.ts';
import { createLogger, logFormat, type Logger } from './logger.ts';
import { redisRateLimiters } from './providers/pacing.ts';
import { loadProviders } from './providers/registry.ts';
import { instanceProviders, openInstanceStore } from './providers/instances/index.ts';
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { luaCommand } from './queues/lua-scripts.ts';
import { answerWithin, createRedis, rateLimitedRedisReport, reportRedisErrorsTo, type RedisClient } from './queues/redis.ts';
import { LeaseWorkers } from './queues/partitioned-worker.ts';

/** Redis errors go through pino, at most one line per 10 s, and a line when Redis answers again. */
export function reportRedisTrouble(config: Config, log: Logger): void {
  reportRedisErrorsTo(rateLimitedRedisReport(log, config.REDIS_URL));
}

/** The process's logger; it warns at once about LEASE_OPS_ variables nothing reads (misspelt, most likely). */
export function loggerFor(config: Config, name = 'lease-ops'): Logger {
  const log = createLogger({ level: config.LEASE_OPS_LOG_LEVEL, name, format: logFormat(config.LEASE_OPS_LOG_FORMAT) });
  for (const { name: variable, closest } of unknownSettings()) log.warn({ variable, closest }, `${variable} is not a lease-ops setting (did you mean ${closest}?); it is ignored`);
  return log;
}

/**
 * Starts one worker replica with the configured providers. Their request pacing is shared
 * through Redis, so the replicas together stay under a provider's rate limit.
 */
export async function startWorker(config: Config, log: Logger): Promise<LeaseWorkers> {
  reportRedisTrouble(config, log);
  const pacing = createRedis(config.REDIS_URL, { connectionName: 'lease-ops-worker-pacing' });
  const services = { rateLimiters: redisRateLimiters(pacing, config.LEASE_OPS_PREFIX) };
  // What the configuration says is checked first (no Redis needed to tell a bad one), then
  // the registry's master key, before anything starts: a wrong one exits 2.
  const providers = await loadProviders(config.LEASE_OPS_PROVIDERS, process.env, services).catch((err: unknown) => {
    pacing.disconnect();
    throw err;
  });
  const store = await openInstanceStore(pacing, config).catch(async (err: unknown) => {
    await providers.close();
    pacing.disconnect();
    throw err;
  });
  providers.instances = instanceProviders(store, config, services);
  if (providers.names().includes('simulated') && !process.env.LEASE_OPS_SIMULATED_URL) {
    const release = await claimEmbeddedCloud(pacing, config.LEASE_OPS_PREFIX).catch(async (err: unknown) => {
      await providers.close();
      pacing.disconnect();
      throw err;
    });
    providers.onClose(release);
  }
  providers.onClose(() => pacing.disconnect());
  const worker = new LeaseWorkers(config, providers, log);
  await worker.start().catch(async (err: unknown) => {
    await worker.close();
    throw err;
  });
  log.info({ providers: providers.names(), concurrency: config.LEASE_OPS_CONCURRENCY, partitions: worker.workers.map((w) => w.partition) }, 'worker started');
  return worker;
}

/**
 * The simulated provider without LEASE_OPS_SIMULATED_URL runs a cloud inside this process.
 * Another process on the same queue would run another, and one lease's operations would
 * meet two clouds that know different sandboxes: the first process claims the queue's
 * embedded cloud in Redis (refreshed while it runs), a second is refused and told how to
 * share one. A claim left by this host's earlier run of this process id (a restarted
 * container) or by a process that is gone is taken over.
 */
async function claimEmbeddedCloud(redis: RedisClient, prefix: string): Promise<() => Promise<void>> {
  const key = `${prefix}:embedded-cloud`;
  const me = `${hostname()} ${process.pid} ${randomBytes(4).toString('hex')}`;
  if ((await redis.set(key, me, 'EX', 30, 'NX')) !== 'OK') {
    const [host, pid] = ((await redis.get(key)) ?? '').split(' ');
    const gone = host === hostname() && (Number(pid) === process.pid || !processAlive(Number(pid)));
    if (!gone) {
      throw new ConfigError(
        `another process (${host} pid ${pid}) runs the embedded simulated cloud of this queue (LEASE_OPS_PREFIX=${prefix}); a second would split the leases between two clouds.\n` +
          '  Run `lease-ops simulated-cloud` and set LEASE_OPS_SIMULATED_URL on every worker, or give this one another LEASE_OPS_PREFIX.',
      );
    }
    await redis.set(key, me, 'EX', 30);
  }
  const refresh = setInterval(() => void redis.set(key, me, 'EX', 30).catch(() => undefined), 10_000);
  refresh.unref();
  const deleteIfEqual = luaCommand(redis, 'delete-if-equal', 1);
  return async () => {
    clearInterval(refresh);
    // Bounded, so a stop with Redis out of reach does not wait on it; the claim then lapses in 30 s.
    await answerWithin(deleteIfEqual(key, me), 2_000).catch(() => undefined);
  };
}

function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * A worker replica's own /healthz, /readyz and /metrics (its attempts, by type and outcome),
 * on LEASE_OPS_METRICS_PORT; nothing when that is 0. Ready while the worker runs and Redis answers.
 */
export async function serveWorkerMetrics(config: Config, worker: Pick<LeaseWorkers, 'ready'>, log: Logger): Promise<Server | null> {
  if (!config.LEASE_OPS_METRICS_PORT) return null;
  enableProcessMetrics();
  const server = createServer((req, res) => {
    const send = (status: number, type: string, body: string) => res.writeHead(status, { 'content-type': type }).end(body);
    const path = (req.url ?? '').split('?')[0];
    if (path === '/healthz') return send(200, 'application/json', '{"status":"ok"}');
    if (path === '/readyz') {
      void worker.ready().then((ready) => send(ready ? 200 : 503, 'application/json', JSON.stringify({ status: ready ? 'ready' : 'not_ready' })));
      return;
    }
    if (path === '/metrics') {
      if (!metricsAllowed(req.headers.authorization, config.LEASE_OPS_METRICS_TOKEN)) {
        res.setHeader('www-authenticate', 'Bearer');
        return send(401, 'application/json', '{"error":{"code":"unauthorized","message":"send LEASE_OPS_METRICS_TOKEN as a Bearer token"}}');
      }
      void registry.metrics().then((text) => send(200, registry.contentType, text));
      return;
    }
    send(404, 'application/json', '{"error":{"code":"not_found","message":"try /metrics, /healthz or /readyz"}}');
  });
  server.listen(config.LEASE_OPS_METRICS_PORT, config.LEASE_OPS_API_HOST);
  await once(server, 'listening');
  log.info({ port: config.LEASE_OPS_METRICS_PORT }, 'worker metrics listening');
  return server;
}

/**
 * Until a command's graceful stop is in place (starting waits for Redis, say), SIGINT or
 * SIGTERM ends the process at once (130, 143), after `cleanUp`. Returns the hand-over: with
 * `next`, the graceful stop (exitOnSignals) is put in place first and only then are these
 * listeners removed. In the other order a signal that came just before would be lost: when a
 * signal's last listener goes, Node closes its watcher and drops what that watcher had
 * caught and not yet dispatched, and the process would run on as if never signalled.
 */
export function exitEarlyOnSignals(cleanUp: (signal: NodeJS.Signals) => void | Promise<void> = () => undefined): (next?: { log: Logger; stop: () => Promise<void> }) => void {
  const onSignal = (signal: NodeJS.Signals) => {
    // A clean-up that returns a promise (deleting keys, say) is waited for; a failed one still exits.
    void Promise.resolve()
      .then(() => cleanUp(signal))
      .catch(() => undefined)
      .finally(() => process.exit(exitCodeOf(signal)));
  };
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  return (next) => {
    if (next) exitOnSignals(next.log, next.stop);
    process.off('SIGINT', onSignal);
    process.off('SIGTERM', onSignal);
  };
}

/**
 * SIGTERM and SIGINT stop gracefully: no new jobs, running ones finish, then exit.
 * A second signal exits at once (130 or 143, as a process killed by it); BullMQ's
 * stalled-job handling then recovers the jobs.
 */
function exitOnSignals(log: Logger, stop: () => Promise<void>): void {
  let stopping = false;
  const onSignal = (signal: NodeJS.Signals) => {
    if (stopping) {
      log.warn({ signal }, 'second signal: exiting now');
      process.exit(exitCodeOf(signal));
    }
    stopping = true;
    log.info({ signal }, 'stopping gracefully');
    stop().then(
      () => process.exit(0),
      (err: unknown) => {
        log.error({ err }, 'error while stopping');
        process.exit(1);
      },
    );
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
}

/** The code of a process ended by a signal it caught: 128 + the signal's number, as if killed by it. */
function exitCodeOf(signal: NodeJS.Signals): number {
  return signal === 'SIGINT' ? 130 : 143;
}
