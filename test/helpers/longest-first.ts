import { readFileSync, statSync } from 'node:fs';
import { relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/** Each file's time in a full run here (seconds, by project), written by record-times.ts. */
export const FILE_TIMES_PATH = fileURLToPath(new URL('./file-times.json', import.meta.url));

/** The times file as a map of `project:file` to seconds. */
export function readFileTimes(): Record<string, number> {
  return JSON.parse(readFileSync(FILE_TIMES_PATH, 'utf8')) as Record<string, number>;
}

/**
 * A file the times do not list yet (a new one) is taken to last this long: early enough that a
 * slow new file does not start last and keep the run going alone at its end.
 */
const UNLISTED_S = 10;

/**
 * Files that keep about a core busy for most of their time (processes they start, npm and tsc,
 * CPU-bound checks): measured alone on 2026-12-08, CPU time over wall time 0.65 or more. Two of
 * them started together slow each other down (the quick start took 51-63 s beside the packed
 * package, 34-44 s when they started apart).
 */
const BUSY = new Set([
  'test/quick-start.test.ts',
  'test/package.test.ts',
  'test/partitioned.test.ts',
  'test/lane-model.test.ts',
  'test/walk-threads.test.ts',
  'test/nothing-silent.test.ts',
  'test/acquire-leaks.test.ts',
  'test/cli.test.ts',
  'test/provider-instances-processes.test.ts',
  'test/worker-process.test.ts',
  'test/fail-fast.test.ts',
  'test/attack/nothing-lost.test.ts',
  'test/multi-process.test.ts',
  'test/daytona-e2e.test.ts',
]);

/**
 * The files that take longest start first (by the times of a full run here, file-times.json:
 * a clean clone has no timings for vitest to sort by), so none of them starts last and keeps
 * the run going alone at its end; among files of equal time (or none listed), the larger
 * first. A busy file does not start right after another busy one, nor one after next, while
 * a file that mostly waits is left to go between them. Which files run together at all is the
 * projects' order (vitest.config.ts).
 */
export default class LongestFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const times = readFileTimes();
    const root = this.ctx.config.root;
    const seconds = (f: TestSpecification) => times[`${f.project.name}:${relative(root, f.moduleId)}`] ?? UNLISTED_S;
    const size = (f: TestSpecification) => statSync(f.moduleId).size;
    const busy = (f: TestSpecification) => BUSY.has(relative(root, f.moduleId));
    // Files of a later group (sequence.groupOrder) run only after the earlier group's: the
    // spacing below is among the files that run together.
    const group = (f: TestSpecification) => f.project.config.sequence.groupOrder ?? 0;
    const left = [...files].sort((a, b) => group(a) - group(b) || seconds(b) - seconds(a) || size(b) - size(a));
    const order: TestSpecification[] = [];
    while (left.length) {
      // A busy file starts only when neither of the last two started in its group is busy: at
      // most one busy file in any three in a row (the start order; busy files may still overlap).
      const first = left[0]!;
      const sameGroup = (f: TestSpecification) => group(f) === group(first);
      const spaced = busy(first) && order.slice(-2).filter(sameGroup).some(busy) ? left.findIndex((f) => sameGroup(f) && !busy(f)) : 0;
      const i = Math.max(0, spaced);
      order.push(...left.splice(i, 1));
    }
    return order;
  }
}
