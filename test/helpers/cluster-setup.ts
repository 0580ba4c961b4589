// Global set-up of the `cluster` test project: a local 3-master Redis Cluster of its own, which
// the suites of that project reach through REDIS_URL (test/helpers/env.ts sets it in their
// workers from what this provides). Not through this process's own environment: global set-ups
// of every project run in this one process, and the `redis` project's workers, started from
// it, would then run against the cluster too.
import type { TestProject } from 'vitest/node';
import { RedisCluster } from './redis-cluster.ts';

declare module 'vitest' {
  export interface ProvidedContext {
    clusterRedisUrl: string;
  }
}

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  const cluster = await RedisCluster.start(3);
  project.provide('clusterRedisUrl', cluster.url);
  return () => cluster.stop();
}
