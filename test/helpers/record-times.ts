import { existsSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Reporter, TestModule, TestRunEndReason, Vitest } from 'vitest/node';
import { FILE_TIMES_PATH, readFileTimes } from './longest-first.ts';

/**
 * Writes each file's time in this run (its tests' and hooks', by project, in seconds) to
 * test/helpers/file-times.json, which the sequencer orders a run by (longest-first.ts). Run
 * `npm run test -- --reporter=default --reporter=./test/helpers/summary-reporter.ts --reporter=./test/helpers/record-times.ts`
 * on an otherwise idle machine after adding or much changing a slow file. Only a whole run that
 * passed is written: a test-name filter or a failure changes files' times (a timeout counted
 * in), and a run of some files or projects would leave the others out (helper-66). Files that
 * no longer exist leave the list.
 */
export default class RecordTimes implements Reporter {
  private vitest: Vitest | null = null;

  onInit(vitest: Vitest): void {
    this.vitest = vitest;
  }

  onTestRunEnd(testModules: ReadonlyArray<TestModule>, _errors: unknown, reason: TestRunEndReason): void {
    const root = this.vitest?.config.root ?? process.cwd();
    const times = new Map<string, number>(testModules.map((mod) => [`${mod.project.name}:${mod.relativeModuleId}`, Math.round(mod.diagnostic().duration / 100) / 10] as const));
    const before = existsSync(FILE_TIMES_PATH) ? readFileTimes() : {};
    const missing = Object.keys(before).filter((key) => !times.has(key) && existsSync(join(root, key.slice(key.indexOf(':') + 1))));
    const refusal =
      reason !== 'passed'
        ? `the run ${reason === 'interrupted' ? 'was interrupted' : 'failed'}`
        : this.vitest?.config.testNamePattern
          ? 'a test-name filter was set'
          : testModules.some((mod) => mod.state() !== 'passed')
            ? 'a file did not pass (skipped or failed)'
            : missing.length > 0
              ? `${missing.length} listed files did not run (${missing.slice(0, 3).join(', ')}${missing.length > 3 ? ', ...' : ''})`
              : null;
    if (refusal) {
      process.stdout.write(`record-times: ${refusal}: ${FILE_TIMES_PATH} left as it was\n`);
      return;
    }
    const sorted = [...times].sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    writeFileSync(FILE_TIMES_PATH, `${JSON.stringify(Object.fromEntries(sorted), null, 2)}\n`);
    process.stdout.write(`record-times: ${sorted.length} files' times written to ${FILE_TIMES_PATH}\n`);
  }
}
