import { randomBytes } from 'node:crypto';
import { startApiServer } from './api/server.ts';
import { loadConfig } from './config.ts';
import type { OperationView } from './queues/inspect.ts';
import { NoRedisError, redisOrPrivate, stopPrivateRedis } from './redis-server.ts';
import { exitEarlyOnSignals, loggerFor, startWorker } from './runtime.ts';
import { maskToken, maskUrl } from './secrets.ts';

const out = (line: string) => process.stdout.write(`${line}\n`);

/**
 * The main job on the embedded default, all in one process: a worker against the simulated
 * cloud, the HTTP API with Bull Board and /metrics, and one lease taken through acquire,
 * stop, resume and release over the HTTP API while you watch.
 */
export async function runStart(opts: { once: boolean }): Promise<void> {
  let config = loadConfig({ LEASE_OPS_LOG_LEVEL: 'warn', ...process.env });
  // A signal before the graceful stop is in place still stops a private Redis, even one
  // still starting.
  const handOver = exitEarlyOnSignals(stopPrivateRedis);
  let redis;
  try {
    redis = await redisOrPrivate(config.REDIS_URL, (url) =>
      out(`lease-ops: no Redis answered at ${maskUrl(config.REDIS_URL)}; started a private one at ${url} (nothing persists)`),
    );
  } catch (err) {
    if (!(err instanceof NoRedisError)) throw err;
    process.stderr.write(`lease-ops: ${err.message}\n`);
    process.exitCode = 4;
    return;
  }
  const privateRedis = redis.privateRedis;
  config = { ...config, REDIS_URL: redis.url };
  let token = config.LEASE_OPS_API_TOKENS.find((t) => t.companyId === undefined)?.token;
  // A token from the environment is the operator's secret: shown masked. One made for this
  // run is shown whole, once, so the lines below can be pasted.
  const shownToken = token ? maskToken(token) : null;
  if (!token) {
    // Nothing configured: a fresh admin token for this run, shown once below.
    token = randomBytes(18).toString('base64url');
    config = { ...config, LEASE_OPS_API_TOKENS: [...config.LEASE_OPS_API_TOKENS, { token, name: 'start' }] };
  }
  const log = loggerFor(config);
  const worker = await startWorker(config, log).catch((err: unknown) => {
    privateRedis?.stop();
    throw err;
  });
  let api;
  try {
    api = await startApiServer(config, log);
  } catch (err) {
    await worker.close();
    privateRedis?.stop();
    if ((err as NodeJS.ErrnoException).code !== 'EADDRINUSE') throw err;
    process.stderr.write(`lease-ops: port ${config.LEASE_OPS_API_PORT} on ${config.LEASE_OPS_API_HOST} is taken: set LEASE_OPS_API_PORT to a free port (0 picks any)\n`);
    process.exitCode = 2;
    return;
  }
  let stopping = false;
  const stop = async () => {
    stopping = true;
    await api.close();
    await worker.close();
    privateRedis?.stop();
  };
  // Ctrl-C while the lifecycle plays stops everything too.
  handOver({ log, stop });
  out(`lease-ops: worker running against ${maskUrl(config.REDIS_URL)} (providers: ${config.LEASE_OPS_PROVIDERS})`);
  out(`lease-ops: API ${api.url}/v1  (OpenAPI: ${api.url}/v1/openapi.json)`);
  out(`lease-ops: Bull Board ${api.url}/board  (any user name, the token as password)`);
  out(`lease-ops: pages ${api.url}/ui/attention  (what needs attention; each lease's timeline is linked from it; the same password)`);
  out(`lease-ops: metrics ${api.url}/metrics  health ${api.url}/healthz  ready ${api.url}/readyz`);
  out(`lease-ops: token ${shownToken ? `${shownToken} (from LEASE_OPS_API_TOKENS)` : token}`);

  const started = Date.now();
  const stamp = () => `${((Date.now() - started) / 1000).toFixed(2).padStart(6)}s`;
  const headers = { authorization: `Bearer ${token}`, 'content-type': 'application/json' };
  const leasePath = (leaseId: string) => `/v1/leases/simulated/demo-co/demo-env/${encodeURIComponent(leaseId)}`;
  const run = async (leaseId: string, op: string, params: unknown): Promise<{ providerLeaseId: string }> => {
    const accepted = await fetch(`${api.url}${leasePath(leaseId)}/operations`, { method: 'POST', headers, body: JSON.stringify({ op, params }) });
    if (accepted.status !== 202) throw new Error(`${op} was refused: ${accepted.status} ${await accepted.text()}`);
    const location = accepted.headers.get('location') ?? '';
    const read = await fetch(`${api.url}${location}?waitMs=30000`, { headers });
    const view = (await read.json()) as OperationView;
    out(`${stamp()}  POST ${op.padEnd(10)} -> ${view.state.padEnd(9)} ${JSON.stringify(view.result ?? view.error)}`);
    if (view.state !== 'completed') throw new Error(`${op} did not complete: ${JSON.stringify(view.error ?? view.state)}`);
    return view.result as { providerLeaseId: string };
  };
  try {
    const acquired = await run(`demo-${Date.now()}`, 'acquire', { runId: 'demo-run' });
    // Later operations of the lease name the sandbox the acquire created.
    const sandbox = acquired.providerLeaseId;
    const target = { providerLeaseId: sandbox };
    await run(sandbox, 'stop', target);
    await run(sandbox, 'resume', { ...target, leaseMetadata: {} });
    await run(sandbox, 'release', { ...target, leaseMetadata: {}, resourceDisposition: 'destroy' });
    out(`${stamp()}  lifecycle done: every operation ran in order through the lease's lane`);
    out(`         try: curl -H 'authorization: Bearer ${shownToken ?? token}' ${api.url}${leasePath(sandbox)}`);
    out(`         its timeline: ${api.url}/ui/leases/simulated/demo-co/demo-env/${encodeURIComponent(sandbox)}`);
  } catch (err) {
    // Stopped by a signal meanwhile: the lifecycle's requests fail, and that is no error.
    if (stopping) return;
    if (opts.once) await stop();
    throw err;
  }
  if (opts.once) {
    await stop();
    return;
  }
  out('lease-ops: serving; press Ctrl-C to stop');
}
