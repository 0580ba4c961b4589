import { defineConfig } from 'vitest/config';
import LongestFirst from './test/helpers/longest-first.ts';

// The suites that cover the lane, retries, fencing and the watchdog run twice: against the
// shared Redis, and against a local 3-master Redis Cluster that the `cluster` project starts.
const ON_CLUSTER = ['test/partitioned.test.ts', 'test/lane.test.ts', 'test/lane-scripts.test.ts', 'test/fencing.test.ts', 'test/watchdog.test.ts', 'test/on-cluster.test.ts'];
// The chaos campaign runs first, beside two files that mostly wait about as long (a fifth of a
// core each: the stuck-stop default's 30 s stop budget, pacing's rate-limit holds) and nothing
// busy: under load past two busy files it caught the fencing limit docs/reliability.md names,
// and beside the lane model (a core of its own) it took half as long again while both cores
// were full, then left them idle in its second half, which waits on locks and outages. The
// rest, the lane model among them, then run three at a time.
const FIRST = ['test/chaos.test.ts', 'test/stuck-stop-default.test.ts', 'test/pacing.test.ts'];

export default defineConfig({
  // Vite's caches outside node_modules: a folder created there makes npm's record of the
  // installed tree look stale, and the next `npx` walks all of node_modules to rebuild it.
  cacheDir: '.cache/vite',
  test: {
    // Files in parallel on two cores, the longest first: much of a test's time is spent waiting
    // (on a worker, a deadline, a child process), and every test has a prefix of its own in the
    // shared Redis (tests that restart or count a whole Redis start their own). Two files at a
    // time left a quarter of the CPU idle (2026-12-07: 512-518 s here, 76 % busy); three at once
    // after the two busy files (the projects below) took 435 s, 91 % busy, and passed beside a
    // two-core CPU hog. Four failed 3 runs of 7 on CI's machine, a different test each time
    // (docs/testing.md).
    fileParallelism: true,
    maxWorkers: 3,
    // A worker process runs file after file with the modules it has loaded (no process started,
    // and no BullMQ, express or zod loaded again, per file): every test has its own key prefix
    // and closes what it opens; the process's metrics are reset for each file (per-file.ts).
    isolate: false,
    sequence: { sequencer: LongestFirst },
    setupFiles: ['test/helpers/per-file.ts'],
    testTimeout: 60_000,
    reporters: ['default', './test/helpers/summary-reporter.ts'],
    hookTimeout: 30_000,
    projects: [
      { extends: true, test: { name: 'first', include: FIRST, maxWorkers: 3, sequence: { groupOrder: 0 }, globalSetup: ['test/helpers/build-setup.ts'] } },
      { extends: true, test: { name: 'redis', include: ['test/**/*.test.ts'], exclude: ['test/on-cluster.test.ts', ...FIRST], maxWorkers: 3, sequence: { groupOrder: 1 }, globalSetup: ['test/helpers/build-setup.ts'] } },
      { extends: true, test: { name: 'cluster', include: ON_CLUSTER, maxWorkers: 3, sequence: { groupOrder: 1 }, globalSetup: ['test/helpers/build-setup.ts', 'test/helpers/cluster-setup.ts'] } },
    ],
  },
});
