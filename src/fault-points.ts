import type { RedisClient } from './queues/redis.ts';

/**
 * Named steps in an attempt's life (and one in an enqueue, one in a change of the partition count, one in a worker's close, one at the end of an API walk, one after a walk thread's Redis command is sent, two in a probe's or exec's pass-on, two in the watchdog's queueing of a force-stop) where the crash tests stop or
 * break a process at exactly that step (test/attack/*): `LEASE_OPS_FAULT_POINTS="after-release=kill"`, several
 * comma separated, each optionally limited to its first N hits (`=kill*1`). Without that
 * variable every point is a no-op costing one boolean check. Not a setting for production.
 *
 * Actions:
 *   kill         SIGKILL this process (after a line on stderr saying so)
 *   pause        SIGSTOP this process; the test sends SIGCONT
 *   redis-error  one real error reply from Redis (an unknown command on the given client)
 *   stall        block the event loop for 3 s, or `stall@<ms>` for that long (a long GC, a
 *                starved loop); the thread sleeps meanwhile, so other processes keep the CPU
 *
 * Every hit writes `lease-ops fault point <name>: <action>` to stderr first, so a test can
 * wait for that line.
 */
export type FaultPoint =
  | 'enqueue-after-key'
  | 'lane-acquire'
  | 'after-lane-acquire'
  | 'before-provider-call'
  | 'after-provider-call'
  | 'settle-wait'
  | 'lane-yield'
  | 'after-lane-yield'
  | 'before-acquire-release'
  | 'refused-end'
  | 'after-release'
  | 'before-park'
  | 'lane-park'
  | 'after-park-move'
  | 'close-wake-up'
  | 'partitions-after-copies'
  | 'walk'
  | 'walk-command-sent'
  | 'pass-on-before-move'
  | 'pass-on-moved'
  | 'watchdog-claimed'
  | 'watchdog-queued';

type Action = 'kill' | 'pause' | 'redis-error' | 'stall';

const configured = new Map<string, { action: Action; left: number; stallMs: number }>();
for (const entry of (process.env.LEASE_OPS_FAULT_POINTS ?? '').split(',').map((s) => s.trim()).filter(Boolean)) {
  const m = /^([a-z-]+)=(kill|pause|redis-error|stall)(?:@(\d+))?(?:\*(\d+))?$/.exec(entry);
  if (!m) throw new Error(`LEASE_OPS_FAULT_POINTS: cannot read "${entry}" (expected point=kill|pause|redis-error|stall[@ms][*count])`);
  configured.set(m[1]!, { action: m[2] as Action, left: m[4] ? Number(m[4]) : Number.POSITIVE_INFINITY, stallMs: m[3] ? Number(m[3]) : 3_000 });
}

/** True when any fault point is armed. */
export const faultPointsArmed = configured.size > 0;

/** Whether this point is armed: a caller may then take a slower path that makes the step observable. */
export function faultPointArmed(name: FaultPoint): boolean {
  return configured.has(name);
}

/** Acts on the named point if it is armed (see above). `redis` is the client a `redis-error` fails. */
export async function faultPoint(name: FaultPoint, redis?: RedisClient): Promise<void> {
  if (!faultPointsArmed) return;
  const point = configured.get(name);
  if (!point || point.left <= 0) return;
  point.left--;
  process.stderr.write(`lease-ops fault point ${name}: ${point.action}\n`);
  switch (point.action) {
    case 'kill':
      process.kill(process.pid, 'SIGKILL');
      await new Promise(() => undefined);
      return;
    case 'pause':
      process.kill(process.pid, 'SIGSTOP');
      return;
    case 'stall':
      // Asleep: nothing else in this thread runs, lock renewals included, and it takes no CPU
      // (a busy loop held a core of CI's two for each stall of the tests that run at once).
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, point.stallMs);
      return;
    case 'redis-error':
      if (!redis) throw new Error(`fault point ${name} has no Redis client to fail`);
      await redis.call('LEASE-OPS-FAULT-POINT');
  }
}
