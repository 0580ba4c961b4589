import { writeFileSync } from 'node:fs';
import type { Reporter, TestModule } from 'vitest/node';
import { FILE_TIMES_PATH } from './longest-first.ts';

/**
 * Writes each file's time in this run (its tests' and hooks', by project, in seconds) to
 * test/helpers/file-times.json, which the sequencer orders a run by (longest-first.ts). Run a
 * full `npm run test -- --reporter=default --reporter=./test/helpers/record-times.ts` on an idle
 * machine after adding or much changing a slow file. A filtered run writes nothing: the file
 * must list every file.
 */
export default class RecordTimes implements Reporter {
  onTestRunEnd(testModules: ReadonlyArray<TestModule>): void {
    if (testModules.length < 50) {
      process.stdout.write(`record-times: ${testModules.length} files ran, fewer than a full run: ${FILE_TIMES_PATH} left as it was\n`);
      return;
    }
    const times = [...testModules]
      .map((mod) => [`${mod.project.name}:${mod.relativeModuleId}`, Math.round(mod.diagnostic().duration / 100) / 10] as const)
      .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    writeFileSync(FILE_TIMES_PATH, `${JSON.stringify(Object.fromEntries(times), null, 2)}\n`);
    process.stdout.write(`record-times: ${times.length} files' times written to ${FILE_TIMES_PATH}\n`);
  }
}
