import { statSync } from 'node:fs';
import { relative } from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/**
 * The files that take longest (wall time in a full run here, docs/testing.md), most first:
 * they start first, so none of them starts last and keeps the run going alone at its end. A
 * clean clone has no timings of its own for vitest to sort by. The two that keep the CPU busy
 * (project `busy`) run first, on their own (vitest.config.ts); then the stuck-stop default's one
 * test, which mostly waits (30 s of a stop budget), starts with the longest of the rest.
 * Below those, a file that mostly waits (fencing, pacing) follows one that keeps the CPU busy
 * (partitioned, bounded-recovery), so that fewer of the busy ones run at once. The rest follow,
 * largest first.
 */
const LONGEST = [
  'busy:test/lane-model.test.ts',
  'busy:test/chaos.test.ts',
  'redis:test/stuck-stop-default.test.ts',
  'redis:test/paperclip-plugin.test.ts',
  'redis:test/quick-start.test.ts',
  'cluster:test/partitioned.test.ts',
  'cluster:test/fencing.test.ts',
  'redis:test/partitioned.test.ts',
  'redis:test/fencing.test.ts',
  'redis:test/attack/bounded-recovery.test.ts',
  'redis:test/pacing.test.ts',
  'redis:test/walk-threads.test.ts',
  'redis:test/worker-process.test.ts',
  'redis:test/package.test.ts',
  'redis:test/neighbours.test.ts',
  'redis:test/settle-wait.test.ts',
  'redis:test/attack/stuck-stops.test.ts',
  'redis:test/provider-instances-processes.test.ts',
  'redis:test/cli.test.ts',
  'redis:test/attack/security.test.ts',
  'redis:test/acquire-leaks.test.ts',
  'redis:test/attack/third-attack.test.ts',
  'redis:test/failover.test.ts',
];

export default class LongestFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const root = this.ctx.config.root;
    const key = (f: TestSpecification) => `${f.project.name}:${relative(root, f.moduleId)}`;
    const rank = (f: TestSpecification) => {
      const i = LONGEST.indexOf(key(f));
      return i === -1 ? LONGEST.length : i;
    };
    const size = (f: TestSpecification) => statSync(f.moduleId).size;
    return [...files].sort((a, b) => rank(a) - rank(b) || size(b) - size(a));
  }
}
