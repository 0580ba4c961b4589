import { once } from 'node:events';
import { readFileSync } from 'node:fs';
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
        return { ready: false, checks: { redis: `unreachable: ${(err as Error).message}`, workers: null } };
      }
      const workers = await client.ops.queue.getWorkersCount();
      return { ready: workers > 0, checks: { redis: 'ok', workers } };
    },
  });
  const server = app.listen(config.LEASE_OPS_API_PORT, config.LEASE_OPS_API_HOST);
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
