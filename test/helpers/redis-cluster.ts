import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { RedisProcess } from './redis-process.ts';

/** A local Redis Cluster of three masters (no replicas), each a redis-server of its own. */
export class RedisCluster {
  private constructor(readonly nodes: RedisProcess[]) {}

  /** REDIS_URL for lease-ops: the seed nodes. */
  get url(): string {
    return `redis+cluster://${this.nodes.map((n) => `127.0.0.1:${n.port}`).join(',')}`;
  }

  static async start(masters = 3): Promise<RedisCluster> {
    const nodes = await Promise.all(
      Array.from({ length: masters }, () =>
        RedisProcess.start(['--cluster-enabled', 'yes', '--cluster-config-file', 'nodes.conf', '--cluster-node-timeout', '2000', '--appendonly', 'no']),
      ),
    );
    const cluster = new RedisCluster(nodes);
    await promisify(execFile)('redis-cli', ['--cluster', 'create', ...nodes.map((n) => `127.0.0.1:${n.port}`), '--cluster-replicas', '0', '--cluster-yes']);
    await cluster.untilHealthy();
    return cluster;
  }

  /** Until every node reports cluster_state:ok (slots assigned, nodes agree). */
  private async untilHealthy(timeoutMs = 20_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    const clients = this.nodes.map((n) => new Redis(n.url, { lazyConnect: false, maxRetriesPerRequest: 1 }));
    try {
      for (;;) {
        const infos = await Promise.all(clients.map((c) => c.cluster('INFO') as Promise<string>));
        if (infos.every((i) => i.includes('cluster_state:ok'))) return;
        if (Date.now() > deadline) throw new Error(`cluster not healthy within ${timeoutMs} ms:\n${infos.join('\n')}`);
        await new Promise((r) => setTimeout(r, 100));
      }
    } finally {
      for (const c of clients) c.disconnect();
    }
  }

  async stop(): Promise<void> {
    await Promise.all(this.nodes.map((n) => n.stop()));
  }
}
