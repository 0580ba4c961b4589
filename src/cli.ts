import { Command } from 'commander';
import { ConfigError, loadConfig } from './config.ts';
import { exitOnSignals, loggerFor, startWorker } from './runtime.ts';

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
    exitOnSignals(log, () => worker.close());
  });

program
  .command('start')
  .description('run a worker on the embedded simulated cloud and play a short lease lifecycle through it')
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
  .option('--port <port>', 'port on 127.0.0.1', '4100')
  .action(async (opts: { port: string }) => {
    const { runSimulatedCloud } = await import('./providers/simulated/index.ts');
    const fake = await runSimulatedCloud(Number(opts.port));
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
