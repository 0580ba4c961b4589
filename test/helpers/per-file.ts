import { registry } from '../../src/metrics.ts';

// Files share their worker process and its modules (isolate: false in vitest.config.ts): the
// process's metrics start at zero for each file, as they would in a process of its own.
registry.resetMetrics();
