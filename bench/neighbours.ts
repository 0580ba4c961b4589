import { fork, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { once, setMaxListeners } from 'node:events';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { setPriority } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { loadConfig } from '../src/config.ts';
import { seededRandom } from '../src/fakes/seeded-random.ts';
import { createRedis } from '../src/queues/redis.ts';
import { pool, startWorkers, stopWorkers, workersCpuUs } from './bench.ts';

/**
 * `npm run bench -- --neighbours` (issue 27): company A drives each attack at or past its
 * budget while company B's enqueue, read, attention and operation end to end are measured,
 * against B alone in the same run. The API runs as its own process (`lease-ops api`), with
 * two worker processes, as a deployment would.
 *
 * Each attack is measured in windows that take turns: B alone (A quiet), then B while A
 * attacks, NB_WINDOWS times, and each side's samples are pooled. B alone is so measured in the
 * same state as the attack (what earlier attacks left, Redis' memory, the processes' warmth)
 * and at the same time: one window of B alone before every attack moved its p99 by up to 1.5x
 * from the next (issue 27's notes), as wide as the target.
 */

const BIN = fileURLToPath(new URL('../bin/lease-ops.js', import.meta.url));
const A = `bench-a-${randomBytes(8).toString('hex')}`;
const B = `bench-b-${randomBytes(8).toString('hex')}`;
const ADMIN = `bench-admin-${randomBytes(8).toString('hex')}`;

type Latencies = Record<'enqueue' | 'read' | 'attention' | 'endToEnd', { p50: number; p99: number }>;
interface Attack {
  name: string;
  /** B's latencies (ms) while A attacks, B's in the windows of B alone between, and each p99 over B alone's. */
  b: Latencies;
  bAlone: Latencies;
  ratioP99: Record<keyof Latencies, number>;
  /**
   * Where each ratio lies with 90 % confidence: the 5th and 95th percentiles of the ratio over
   * 1,000 resamplings of both sides' samples (with replacement, seeded). A p99 of 300 samples is
   * their third slowest; this says how far that alone moves a ratio.
   */
  ratioP99Interval: Record<keyof Latencies, [number, number]>;
  /** B's requests refused (should be none), by measure and status. */
  bRefused: Record<string, number>;
  /** What A got: answers by status and code. */
  a: Record<string, number>;
  /** Redis memory grown during the attack (bytes). */
  redisGrowth: number;
  /** CPU each part spent per second of the attack (ms/s; B's own measuring included), where the cores went; aClient: this process, A's client. */
  cpuMsPerS: { api: number; workers: number; redis: number; aClient: number };
  /** The API's event-loop delay meanwhile (ms, from its /metrics): how long a request that arrived found it busy. */
  apiLoopDelayMs: { p99: number; max: number };
  /** A's operations counted in Redis bytes at the end, against its budget (the filling attack). */
  aBytes?: { held: number; budget: number };
}

/** A's Redis bytes budget here: small, so the filling attack reaches it within its window. */
const A_BYTES_BUDGET = Number(process.env.NB_A_BYTES ?? 4 * 1024 * 1024);

const quantile = (sorted: number[], q: number) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? NaN;
const round = (n: number) => Math.round(n * 100) / 100;

type Times = Record<keyof Latencies, number[]>;
const noTimes = (): Times => ({ enqueue: [], read: [], attention: [], endToEnd: [] });
const addTimes = (into: Times, from: Times) => {
  for (const k of Object.keys(into) as (keyof Latencies)[]) into[k].push(...from[k]);
};
function latencies(times: Times): Latencies {
  const out = {} as Latencies;
  for (const [what, list] of Object.entries(times) as [keyof Latencies, number[]][]) {
    const sorted = [...list].sort((x, y) => x - y);
    out[what] = { p50: round(quantile(sorted, 0.5)), p99: round(quantile(sorted, 0.99)) };
  }
  return out;
}

/** The 5th and 95th percentiles of p99(attacked) / p99(alone) over 1,000 bootstrap resamplings. */
function ratioInterval(attacked: number[], alone: number[]): [number, number] {
  // Seeded: the intervals come out the same for the same samples.
  const random = seededRandom(27);
  const p99Of = (list: number[]) => quantile(Array.from(list, () => list[Math.floor(random() * list.length)]!).sort((x, y) => x - y), 0.99);
  const ratios = Array.from({ length: 1_000 }, () => p99Of(attacked) / p99Of(alone)).sort((x, y) => x - y);
  return [round(quantile(ratios, 0.05)), round(quantile(ratios, 0.95))];
}

export async function runNeighbours(opts: { json: boolean; quick: boolean; out: string }): Promise<{
  aClientNice: number;
  windows: number;
  baseline: Latencies;
  baselineCpuMsPerS: Attack['cpuMsPerS'];
  baselineApiLoopDelayMs: Attack['apiLoopDelayMs'];
  attacks: Attack[];
  aloneSpreadP99: Attack['ratioP99'];
}> {
  const prefix = `{lo-nb-${randomBytes(3).toString('hex')}}`;
  const config = loadConfig({ ...process.env, LEASE_OPS_PREFIX: prefix });
  const redis = createRedis(config.REDIS_URL);
  // p99 of 300 is its third-slowest: fewer, and one stray sample (a GC, the OS) decides it.
  // NB_SAMPLES and NB_ONLY (parts of attacks' names, split by |): for comparing attacks across changes.
  const samples = Number(process.env.NB_SAMPLES ?? (opts.quick ? 40 : 300));
  // Windows of B alone and of B under attack, taking turns: `samples` on each side in all.
  const windows = Math.max(1, Number(process.env.NB_WINDOWS ?? (opts.quick ? 1 : 3)));
  const perWindow = Math.ceil(samples / windows);
  const failedLeases = opts.quick ? 600 : 3_000;
  const workers = await startWorkers('lanes', config);
  workers.forEach((w) => w.send('go'));
  // NB_API_NODE_ARGS: node flags for the API process (e.g. "--cpu-prof --cpu-prof-dir=/tmp/prof").
  const api = spawn(process.execPath, [...(process.env.NB_API_NODE_ARGS ? process.env.NB_API_NODE_ARGS.split(' ') : []), BIN, 'api'], {
    env: {
      ...process.env,
      REDIS_URL: config.REDIS_URL,
      LEASE_OPS_PREFIX: prefix,
      LEASE_OPS_API_PORT: '0',
      LEASE_OPS_LOG_LEVEL: 'warn',
      LEASE_OPS_LOG_FORMAT: 'json',
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: A, companyId: 'a' }, { token: B, companyId: 'b' }, { token: ADMIN }]),
      LEASE_OPS_QUEUE_LIMITS: JSON.stringify({ a: { maxBytes: A_BYTES_BUDGET } }),
    },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const base = await new Promise<string>((resolve, reject) => {
    let text = '';
    api.stdout!.on('data', (chunk: Buffer) => {
      text += chunk.toString();
      const m = /lease-ops API on (http:\/\/\S+)\/v1/.exec(text);
      if (m) resolve(m[1]!);
    });
    api.once('exit', (code) => reject(new Error(`the API exited (${code})`)));
  });
  const headers = (token: string) => ({ authorization: `Bearer ${token}`, 'content-type': 'application/json' });
  const post = (token: string, path: string, body?: unknown, extra: Record<string, string> = {}) =>
    fetch(`${base}${path}`, { method: 'POST', headers: { ...headers(token), ...extra }, ...(body === undefined ? {} : { body: JSON.stringify(body) }) });

  /** B's four measures, `n` samples each, one after another, from B's own process (neighbour-b.ts). */
  const bClient = fork(fileURLToPath(new URL('./neighbour-b.ts', import.meta.url)), [], { env: { ...process.env, NB_BASE: base, NB_TOKEN: B }, execArgv: ['--import', 'tsx'] });
  await once(bClient, 'message');
  let bRefused: Record<string, number> = {};
  const measureB = async (n: number): Promise<Times> => {
    const answer = once(bClient, 'message');
    bClient.send({ samples: n });
    const [{ times, refused }] = (await answer) as [{ times: Times; refused: Record<string, number> }];
    for (const [what, count] of Object.entries(refused)) bRefused[what] = (bRefused[what] ?? 0) + count;
    return times;
  };
  /** A process's CPU time so far (ms), from /proc (Linux). */
  const processCpuMs = (pid: number) => {
    const fields = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
    return ((Number(fields[11]) + Number(fields[12])) * 1000) / 100;
  };
  const redisCpuMs = async () => {
    const info = await redis.info('cpu');
    return (Number(/used_cpu_user:([\d.]+)/.exec(info)?.[1] ?? 0) + Number(/used_cpu_sys:([\d.]+)/.exec(info)?.[1] ?? 0)) * 1000;
  };
  const ownCpuMs = () => {
    const usage = process.cpuUsage();
    return (usage.user + usage.system) / 1000;
  };
  const cpuNow = async () => ({ at: performance.now(), api: processCpuMs(api.pid!), workers: (await workersCpuUs(workers as ChildProcess[])) / 1000, redis: await redisCpuMs(), aClient: ownCpuMs() });
  type CpuSpent = Omit<Awaited<ReturnType<typeof cpuNow>>, 'at'> & { seconds: number };
  const noCpu = (): CpuSpent => ({ seconds: 0, api: 0, workers: 0, redis: 0, aClient: 0 });
  /** Adds what each part spent since `from` to `into`. */
  const cpuSince = async (from: Awaited<ReturnType<typeof cpuNow>>, into: CpuSpent) => {
    const to = await cpuNow();
    into.seconds += (to.at - from.at) / 1000;
    for (const part of ['api', 'workers', 'redis', 'aClient'] as const) into[part] += to[part] - from[part];
  };
  const perSecond = (spent: CpuSpent): Attack['cpuMsPerS'] => ({
    api: Math.round(spent.api / spent.seconds),
    workers: Math.round(spent.workers / spent.seconds),
    redis: Math.round(spent.redis / spent.seconds),
    aClient: Math.round(spent.aClient / spent.seconds),
  });
  /** The API's event-loop delay since the last call (prom-client resets it at each scrape). */
  const apiLoopDelay = async () => {
    const text = await (await fetch(`${base}/metrics`, { headers: headers(ADMIN) })).text();
    const read = (name: string) => round(Number(new RegExp(`^lease_ops_process_nodejs_eventloop_lag_${name}_seconds (\\S+)`, 'm').exec(text)?.[1] ?? NaN) * 1000);
    return { p99: read('p99'), max: read('max') };
  };
  const memory = async () => Number(/used_memory:(\d+)/.exec(await redis.info('memory'))?.[1] ?? 0);
  const tally = (into: Record<string, number>, res: Response, code?: string) => {
    const key = `${res.status}${code ? ` ${code}` : ''}`;
    into[key] = (into[key] ?? 0) + 1;
  };
  /** A at its budget: told 429, it waits the Retry-After it was given (a client past it is the proxy's to cut). */
  const backOff = async (res: Response, signal: AbortSignal) => {
    if (res.status !== 429 || signal.aborted) return;
    const seconds = Number(res.headers.get('retry-after') ?? '1');
    await new Promise((r) => setTimeout(r, Math.max(200, seconds * 1000)));
  };
  const codeOf = async (res: Response) => (res.status >= 400 ? (((await res.json().catch(() => ({}))) as { error?: { code?: string } }).error?.code ?? '') : (await res.arrayBuffer(), undefined));

  /** What B alone saw and cost, over every attack's windows of B alone. */
  const aloneTimes = noTimes();
  const aloneCpu = noCpu();
  const aloneLoopDelay = { p99: 0, max: 0 };
  /** B measured over `n` samples, with what the parts spent and the API's loop delay meanwhile added up. */
  const window = async (n: number, cpu: CpuSpent, loopDelay: { p99: number; max: number }): Promise<Times> => {
    const cpuFrom = await cpuNow();
    await apiLoopDelay();
    const times = await measureB(n);
    await cpuSince(cpuFrom, cpu);
    const delay = await apiLoopDelay();
    loopDelay.p99 = Math.max(loopDelay.p99, delay.p99);
    loopDelay.max = Math.max(loopDelay.max, delay.max);
    return times;
  };

  /**
   * Measures B in windows that take turns, B alone and then B while `attack` (A's load, its
   * answers tallied by the attack itself) runs, stopped at the end of each of its windows.
   * An attack keeps its place between its windows (what it has done, in its own closure).
   */
  const underAttack = async (name: string, setUp: () => Promise<void>, attack: (signal: AbortSignal, a: Record<string, number>) => Promise<void>): Promise<Attack> => {
    if (process.env.NB_ONLY && !process.env.NB_ONLY.split('|').some((part) => name.includes(part))) return { name, skipped: true } as unknown as Attack;
    await setUp();
    const a: Record<string, number> = {};
    const before = await memory();
    bRefused = {};
    const alone = noTimes();
    const attacked = noTimes();
    const cpu = noCpu();
    const apiLoopDelayMs = { p99: 0, max: 0 };
    for (let w = 0; w < windows; w++) {
      addTimes(alone, await window(perWindow, aloneCpu, aloneLoopDelay));
      const stop = new AbortController();
      // Each of A's fetches listens on it until undici lets go (at a GC): thousands, no leak.
      setMaxListeners(0, stop.signal);
      const load = attack(stop.signal, a);
      addTimes(attacked, await window(perWindow, cpu, apiLoopDelayMs));
      stop.abort();
      await load.catch(() => undefined);
    }
    addTimes(aloneTimes, alone);
    const b = latencies(attacked);
    const bAlone = latencies(alone);
    const ratioP99 = Object.fromEntries((Object.keys(b) as (keyof Latencies)[]).map((k) => [k, round(b[k].p99 / bAlone[k].p99)])) as Attack['ratioP99'];
    const ratioP99Interval = Object.fromEntries((Object.keys(b) as (keyof Latencies)[]).map((k) => [k, ratioInterval(attacked[k], alone[k])])) as Attack['ratioP99Interval'];
    return { name, b, bAlone, ratioP99, ratioP99Interval, bRefused, a, cpuMsPerS: perSecond(cpu), apiLoopDelayMs, redisGrowth: (await memory()) - before };
  };

  // A's client runs here, in the bench's own thread, and stands for a tenant's machine
  // elsewhere: on a box of two cores its own CPU (108 ms/s in the long-poll attack) would
  // otherwise compete with the API, workers and Redis under test as much as its requests do.
  // So it runs at nice 19 (NB_A_NICE; 0 leaves it as it is), set after the API, the workers and
  // B's process were started so that none of them inherits it; its CPU is still reported (aClient).
  const aNice = Number(process.env.NB_A_NICE ?? 19);
  if (aNice) setPriority(aNice);

  try {
    // Warm up (not counted).
    await measureB(perWindow);
    const attacks: Attack[] = [];

    // 1. Long polls: A holds twice its budget of waits on an operation that waits in a paused lane.
    let heldJob = '';
    attacks.push(
      await underAttack(
        'long polls (waits)',
        async () => {
          await post(A, '/v1/leases/noop/a/env/held/pause');
          heldJob = ((await (await post(A, '/v1/leases/noop/a/env/held/operations', { op: 'stop', params: { providerLeaseId: 'held' } })).json()) as { jobId: string }).jobId;
        },
        async (signal, a) => {
          const polls = Array.from({ length: 2 * config.LEASE_OPS_API_MAX_WAITS_PER_COMPANY }, async () => {
            while (!signal.aborted) {
              const res = await fetch(`${base}/v1/operations/${encodeURIComponent(heldJob)}?waitMs=30000`, { headers: headers(A), signal }).catch(() => null);
              if (!res) return;
              tally(a, res, await codeOf(res));
              await backOff(res, signal);
            }
          });
          await Promise.all(polls);
        },
      ),
    );

    // 2. Attention walks: A has thousands of failed leases and walks its attention four at a time.
    attacks.push(
      await underAttack(
        `attention walks (${failedLeases} failed leases of A)`,
        async () => {
          await pool(
            Array.from({ length: failedLeases }, (_, i) => i),
            50,
            async (i) => {
              const res = await post(ADMIN, `/v1/leases/noop/a/env/fail-${i}/operations`, { op: 'stop', params: { providerLeaseId: `fail-${i}` } });
              const code = await codeOf(res);
              // One refused would leave the wait below for its failure forever.
              if (res.status !== 202) throw new Error(`setting up A's failed leases: ${res.status} ${code ?? ''}`);
            },
          );
          // Until the workers failed them all.
          for (;;) {
            if ((await redis.hlen(`${prefix}:failures`)) >= failedLeases) break;
            await new Promise((r) => setTimeout(r, 200));
          }
        },
        async (signal, a) => {
          await Promise.all(
            Array.from({ length: 4 }, async () => {
              while (!signal.aborted) {
                const res = await fetch(`${base}/v1/attention?limit=200`, { headers: headers(A), signal }).catch(() => null);
                if (!res) return;
                tally(a, res, await codeOf(res));
                await backOff(res, signal);
              }
            }),
          );
        },
      ),
    );

    // 3. Filling Redis: failing operations with 16 KiB of metadata, as fast as A can.
    const metadata = { blob: 'x'.repeat(16_000) };
    let filled = 0;
    attacks.push(
      await underAttack('filling Redis (16 KiB metadata)', async () => undefined, async (signal, a) => {
        await Promise.all(
          Array.from({ length: 20 }, async () => {
            while (!signal.aborted) {
              const n = filled++;
              const res = await post(A, `/v1/leases/noop/a/env/fail-fill-${n % 500}/operations`, { op: 'resume', params: { providerLeaseId: `fail-fill-${n % 500}`, leaseMetadata: metadata } }).catch(() => null);
              if (!res) return;
              tally(a, res, await codeOf(res));
              await backOff(res, signal);
            }
          }),
        );
      }),
    );

    const overview = (await (await fetch(`${base}/v1/overview`, { headers: headers(ADMIN) })).json()) as { bytesByCompany: Record<string, number> };
    if (!('skipped' in attacks.at(-1)!)) attacks.at(-1)!.aBytes = { held: overview.bytesByCompany.a ?? 0, budget: A_BYTES_BUDGET };

    // 4. Reruns: A runs its failed operations again as fast as it can (each of the first
    // 1,000 failed when the attack began, once: a window goes on where the last stopped).
    let failed: string[] = [];
    let rerun = 0;
    attacks.push(
      await underAttack('reruns', async () => void (failed = await redis.zrange(`${prefix}:ops:failed`, 0, 999)), async (signal, a) => {
        await Promise.all(
          Array.from({ length: 20 }, async () => {
            while (!signal.aborted && rerun < failed.length) {
              const res = await post(A, `/v1/operations/${encodeURIComponent(failed[rerun++]!)}/rerun`).catch(() => null);
              if (!res) return;
              tally(a, res, await codeOf(res));
              await backOff(res, signal);
            }
          }),
        );
      }),
    );

    // 5. Pauses: A pauses leases nobody uses, thousands of them.
    let paused = 0;
    attacks.push(
      await underAttack('pause flood', async () => undefined, async (signal, a) => {
        await Promise.all(
          Array.from({ length: 20 }, async () => {
            while (!signal.aborted && paused < 5_000) {
              const res = await post(A, `/v1/leases/noop/a/env/idle-${paused++}/pause`).catch(() => null);
              if (!res) return;
              tally(a, res, await codeOf(res));
              await backOff(res, signal);
            }
          }),
        );
      }),
    );

    const ran = attacks.filter((attack) => !('skipped' in attack));
    // How far B alone's p99 moved between the attacks' windows of B alone in this run (the
    // largest over the smallest): the noise a ratio above is read against.
    const aloneSpreadP99 = Object.fromEntries(
      (['enqueue', 'read', 'attention', 'endToEnd'] as const).map((k) => {
        const p99s = ran.map((attack) => attack.bAlone[k].p99);
        return [k, round(Math.max(...p99s) / Math.min(...p99s))];
      }),
    ) as Attack['ratioP99'];
    const figures = { aClientNice: aNice, windows, baseline: latencies(aloneTimes), baselineCpuMsPerS: perSecond(aloneCpu), baselineApiLoopDelayMs: aloneLoopDelay, attacks: ran, aloneSpreadP99 };
    mkdirSync(opts.out, { recursive: true });
    writeFileSync(join(opts.out, 'neighbours.json'), `${JSON.stringify(figures, null, 2)}\n`);
    if (opts.json) process.stdout.write(`${JSON.stringify(figures)}\n`);
    else {
      const row = (l: Latencies) => (Object.keys(l) as (keyof Latencies)[]).map((k) => `${k} ${l[k].p50}/${l[k].p99}`).join('  ');
      process.stdout.write(`A's client at nice ${aNice} (NB_A_NICE); ${windows} windows of B alone and ${windows} of B under attack, taking turns, ${perWindow} samples each (NB_WINDOWS, NB_SAMPLES)\n`);
      process.stdout.write(`B alone, all windows (p50/p99 ms):  ${row(figures.baseline)}\n  CPU ms/s API / workers / Redis: ${JSON.stringify(figures.baselineCpuMsPerS)}  API loop delay ms: ${JSON.stringify(figures.baselineApiLoopDelayMs)}\n`);
      for (const attack of figures.attacks) {
        process.stdout.write(`${attack.name}:\n  B alone: ${row(attack.bAlone)}\n  B:       ${row(attack.b)}\n  B p99 over alone (90 % interval): ${(Object.keys(attack.ratioP99) as (keyof Latencies)[]).map((k) => `${k} ${attack.ratioP99[k]} (${attack.ratioP99Interval[k].join('-')})`).join('  ')}\n  B refused: ${JSON.stringify(attack.bRefused)}\n  CPU ms/s: ${JSON.stringify(attack.cpuMsPerS)}  API loop delay ms: ${JSON.stringify(attack.apiLoopDelayMs)}\n  A got: ${JSON.stringify(attack.a)}  Redis grew ${(attack.redisGrowth / 1024 / 1024).toFixed(1)} MB${attack.aBytes ? `; A counted ${(attack.aBytes.held / 1024 / 1024).toFixed(1)} of its ${(attack.aBytes.budget / 1024 / 1024).toFixed(1)} MB` : ''}\n`);
      }
      process.stdout.write(`B alone's p99, largest over smallest of the attacks' windows: ${JSON.stringify(figures.aloneSpreadP99)}\n`);
    }
    return figures;
  } finally {
    bClient.kill('SIGTERM');
    api.kill('SIGTERM');
    await once(api, 'exit').catch(() => undefined);
    await stopWorkers(workers as ChildProcess[]);
    const keys = await redis.keys(`${prefix}*`);
    for (let i = 0; i < keys.length; i += 500) await redis.unlink(...keys.slice(i, i + 500));
    redis.disconnect();
  }
}
