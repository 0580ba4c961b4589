import type { Redis } from 'ioredis';

/** What Redis spent on a stretch of work: its CPU time (INFO cpu) and its commands (INFO commandstats). */
export interface RedisCost {
  /** used_cpu_user + used_cpu_sys, summed over the nodes. */
  cpuSeconds: number;
  /** Calls and time of every command; a script's inner commands are counted in both the script's and their own. */
  commands: Record<string, { calls: number; usec: number }>;
}

async function snapshot(nodes: Redis[]): Promise<RedisCost> {
  const cost: RedisCost = { cpuSeconds: 0, commands: {} };
  for (const node of nodes) {
    const [cpu, stats] = await Promise.all([node.info('cpu'), node.info('commandstats')]);
    cost.cpuSeconds += Number(/used_cpu_user:([\d.]+)/.exec(cpu)?.[1] ?? 0) + Number(/used_cpu_sys:([\d.]+)/.exec(cpu)?.[1] ?? 0);
    for (const [, name, calls, usec] of stats.matchAll(/^cmdstat_([^:]+):calls=(\d+),usec=(\d+)/gm)) {
      const c = (cost.commands[name!] ??= { calls: 0, usec: 0 });
      c.calls += Number(calls);
      c.usec += Number(usec);
    }
  }
  return cost;
}

/** Starts measuring; the function returned gives what Redis spent since. */
export async function measureRedis(nodes: Redis[]): Promise<() => Promise<RedisCost>> {
  const before = await snapshot(nodes);
  return async () => {
    const after = await snapshot(nodes);
    const commands: RedisCost['commands'] = {};
    for (const [name, c] of Object.entries(after.commands)) {
      const calls = c.calls - (before.commands[name]?.calls ?? 0);
      if (calls > 0) commands[name] = { calls, usec: c.usec - (before.commands[name]?.usec ?? 0) };
    }
    return { cpuSeconds: after.cpuSeconds - before.cpuSeconds, commands };
  };
}

const SCRIPT_COMMANDS = ['evalsha', 'eval', 'evalsha_ro', 'eval_ro', 'fcall'];

/**
 * Per operation: Redis CPU (µs), scripts run, their time (µs), and commands run, inside
 * scripts or not (the scripts themselves not counted). Unlike the times, the command count
 * does not move with the machine's load: a step added to every operation shows in it at once.
 */
export function perOperation(cost: RedisCost, operations: number): { cpu_us: number; scripts: number; script_us: number; commands: number } {
  const scripts = SCRIPT_COMMANDS.map((n) => cost.commands[n] ?? { calls: 0, usec: 0 });
  const commands = Object.entries(cost.commands).reduce((n, [name, c]) => (SCRIPT_COMMANDS.includes(name) ? n : n + c.calls), 0);
  return {
    cpu_us: Number(((cost.cpuSeconds * 1e6) / operations).toFixed(1)),
    scripts: Number((scripts.reduce((n, s) => n + s.calls, 0) / operations).toFixed(2)),
    script_us: Number((scripts.reduce((n, s) => n + s.usec, 0) / operations).toFixed(1)),
    commands: Number((commands / operations).toFixed(1)),
  };
}
