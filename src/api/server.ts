import { once } from 'node:events';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { Queue } from 'bullmq';
import { LeaseOpsClient } from '../client.ts';
import { ConfigError, type Config } from '../config.ts';
import { loadMasterKeys } from '../providers/instances/sealing.ts';
import type { Logger } from '../logger.ts';
import { queueMetrics } from '../metrics.ts';
import { pingWithin, reportRedisError } from '../queues/redis.ts';
import { createApiApp } from './app.ts';
import { WaitBudget } from './wait-budget.ts';
import { WalkThreads } from './walks.ts';
import { CompanyTurns } from './company-turns.ts';
import { RefusalLog } from './refusal-log.ts';
import { ConnectionPool } from './connections.ts';
import { CompanyRateLimiter, DEFAULT_COMPANY_RATES } from './company-rates.ts';

import { VERSION } from '../version.ts';

export interface ApiServer {
  url: string;
  client: LeaseOpsClient;
  close(): Promise<void>;
}

/** Starts the HTTP API with Bull Board and the operations endpoints. */
export async function startApiServer(config: Config, log: Logger): Promise<ApiServer> {
  // A malformed master key is refused before anything listens (ConfigError: exit 2).
  const masterKeys = loadMasterKeys();
  // Not waiting for Redis: the API listens at once, and answers 503 until Redis does.
  const client = new LeaseOpsClient(config, { failFast: true, masterKeys });
  // Bull Board also shows each partition's maintenance queue (lane sweep, stuck-stop watchdog).
  const maintenance = client.partitions.map((p) => {
    const queue = new Queue(`${config.LEASE_OPS_QUEUE}-maintenance`, { connection: client.ops.connection, prefix: p.settings.LEASE_OPS_PREFIX });
    queue.on('error', reportRedisError);
    return { queue, prefix: client.partitions.length > 1 ? `p${p.index}:` : '' };
  });
  const waits = new WaitBudget({ perCompany: config.LEASE_OPS_API_MAX_WAITS_PER_COMPANY, total: config.LEASE_OPS_API_MAX_WAITS });
  const rates = new CompanyRateLimiter({ ...DEFAULT_COMPANY_RATES, ...config.LEASE_OPS_API_COMPANY_RATES });
  const turns = new CompanyTurns(config.LEASE_OPS_API_REQUESTS_PER_COMPANY);
  const refusals = new RefusalLog(log);
  const connections = new ConnectionPool(config.LEASE_OPS_API_MAX_CONNECTIONS);
  const walks = config.LEASE_OPS_API_WALK_THREADS > 0 ? new WalkThreads(config, config.LEASE_OPS_API_WALK_THREADS, log, (companyId, commands) => rates.chargeWalk(companyId, commands), (scope) => client.attentionEntries(scope)) : undefined;
  const app = createApiApp({
    config,
    client,
    ...(walks ? { walks } : {}),
    log,
    version: VERSION,
    boardQueues: maintenance,
    waits,
    rates,
    turns,
    refusals,
    metrics: queueMetrics(client, { bullmqTotals: config.LEASE_OPS_BULLMQ_METRICS, waits, rates, turns, connections, ...(walks ? { walks } : {}) }),
    readiness: async () => {
      try {
        // A connection on its way up (at start, after an outage) gets its second to answer.
        if (!client.redisReady) await within(client.connected(), 1_000);
        await pingWithin(client.ops.connection, 1_000);
      } catch (err) {
        // Anyone who reaches the port may read this: the error's code, not its address.
        return { ready: false, checks: { redis: `unreachable${errorCode(err)}`, workers: null } };
      }
      // Ready when every partition has a worker: a partition no worker serves runs nothing.
      const counts = await Promise.all(client.partitions.map((p) => p.ops.queue.getWorkersCount()));
      const workers = counts.reduce((n, c) => n + c, 0);
      return { ready: counts.every((c) => c > 0), checks: { redis: 'ok', workers } };
    },
  });
  const server = createServer(
    {
      // Slow clients (a trickled header or body) are bounded, checked every second.
      headersTimeout: config.LEASE_OPS_API_HEADERS_TIMEOUT_MS,
      requestTimeout: Math.max(config.LEASE_OPS_API_REQUEST_TIMEOUT_MS, config.LEASE_OPS_API_HEADERS_TIMEOUT_MS),
      keepAliveTimeout: config.LEASE_OPS_API_KEEPALIVE_TIMEOUT_MS,
      connectionsCheckingInterval: 1_000,
    },
    app,
  );
  connections.attach(server);
  server.listen(config.LEASE_OPS_API_PORT, config.LEASE_OPS_API_HOST);
  try {
    await once(server, 'listening');
  } catch (err) {
    // The port is taken, say: nothing this started may keep the process alive.
    await Promise.all(maintenance.map(({ queue }) => queue.close()));
    await walks?.close();
    await client.close();
    throw err;
  }
  const { port } = server.address() as AddressInfo;
  const host = config.LEASE_OPS_API_HOST.includes(':') ? `[${config.LEASE_OPS_API_HOST}]` : config.LEASE_OPS_API_HOST;
  const url = `http://${host === '0.0.0.0' ? '127.0.0.1' : host}:${port}`;
  log.info({ url }, 'API listening');
  // Listening already (answering 503 until Redis does); callers get it once Redis answers, or
  // after LEASE_OPS_REDIS_TIMEOUT_MS without.
  const connected = await within(client.connected(), config.LEASE_OPS_REDIS_TIMEOUT_MS).then(
    () => true,
    () => false,
  );
  const close = async () => {
    const closed = new Promise<void>((resolve) => server.close(() => resolve()));
    server.closeIdleConnections();
    // Requests waiting for an operation (?waitMs, Prefer: wait) are answered now, with the
    // operation as it is, as when their wait runs out (helper-34: their sockets were cut after
    // 2 s, unanswered), and each connection goes once idle. What is still in progress after
    // 2 s is told the API is closing (its client's connections go: 503 client_closed, and
    // walk_unavailable for a walk), and has its socket cut a moment later (helper-37: cut
    // unanswered).
    client.endWaits();
    const idle = setInterval(() => server.closeIdleConnections(), 50);
    let lastCut: NodeJS.Timeout | undefined;
    const cut = setTimeout(() => {
      const cutting = Promise.all([walks?.close(), client.closeNow()]).catch(() => undefined);
      // Their answers get a moment to go out (an exec's once its command is cancelled: up to 250 ms), then every socket is cut.
      const cutShort = new Promise((resolve) => setTimeout(resolve, 300).unref());
      // Unref'd: it may be set after the server closed (then it has nothing left to cut).
      void Promise.race([cutting, cutShort]).then(() => (lastCut = setTimeout(() => server.closeAllConnections(), 250).unref()));
    }, 2_000);
    await closed;
    clearInterval(idle);
    clearTimeout(cut);
    clearTimeout(lastCut);
    // The refusals counted since the last line are told before the process goes.
    refusals.flush();
    await Promise.all(maintenance.map(({ queue }) => queue.close()));
    await walks?.close();
    await client.close();
  };
  // A master key that does not open the registry's instances: stop (exit 2), nothing decrypted.
  if (connected) {
    try {
      await client.checkMasterKeys();
    } catch (err) {
      if (err instanceof ConfigError) {
        await close();
        throw err;
      }
      log.warn({ err }, 'could not check the master key against the provider registry');
    }
  }
  return {
    url,
    client,
    close,
  };
}

/** ` (ECONNREFUSED)`, say, or nothing: an error's code without the address in its message. */
function errorCode(err: unknown): string {
  const code = (err as { code?: unknown })?.code;
  return typeof code === 'string' && /^[A-Z_]+$/.test(code) ? ` (${code})` : '';
}

/** `promise`, or a rejection after `ms`. */
async function within<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([promise, new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms)))]);
  } finally {
    clearTimeout(timer);
  }
}
