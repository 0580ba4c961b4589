import type { Reporter, TestModule } from 'vitest/node';

/** How many of the slowest files the summary names. */
const SLOWEST = 8;

/**
 * Ends the run with the files that took longest (their tests' and hooks' time, by project), so
 * a change that slows the loop shows where, then one plain line, `N passed, N failed, N
 * skipped`, that any CI can read (a file that failed outside its tests counts one failure).
 */
export default class SummaryReporter implements Reporter {
  onTestRunEnd(testModules: ReadonlyArray<TestModule>): void {
    let passed = 0;
    let failed = 0;
    let skipped = 0;
    for (const mod of testModules) {
      let failedHere = 0;
      for (const test of mod.children.allTests()) {
        const state = test.result().state;
        if (state === 'passed') passed++;
        else if (state === 'failed') failedHere++;
        else skipped++;
      }
      // A file that failed outside its tests (a hook, its import) counts one failure: its tests
      // were skipped, and the line said "0 failed" of a failed run (helper-65).
      failed += failedHere || (mod.state() === 'failed' ? 1 : 0);
    }
    const slowest = [...testModules]
      .map((mod) => ({ name: `${mod.project.name}:${mod.relativeModuleId}`, ms: mod.diagnostic().duration }))
      .sort((a, b) => b.ms - a.ms)
      .slice(0, SLOWEST);
    if (slowest.length > 1) process.stdout.write(`\nslowest files:\n${slowest.map((f) => `  ${(f.ms / 1000).toFixed(1).padStart(6)} s  ${f.name}`).join('\n')}\n`);
    process.stdout.write(`\n${passed} passed, ${failed} failed, ${skipped} skipped\n`);
  }
}
