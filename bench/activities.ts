import { randomBytes } from 'node:crypto';
import { loadConfig } from '../src/config.ts';
import { OperationsQueue } from '../src/queues/operations-queue.ts';
import { deleteKeysUnder } from '../src/queues/redis.ts';
import { singleRedis } from './bench.ts';
import { measureRedis, perOperation } from './redis-cost.ts';

export interface ActivityCost {
  /** Redis CPU per call of a begin, heartbeat, end cycle (three calls), µs. */
  cpu_us_per_call: number;
  /** Script time per call, µs (begin and heartbeat are scripts; end is one HDEL). */
  script_us_per_call: number;
  cycles: number;
}

/**
 * (g) What an activity gate costs Redis: `cycles` begin, heartbeat and end cycles on as many
 * leases (each lease's lane holding one queued operation, as a busy lease's does), 50 at a time.
 */
export async function activityCost(cycles: number): Promise<ActivityCost> {
  const prefix = `{lease-ops-bench-activities-${randomBytes(3).toString('hex')}}`;
  const config = loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix, LEASE_OPS_LOG_LEVEL: 'silent' });
  const redis = singleRedis(config.REDIS_URL);
  const ops = new OperationsQueue(redis, config);
  try {
    const lease = (i: number) => ({ provider: 'bench', companyId: 'bench', environmentId: 'bench', leaseId: `lease-${i}` });
    const measured = await measureRedis([redis]);
    for (let from = 0; from < cycles; from += 50) {
      await Promise.all(
        Array.from({ length: Math.min(50, cycles - from) }, async (_, j) => {
          const l = lease(from + j);
          const begun = await ops.activities.begin(await ops.laneOf(l), l, 'exec', 30_000);
          if (begun.kind !== 'begun') throw new Error('refused');
          await ops.activities.heartbeat(begun.token, 30_000);
          await ops.activities.end(begun.token);
        }),
      );
    }
    const per = perOperation(await measured(), cycles * 3);
    return { cpu_us_per_call: per.cpu_us, script_us_per_call: per.script_us, cycles };
  } finally {
    await ops.close();
    await deleteKeysUnder(redis, prefix);
    redis.disconnect();
  }
}
