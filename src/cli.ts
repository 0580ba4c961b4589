import { Command, CommanderError } from 'commander';
import { ConfigError, loadConfig } from './config.ts';
import { RedisUnavailableError } from './errors.ts';
import { LayoutError } from './queues/layout.ts';

import type { ActivityCliOptions, EnqueueCliOptions, StatusCliOptions } from './cli-commands.ts';
import type { ProviderCliOptions } from './cli-providers.ts';
import { OPERATIONS } from './operations.ts';
import { VERSION } from './version.ts';

const program = new Command()
  .name('lease-ops')
  .description('Runs sandbox lease lifecycles as BullMQ jobs: one operation at a time per lease, in order, across replicas.')
  .version(VERSION, '-V, --version', 'print the version')
  .showHelpAfterError()
  // Commander's own exits (a missing option, --help) go through the catch at the end.
  .exitOverride();

program
  .command('worker')
  .description('run one worker replica (start as many as you like); configured by environment variables')
  .action(async () => {
    const config = loadConfig();
    // Loaded only by the commands that run a worker or the API: `--version` took 0.8 s of CPU with it, 0.24 s without.
    const { exitEarlyOnSignals, loggerFor, serveWorkerMetrics, startWorker } = await import('./runtime.ts');
    const log = loggerFor(config, 'lease-ops-worker');
    const handOver = exitEarlyOnSignals();
    const worker = await startWorker(config, log);
    const metrics = await serveWorkerMetrics(config, worker, log);
    handOver({
      log,
      stop: async () => {
        metrics?.close();
        await worker.close();
      },
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
    const { exitEarlyOnSignals, loggerFor, reportRedisTrouble } = await import('./runtime.ts');
    const log = loggerFor(config, 'lease-ops-api');
    reportRedisTrouble(config, log);
    const { startApiServer } = await import('./api/server.ts');
    const handOver = exitEarlyOnSignals();
    const api = await startApiServer(config, log);
    process.stdout.write(`lease-ops API on ${api.url}/v1, Bull Board on ${api.url}/board, metrics on ${api.url}/metrics\n`);
    handOver({ log, stop: () => api.close() });
  });

program
  .command('enqueue')
  .description('enqueue one operation for a lease and print its job id (or wait for its result)')
  .argument('<op>', `one of ${OPERATIONS.join(', ')}`)
  .requiredOption('--provider <name>', 'provider key, e.g. daytona')
  .requiredOption('--company <id>', 'company id')
  .requiredOption('--environment <id>', 'environment id')
  .requiredOption('--lease <id>', 'the lease: the id its acquire was enqueued under, or its sandbox id (for acquire: the id you choose)')
  .option('--params <json>', "the operation parameters as JSON (providerLeaseId defaults to the lease's sandbox)", '{}')
  .option('--deadline-ms <ms>', 'deadline in ms after acceptance')
  .option('--idempotency-key <key>', 'the same key returns the same operation for 24 h')
  .option('--wait [ms]', 'wait for the operation to end (default 60000 ms) and print it')
  .option('--json', 'print one JSON document (the receipt, and with --wait the operation)')
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
  .command('partitions')
  .description("show the deployment's partition count and each partition's lanes, jobs and workers; --set changes the count once nothing runs (docs/scaling.md)")
  .option('--set <count>', 'the new partition count (refused while any partition has workers, open lanes or jobs)')
  .option('--json', 'print JSON instead of text')
  .action(async (opts: { set?: string; json?: boolean }) => {
    const { runPartitions } = await import('./cli-commands.ts');
    process.exitCode = await runPartitions(opts);
  });

for (const action of ['cancel', 'rerun'] as const) {
  program
    .command(`${action} <jobId>`)
    .description(
      action === 'cancel'
        ? 'cancel a queued or backing-off operation: it leaves its lane and fails with code cancelled (never one executing); exit 1 when refused'
        : 'run a failed operation again, at the tail of its lane, with its original time budget from now; exit 1 when refused',
    )
    .option('--json', 'print JSON instead of text')
    .action(async (jobId: string, opts: { json?: boolean }) => {
      const { runOperatorAction } = await import('./cli-commands.ts');
      process.exitCode = await runOperatorAction(action, jobId, opts);
    });
}
const LEASE_ACTIONS = {
  pause: "pause a lease's lane: the executing operation finishes, nothing new starts until unpause",
  unpause: "unpause a lease's lane: its head goes to the workers",
  ack: "acknowledge a lease's failures: they leave the attention list (each also leaves when that kind of operation next succeeds)",
} as const;
for (const action of ['pause', 'unpause', 'ack'] as const) {
  program
    .command(action)
    .description(LEASE_ACTIONS[action])
    .requiredOption('--provider <name>', 'provider key')
    .requiredOption('--company <id>', 'company id')
    .requiredOption('--environment <id>', 'environment id')
    .requiredOption('--lease <id>', 'lease id')
    .option('--json', 'print JSON instead of text')
    .action(async (opts: StatusCliOptions) => {
      const { runOperatorAction } = await import('./cli-commands.ts');
      process.exitCode = await runOperatorAction(action, undefined, opts);
    });
}

const activity = program.command('activity').description('activity gates: work inside a sandbox that its stops, releases and destroys wait for');
const leaseActivityOptions = (command: Command) =>
  command
    .requiredOption('--provider <name>', 'provider key')
    .requiredOption('--company <id>', 'company id')
    .requiredOption('--environment <id>', 'environment id')
    .requiredOption('--lease <id>', 'the lease, by its sandbox id or the id its acquire was enqueued under')
    .requiredOption('--kind <kind>', 'what runs: exec, sync, ...')
    .option('--ttl-ms <ms>', 'how long it lives without a heartbeat', '30000')
    .option('--json', 'print JSON instead of text');
leaseActivityOptions(activity.command('begin'))
  .description('begin an activity on a lease and print its token; refused (exit 1) while a stop, release or destroy of the lease is queued or runs')
  .action(async (opts: ActivityCliOptions) => {
    const { runActivity } = await import('./cli-commands.ts');
    process.exitCode = await runActivity('begin', undefined, opts);
  });
leaseActivityOptions(activity.command('run'))
  .description('begin an activity, run the command after -- while heartbeating it (SIGTERM to it once a stop asks to cancel), end it when the command exits; exits with its code')
  .argument('<command...>', 'the command and its arguments')
  .action(async (command: string[], opts: ActivityCliOptions) => {
    const { runActivity } = await import('./cli-commands.ts');
    process.exitCode = await runActivity('run', undefined, opts, command);
  });
activity
  .command('heartbeat <token>')
  .description('keep an activity open for --ttl-ms more; says whether a stop asked it to cancel; exit 1 once it is gone')
  .option('--ttl-ms <ms>', 'how long from now it lives without another heartbeat', '30000')
  .option('--json', 'print JSON instead of text')
  .action(async (token: string, opts: ActivityCliOptions) => {
    const { runActivity } = await import('./cli-commands.ts');
    process.exitCode = await runActivity('heartbeat', token, opts);
  });
activity
  .command('end <token>')
  .description('end an activity: what waits for it goes on; exit 1 when it was gone')
  .action(async (token: string) => {
    const { runActivity } = await import('./cli-commands.ts');
    process.exitCode = await runActivity('end', token, { ttlMs: '30000' });
  });

const providers = program.command('providers').description("provider instances saved at run time (a company's own Daytona or CreateOS key and settings); keys are read from a variable or stdin, never from the command line");
const saveOptions = (command: Command) =>
  command
    .requiredOption('--company <id>', 'the company it belongs to')
    .option('--environments <ids>', 'comma-separated environments whose leases may use it (default: all of the company)')
    .option('--config <json>', 'the provider settings as JSON, e.g. {"snapshot":"agent","autoStopMinutes":30}')
    .option('--api-key-env <var>', 'the environment variable that holds the API key')
    .option('--api-key-stdin', 'read the API key from standard input')
    .option('--no-probe', 'save without asking the service whether it takes the key')
    .option('--json', 'print JSON instead of text');
providers
  .command('list')
  .description('list provider instances (every company, or one)')
  .option('--company <id>', 'one company')
  .option('--cursor <cursor>', 'the next page, as the previous one printed')
  .option('--limit <n>', 'per page (1 to 500)', '100')
  .option('--json', 'print JSON instead of text')
  .action(async (opts: ProviderCliOptions) => {
    const { runProviders } = await import('./cli-providers.ts');
    process.exitCode = await runProviders('list', undefined, opts);
  });
providers
  .command('show <name>')
  .description("show one instance (its key's fingerprint, never the key)")
  .requiredOption('--company <id>', 'the company it belongs to')
  .option('--probe', 'have a worker ask the service whether it takes the saved key (exit 1 if not)')
  .option('--json', 'print JSON instead of text')
  .action(async (name: string, opts: ProviderCliOptions) => {
    const { runProviders } = await import('./cli-providers.ts');
    process.exitCode = await runProviders('show', name, opts);
  });
saveOptions(providers.command('add <name>'))
  .description('save a new instance; a worker probes its key first, and a key the service refuses is not saved (exit 1)')
  .requiredOption('--type <type>', 'daytona or createos')
  .action(async (name: string, opts: ProviderCliOptions) => {
    const { runProviders } = await import('./cli-providers.ts');
    process.exitCode = await runProviders('add', name, opts);
  });
saveOptions(providers.command('update <name>'))
  .description('change an instance: each option given replaces that field; workers use it from their next attempt')
  .option('--all-environments', 'let every environment of the company use it')
  .option('--if-rev <rev>', 'only if it is still at this revision')
  .action(async (name: string, opts: ProviderCliOptions) => {
    const { runProviders } = await import('./cli-providers.ts');
    process.exitCode = await runProviders('update', name, opts);
  });
providers
  .command('remove <name>')
  .description('delete an instance: operations that name it fail with provider_deleted')
  .requiredOption('--company <id>', 'the company it belongs to')
  .option('--if-rev <rev>', 'only if it is still at this revision')
  .option('--json', 'print JSON instead of text')
  .action(async (name: string, opts: ProviderCliOptions) => {
    const { runProviders } = await import('./cli-providers.ts');
    process.exitCode = await runProviders('remove', name, opts);
  });

program
  .command('secrets')
  .description('the master key of the provider registry')
  .command('rewrap')
  .description('wrap every instance\'s data key with the current master key (LEASE_OPS_SECRETS_KEY), during a rotation (the old one as LEASE_OPS_SECRETS_KEY_PREVIOUS); exit 1 if any could not be')
  .option('--json', 'print JSON instead of text')
  .action(async (opts: { json?: boolean }) => {
    const { runRewrap } = await import('./cli-providers.ts');
    process.exitCode = await runRewrap(opts);
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
  .option('--out <file>', 'where to write the two timelines as an HTML page (default: lease-ops-demo.html in the temporary directory)')
  .action(async (opts: { quick?: boolean; out?: string }) => {
    const { runDemo } = await import('./demo.ts');
    await runDemo({ quick: Boolean(opts.quick), ...(opts.out ? { out: opts.out } : {}) });
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
  .option('--out <dir>', 'where to write the figures (JSON) and their charts (SVG)', 'bench-results')
  .option('--scale', 'measure scaling instead: by worker processes, partitions (on a local Redis Cluster) and open leases, with Redis CPU per operation')
  .option('--neighbours', "measure one company's attacks on another's latency instead (the API in its own process, two workers)")
  .option('--burst', 'measure a 9 a.m. burst instead: thousands of acquires under Daytona\'s create limit on three workers, and what operations in flight cost')
  .action(async (opts: { json?: boolean; quick?: boolean; out: string; scale?: boolean; neighbours?: boolean; burst?: boolean }) => {
    // The bench lives beside the sources, not in the package: it needs a checkout and its dev dependencies.
    const benchModule = opts.burst ? '../bench/burst.ts' : opts.neighbours ? '../bench/neighbours.ts' : opts.scale ? '../bench/scale.ts' : '../bench/bench.ts';
    const missing = (err: { code?: string }) => (['ERR_MODULE_NOT_FOUND', 'ERR_UNKNOWN_FILE_EXTENSION'].includes(err.code ?? '') ? null : Promise.reject(err));
    type Run = (opts: { json: boolean; quick: boolean; out: string }) => Promise<unknown>;
    const bench = (await import(benchModule).catch(missing)) as { runBench?: Run; runScale?: Run; runNeighbours?: Run; runBurst?: Run } | null;
    if (!bench) {
      process.stderr.write('lease-ops: bench runs from a source checkout with its dev dependencies: git clone, npm ci, npm run bench\n');
      process.exit(2);
    }
    await (bench.runBurst ?? bench.runNeighbours ?? bench.runScale ?? bench.runBench)!({ json: Boolean(opts.json), quick: Boolean(opts.quick), out: opts.out });
  });

// Exit codes (README, Commands): 0 ok, 1 the operation failed, 2 bad input, 3 a wait ended
// before the operation did, 4 Redis unavailable.
try {
  await program.parseAsync(process.argv);
} catch (err) {
  if (err instanceof CommanderError) {
    // Commander printed what was wrong (or the help, or the version) already.
    process.exit(['commander.helpDisplayed', 'commander.version', 'commander.help'].includes(err.code) ? 0 : 2);
  }
  if (err instanceof ConfigError || err instanceof LayoutError) {
    process.stderr.write(`lease-ops: ${err.message}\n`);
    process.exit(2);
  }
  if (err instanceof RedisUnavailableError) {
    process.stderr.write(`lease-ops: ${err.message}\n`);
    process.exit(4);
  }
  throw err;
}
