import { once } from 'node:events';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { createApiApp } from '../../src/api/app.ts';
import { WaitBudget } from '../../src/api/wait-budget.ts';
import { CompanyRateLimiter, DEFAULT_COMPANY_RATES } from '../../src/api/company-rates.ts';
import { CompanyTurns } from '../../src/api/company-turns.ts';
import { ConnectionPool } from '../../src/api/connections.ts';
import { LeaseOpsClient } from '../../src/client.ts';
import type { Logger } from '../../src/logger.ts';
import type { MasterKeys } from '../../src/providers/instances/sealing.ts';
import { createLogger } from '../../src/logger.ts';
import { queueMetrics } from '../../src/metrics.ts';
import type { TestBed } from './env.ts';

export interface TestApi {
  /** http://127.0.0.1:<port> */
  base: string;
  client: LeaseOpsClient;
  close(): Promise<void>;
}

/** The HTTP API for a test bed, on a real listening socket (readiness always true). */
export async function startTestApi(bed: TestBed, log: Logger = createLogger({ level: 'silent' }), opts: { masterKeys?: MasterKeys | null; port?: number } = {}): Promise<TestApi> {
  const client = new LeaseOpsClient(bed.config, { failFast: true, masterKeys: opts.masterKeys ?? null });
  await client.connected();
  const waits = new WaitBudget({ perCompany: bed.config.LEASE_OPS_API_MAX_WAITS_PER_COMPANY, total: bed.config.LEASE_OPS_API_MAX_WAITS });
  const rates = new CompanyRateLimiter({ ...DEFAULT_COMPANY_RATES, ...bed.config.LEASE_OPS_API_COMPANY_RATES });
  const turns = new CompanyTurns(bed.config.LEASE_OPS_API_REQUESTS_PER_COMPANY);
  const connections = new ConnectionPool(bed.config.LEASE_OPS_API_MAX_CONNECTIONS);
  const app = createApiApp({
    config: bed.config,
    client,
    log,
    version: 'test',
    waits,
    rates,
    turns,
    metrics: queueMetrics(client, { bullmqTotals: bed.config.LEASE_OPS_BULLMQ_METRICS, waits, rates, turns, connections }),
    readiness: async () => ({ ready: true, checks: { redis: 'ok' } }),
  });
  const server = createServer(app);
  connections.attach(server);
  server.listen(opts.port ?? 0, '127.0.0.1');
  await once(server, 'listening');
  return {
    base: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    client,
    close: async () => {
      server.closeAllConnections();
      server.close();
      await client.close();
    },
  };
}

/** What an operator does in Bull Board (read-write): remove one job, or clean a state. Resolves with the HTTP status. */
export const board = {
  async remove(api: TestApi, token: string, queue: string, jobId: string): Promise<number> {
    return boardPut(api, token, `/board/api/queues/${encodeURIComponent(queue)}/${encodeURIComponent(jobId)}/clean`);
  },
  async clean(api: TestApi, token: string, queue: string, state: string): Promise<number> {
    return boardPut(api, token, `/board/api/queues/${encodeURIComponent(queue)}/clean/${state}`);
  },
};

async function boardPut(api: TestApi, token: string, path: string): Promise<number> {
  const res = await fetch(`${api.base}${path}`, {
    method: 'PUT',
    headers: { authorization: `Basic ${Buffer.from(`operator:${token}`).toString('base64')}`, origin: api.base, 'sec-fetch-site': 'same-origin' },
  });
  await res.arrayBuffer();
  return res.status;
}
