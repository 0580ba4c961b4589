import type { Config } from './config.ts';
import { createLogger, type Logger } from './logger.ts';
import { loadProviders } from './providers/registry.ts';
import { LeaseWorker } from './queues/worker.ts';

export function loggerFor(config: Config, name = 'lease-ops'): Logger {
  return createLogger({ level: config.LEASE_OPS_LOG_LEVEL, name });
}

/** Starts one worker replica with the configured providers. */
export async function startWorker(config: Config, log: Logger): Promise<LeaseWorker> {
  const providers = await loadProviders(config.LEASE_OPS_PROVIDERS);
  const worker = new LeaseWorker(config, providers, log);
  await worker.start();
  log.info({ providers: providers.names(), concurrency: config.LEASE_OPS_CONCURRENCY }, 'worker started');
  return worker;
}

/**
 * SIGTERM and SIGINT stop gracefully: no new jobs, running ones finish, then exit.
 * A second signal exits at once; BullMQ's stalled-job handling then recovers the jobs.
 */
export function exitOnSignals(log: Logger, stop: () => Promise<void>): void {
  let stopping = false;
  const onSignal = (signal: NodeJS.Signals) => {
    if (stopping) {
      log.warn({ signal }, 'second signal: exiting now');
      process.exit(130);
    }
    stopping = true;
    log.info({ signal }, 'stopping gracefully');
    stop().then(
      () => process.exit(0),
      (err: unknown) => {
        log.error({ err }, 'error while stopping');
        process.exit(1);
      },
    );
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
}
