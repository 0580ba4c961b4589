import { once } from 'node:events';
import { createServer, type Server } from 'node:http';
import type { Config } from './config.ts';
import { metricsAllowed } from './api/auth.ts';
import { enableProcessMetrics, registry } from './metrics.ts';
import { createLogger, type Logger } from './logger.ts';
import { redisRateLimiters } from './providers/pacing.ts';
import { loadProviders } from './providers/registry.ts';
import { createRedis } from './queues/redis.ts';
import { LeaseWorker } from './queues/worker.ts';

export function loggerFor(config: Config, name = 'lease-ops'): Logger {
  return createLogger({ level: config.LEASE_OPS_LOG_LEVEL, name });
}

/**
 * Starts one worker replica with the configured providers. Their request pacing is shared
 * through Redis, so the replicas together stay under a provider's rate limit.
 */
export async function startWorker(config: Config, log: Logger): Promise<LeaseWorker> {
  const pacing = createRedis(config.REDIS_URL);
  const providers = await loadProviders(config.LEASE_OPS_PROVIDERS, process.env, {
    rateLimiters: redisRateLimiters(pacing, config.LEASE_OPS_PREFIX),
  }).catch((err: unknown) => {
    pacing.disconnect();
    throw err;
  });
  providers.onClose(() => pacing.disconnect());
  const worker = new LeaseWorker(config, providers, log);
  await worker.start();
  log.info({ providers: providers.names(), concurrency: config.LEASE_OPS_CONCURRENCY }, 'worker started');
  return worker;
}

/**
 * A worker replica's own /healthz, /readyz and /metrics (its attempts, by type and outcome),
 * on LEASE_OPS_METRICS_PORT; nothing when that is 0. Ready while the worker runs and Redis answers.
 */
export async function serveWorkerMetrics(config: Config, worker: LeaseWorker, log: Logger): Promise<Server | null> {
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
 * SIGTERM and SIGINT stop gracefully: no new jobs, running ones finish, then exit.
 * A second signal exits at once; BullMQ's stalled-job handling then recovers the jobs.
 */
export function exitOnSignals(log: Logger, stop: () => Promise<void>): void {
  let stopping = false;
  const onSignal = (signal: NodeJS.Signals) => {
    if (stopping) {
      log.warn({ signal }, 'second signal: exiting now');
      process.exit(130);
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
