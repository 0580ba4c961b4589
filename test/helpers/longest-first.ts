import { readFileSync, statSync } from 'node:fs';
import { relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/** Each file's time in a full run here (seconds, by project), written by record-times.ts. */
export const FILE_TIMES_PATH = fileURLToPath(new URL('./file-times.json', import.meta.url));

/**
 * A file the times do not list yet (a new one) is taken to last this long: early enough that a
 * slow new file does not start last and keep the run going alone at its end.
 */
const UNLISTED_S = 10;

/**
 * The files that take longest start first (by the times of a full run here, file-times.json:
 * a clean clone has no timings of its own for vitest to sort by), so none of them starts last
 * and keeps the run going alone at its end; among files of equal time (or none listed), the
 * larger first. Which files run together at all is the projects' order (vitest.config.ts).
 */
export default class LongestFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const times = JSON.parse(readFileSync(FILE_TIMES_PATH, 'utf8')) as Record<string, number>;
    const root = this.ctx.config.root;
    const seconds = (f: TestSpecification) => times[`${f.project.name}:${relative(root, f.moduleId)}`] ?? UNLISTED_S;
    const size = (f: TestSpecification) => statSync(f.moduleId).size;
    return [...files].sort((a, b) => seconds(b) - seconds(a) || size(b) - size(a));
  }
}
