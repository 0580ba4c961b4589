import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    // The suites share one Redis and two cores; running files one at a time keeps the
    // multi-process tests' timing honest.
    fileParallelism: false,
    testTimeout: 60_000,
    reporters: ['default', './test/helpers/summary-reporter.ts'],
    hookTimeout: 30_000,
  },
});
