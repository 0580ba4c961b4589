import { Command } from 'commander';
import { ConfigError, loadConfig } from './config.ts';
import { exitOnSignals, loggerFor, serveWorkerMetrics, startWorker } from './runtime.ts';

import type { EnqueueCliOptions, StatusCliOptions } from './cli-commands.ts';
import { OPERATIONS } from './operations.ts';

const program = new Command()
  .name('lease-ops')
  .description('Runs sandbox lease lifecycles as BullMQ jobs: one operation at a time per lease, in order, across replicas.')
  .showHelpAfterError();

program
  .command('worker')
  .description('run one worker replica (start as many as you like); configured by environment variables')
  .action(async () => {
    const config = loadConfig();
    const log = loggerFor(config, 'lease-ops-worker');
    const worker = await startWorker(config, log);
    const metrics = await serveWorkerMetrics(config, worker, log);
    exitOnSignals(log, async () => {
      metrics?.close();
      await worker.close();
    });
  });

program
  .command('api')
  .description('serve the HTTP API, Bull Board (/board), /metrics, /healthz and /readyz; needs LEASE_OPS_API_TOKENS')
  .action(async () => {
    const config = loadConfig();
    if (config.LEASE_OPS_API_TOKENS.length === 0) {
      throw new ConfigError('invalid configuration:\n  LEASE_OPS_API_TOKENS="": the API needs at least one token (comma-separated, 16+ characters)');
    }
    const log = loggerFor(config, 'lease-ops-api');
    const { startApiServer } = await import('./api/server.ts');
    const api = await startApiServer(config, log);
    process.stdout.write(`lease-ops API on ${api.url}/v1, Bull Board on ${api.url}/board, metrics on ${api.url}/metrics\n`);
    exitOnSignals(log, () => api.close());
  });

program
  .command('enqueue')
  .description('enqueue one operation for a lease and print its job id (or wait for its result)')
  .argument('<op>', `one of ${OPERATIONS.join(', ')}`)
  .requiredOption('--provider <name>', 'provider key, e.g. daytona')
  .requiredOption('--company <id>', 'company id')
  .requiredOption('--environment <id>', 'environment id')
  .requiredOption('--lease <id>', "the provider's sandbox id (for acquire: the id you choose for the lease)")
  .option('--params <json>', 'the operation parameters as JSON', '{}')
  .option('--deadline-ms <ms>', 'deadline in ms after acceptance')
  .option('--idempotency-key <key>', 'the same key returns the same operation for 24 h')
  .option('--wait [ms]', 'wait for the operation to end (default 60000 ms) and print it')
  .action(async (op: string, opts: EnqueueCliOptions) => {
    const { runEnqueue } = await import('./cli-commands.ts');
    process.exitCode = await runEnqueue(op, opts);
  });

program
  .command('status')
  .description('show a lease (its lane, last observed state, last failure) or, with no lease, the whole queue at a glance')
  .option('--provider <name>', 'provider key')
  .option('--company <id>', 'company id')
  .option('--environment <id>', 'environment id')
  .option('--lease <id>', 'lease id')
  .option('--json', 'print JSON instead of text')
  .action(async (opts: StatusCliOptions) => {
    const { runStatus } = await import('./cli-commands.ts');
    process.exitCode = await runStatus(opts);
  });

program
  .command('start')
  .description('all in one: worker, simulated cloud, HTTP API with Bull Board and metrics; plays a lease lifecycle over the API, then serves')
  .option('--once', 'exit after the demo lifecycle instead of serving')
  .action(async (opts: { once?: boolean }) => {
    const { runStart } = await import('./start.ts');
    await runStart({ once: Boolean(opts.once) });
  });

program
  .command('demo')
  .description('replay the stuck-stop incident against the local Daytona fake, with and without the watchdog')
  .option('--quick', 'a tenth of the real timings (3 s budget instead of 30 s)')
  .action(async (opts: { quick?: boolean }) => {
    const { runDemo } = await import('./demo.ts');
    await runDemo({ quick: Boolean(opts.quick) });
  });

program
  .command('simulated-cloud')
  .description('run the simulated cloud (a local Daytona API) for several worker processes to share')
  .option('--port <port>', 'port to listen on', '4100')
  .option('--host <host>', 'address to listen on (0.0.0.0 for other hosts or containers)', '127.0.0.1')
  .action(async (opts: { port: string; host: string }) => {
    const { runSimulatedCloud } = await import('./providers/simulated/index.ts');
    const fake = await runSimulatedCloud(Number(opts.port), opts.host);
    process.stdout.write(`simulated cloud listening on ${fake.http.url}; workers use LEASE_OPS_SIMULATED_URL=${fake.http.url}\n`);
    const stop = () => void fake.close().then(() => process.exit(0));
    process.on('SIGTERM', stop);
    process.on('SIGINT', stop);
  });

program
  .command('bench')
  .description('measure lanes against plain BullMQ on this machine and print the figures')
  .option('--json', 'print one JSON object instead of a table')
  .option('--quick', 'smaller loads, for a fast look')
  .action(async (opts: { json?: boolean; quick?: boolean }) => {
    const { runBench } = await import('../bench/bench.ts');
    await runBench({ json: Boolean(opts.json), quick: Boolean(opts.quick) });
  });

try {
  await program.parseAsync(process.argv);
} catch (err) {
  if (err instanceof ConfigError) {
    process.stderr.write(`lease-ops: ${err.message}\n`);
    process.exit(2);
  }
  throw err;
}
