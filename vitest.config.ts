import { defineConfig } from 'vitest/config';
import LongestFirst from './test/helpers/longest-first.ts';

// The suites that cover the lane, retries, fencing and the watchdog run twice: against the
// shared Redis, and against a local 3-master Redis Cluster that the `cluster` project starts.
const ON_CLUSTER = ['test/partitioned.test.ts', 'test/lane.test.ts', 'test/lane-scripts.test.ts', 'test/fencing.test.ts', 'test/watchdog.test.ts', 'test/on-cluster.test.ts'];

export default defineConfig({
  // Vite's caches outside node_modules: a folder created there makes npm's record of the
  // installed tree look stale, and the next `npx` walks all of node_modules to rebuild it.
  cacheDir: '.cache/vite',
  test: {
    // Files two at a time on two cores, the longest first: much of a test's time is spent
    // waiting (on a worker, a deadline, a child process), and every test has a prefix of its own
    // in the shared Redis (tests that restart or count a whole Redis start their own). Four ran
    // the suite in 379-409 s but failed 3 runs of 7 on CI's machine, a different test each time
    // (docs/testing.md): the run is bound by CPU, and four files at once starve it.
    fileParallelism: true,
    // Two on 2026-12-07: on a slower day of the same machine class, three files at once failed
    // 1-3 timing bounds in every clean-clone run (524-564 s), a different one each time.
    maxWorkers: 2,
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
      { extends: true, test: { name: 'redis', include: ['test/**/*.test.ts'], exclude: ['test/on-cluster.test.ts'], globalSetup: ['test/helpers/build-setup.ts'] } },
      { extends: true, test: { name: 'cluster', include: ON_CLUSTER, globalSetup: ['test/helpers/build-setup.ts', 'test/helpers/cluster-setup.ts'] } },
    ],
  },
});
