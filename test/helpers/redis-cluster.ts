import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { RedisProcess } from './redis-process.ts';

/** A local Redis Cluster of three masters (and, if asked, a replica each), each a redis-server of its own. */
export class RedisCluster {
  private constructor(readonly nodes: RedisProcess[]) {}

  /** REDIS_URL for lease-ops: the seed nodes. */
  get url(): string {
    return `redis+cluster://${this.nodes.map((n) => `127.0.0.1:${n.port}`).join(',')}`;
  }

  /**
   * `replicas`: one replica per master. `persistence`: redis-server options for it; none by
   * default (the tests that need data to survive say which).
   */
  static async start(masters = 3, opts: { replicas?: 0 | 1; persistence?: string[] } = {}): Promise<RedisCluster> {
    const replicas = opts.replicas ?? 0;
    const started = await Promise.allSettled(
      Array.from({ length: masters * (1 + replicas) }, () =>
        RedisProcess.start(['--cluster-enabled', 'yes', '--cluster-config-file', 'nodes.conf', '--cluster-node-timeout', '2000', ...(opts.persistence ?? ['--appendonly', 'no'])]),
      ),
    );
    const nodes = started.flatMap((s) => (s.status === 'fulfilled' ? [s.value] : []));
    // Nodes that did start are stopped when the cluster does not come up: left running, they
    // would keep the test process from exiting.
    try {
      const failed = started.find((s) => s.status === 'rejected');
      if (failed) throw failed.reason;
      const cluster = new RedisCluster(nodes);
      await promisify(execFile)('redis-cli', ['--cluster', 'create', ...nodes.map((n) => `127.0.0.1:${n.port}`), '--cluster-replicas', String(replicas), '--cluster-yes']);
      await cluster.untilHealthy();
      if (replicas) await cluster.untilReplicasInSync();
      return cluster;
    } catch (err) {
      await Promise.all(nodes.map((n) => n.stop()));
      throw err;
    }
  }

  /** The node serving a slot as master now, and a replica of it. */
  async ownerOf(slot: number): Promise<{ master: RedisProcess; replica: RedisProcess | null }> {
    const client = new Redis(this.nodes[0]!.url, { maxRetriesPerRequest: 1 });
    try {
      const lines = String(await client.cluster('NODES')).trim().split('\n');
      const parsed = lines.map((line) => {
        const [id, address, flags, masterId, , , , , ...slots] = line.split(' ');
        return { id: id!, port: Number(address!.split('@')[0]!.split(':')[1]), master: flags!.includes('master'), masterId: masterId!, slots };
      });
      const owner = parsed.find((n) => n.master && n.slots.some((range) => {
        const [from, to] = range.split('-').map(Number);
        return slot >= from! && slot <= (to ?? from)!;
      }))!;
      const replica = parsed.find((n) => n.masterId === owner.id);
      const node = (port: number) => this.nodes.find((n) => n.port === port)!;
      return { master: node(owner.port), replica: replica ? node(replica.port) : null };
    } finally {
      client.disconnect();
    }
  }

  /** `CLUSTER FAILOVER` on a replica (a coordinated, manual failover), until every node knows it as a master. */
  async failover(replica: RedisProcess, timeoutMs = 20_000): Promise<void> {
    const clients = this.nodes.map((n) => new Redis(n.url, { maxRetriesPerRequest: 1 }));
    const own = clients[this.nodes.indexOf(replica)]!;
    try {
      const id = String(await own.cluster('MYID'));
      await own.cluster('FAILOVER');
      const deadline = Date.now() + timeoutMs;
      const knownAsMaster = async () =>
        (await Promise.all(clients.map((c) => c.cluster('NODES') as Promise<string>))).every((nodes) =>
          nodes.split('\n').some((line) => line.startsWith(`${id} `) && line.split(' ')[2]!.includes('master')),
        );
      while (!(await knownAsMaster())) {
        if (Date.now() > deadline) throw new Error(`replica ${replica.port} was not known as a master within ${timeoutMs} ms`);
        await new Promise((r) => setTimeout(r, 50));
      }
    } finally {
      for (const c of clients) c.disconnect();
    }
    await this.untilHealthy();
  }

  /** Until every replica reports its link to its master up. */
  private async untilReplicasInSync(timeoutMs = 20_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    const clients = this.nodes.map((n) => new Redis(n.url, { maxRetriesPerRequest: 1 }));
    try {
      for (;;) {
        const infos = await Promise.all(clients.map((c) => c.info('replication')));
        if (infos.filter((i) => i.includes('role:slave')).every((i) => i.includes('master_link_status:up'))) return;
        if (Date.now() > deadline) throw new Error('replicas not in sync');
        await new Promise((r) => setTimeout(r, 100));
      }
    } finally {
      for (const c of clients) c.disconnect();
    }
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
