// Global set-up of the `cluster` test project: a local 3-master Redis Cluster of its own,
// which the suites of that project reach through REDIS_URL (inherited by the test workers).
import { RedisCluster } from './redis-cluster.ts';

export default async function setup(): Promise<() => Promise<void>> {
  const cluster = await RedisCluster.start(3);
  process.env.REDIS_URL = cluster.url;
  return () => cluster.stop();
}
