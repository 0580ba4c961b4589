import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { Queue } from 'bullmq';
import { LeaseOpsClient } from '../client.ts';
import type { Config } from '../config.ts';
import type { Logger } from '../logger.ts';
import { queueMetrics } from '../metrics.ts';
import { pingWithin } from '../queues/redis.ts';
import { createApiApp } from './app.ts';

export const VERSION = (JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string }).version;

export interface ApiServer {
  url: string;
  client: LeaseOpsClient;
  close(): Promise<void>;
}

/** Starts the HTTP API with Bull Board and the operations endpoints. */
export async function startApiServer(config: Config, log: Logger): Promise<ApiServer> {
  const client = new LeaseOpsClient(config, { failFast: true });
  await client.connected();
  // Bull Board also shows the maintenance queue (lane sweep, stuck-stop watchdog).
  const maintenance = new Queue(`${config.LEASE_OPS_QUEUE}-maintenance`, { connection: client.ops.connection, prefix: config.LEASE_OPS_PREFIX });
  const app = createApiApp({
    config,
    client,
    log,
    version: VERSION,
    boardQueues: [maintenance],
    metrics: queueMetrics(client, { bullmqTotals: config.LEASE_OPS_BULLMQ_METRICS }),
    readiness: async () => {
      try {
        await pingWithin(client.ops.connection, 1_000);
      } catch (err) {
        // Anyone who reaches the port may read this: the error's code, not its address.
        return { ready: false, checks: { redis: `unreachable${errorCode(err)}`, workers: null } };
      }
      const workers = await client.ops.queue.getWorkersCount();
      return { ready: workers > 0, checks: { redis: 'ok', workers } };
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
  server.maxConnections = config.LEASE_OPS_API_MAX_CONNECTIONS;
  server.listen(config.LEASE_OPS_API_PORT, config.LEASE_OPS_API_HOST);
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;
  const host = config.LEASE_OPS_API_HOST.includes(':') ? `[${config.LEASE_OPS_API_HOST}]` : config.LEASE_OPS_API_HOST;
  const url = `http://${host === '0.0.0.0' ? '127.0.0.1' : host}:${port}`;
  log.info({ url }, 'API listening');
  return {
    url,
    client,
    close: async () => {
      const closed = new Promise<void>((resolve) => server.close(() => resolve()));
      server.closeIdleConnections();
      // Requests waiting for an operation (?waitMs) get a moment, then their sockets go.
      const cut = setTimeout(() => server.closeAllConnections(), 2_000);
      await closed;
      clearTimeout(cut);
      await maintenance.close();
      await client.close();
    },
  };
}

/** ` (ECONNREFUSED)`, say, or nothing: an error's code without the address in its message. */
function errorCode(err: unknown): string {
  const code = (err as { code?: unknown })?.code;
  return typeof code === 'string' && /^[A-Z_]+$/.test(code) ? ` (${code})` : '';
}
