// Issue 13, part 1: lease-ops as a package. The tarball `npm pack` makes is installed into an
// empty consumer that already uses bullmq and ioredis (an older patch of it than lease-ops was
// tested with), and used the ways a control plane would.
import { execFile } from 'node:child_process';
import { mkdtemp, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';

const run = promisify(execFile);
const ROOT = fileURLToPath(new URL('..', import.meta.url));
const TSC = createRequire(import.meta.url).resolve('typescript/bin/tsc');
const { version } = createRequire(import.meta.url)('../package.json') as { version: string };

/** Every directory under node_modules that holds the package `name` (nested copies included). */
async function copiesOf(nodeModules: string, name: string): Promise<string[]> {
  const found: string[] = [];
  for (const entry of await readdir(nodeModules, { recursive: true, withFileTypes: true })) {
    if (entry.isDirectory() && entry.name === name && entry.parentPath.endsWith('node_modules')) found.push(join(entry.parentPath, entry.name));
  }
  return found;
}

/**
 * Packs the package in `dir` into a new temporary directory and installs the tarball (and
 * `extra`) into a consumer there with `dependencies` of its own: what was packed, where, and
 * what npm said while installing (from npm's cache where it can, else the registry).
 */
async function packAndInstall(dir: string, dependencies: Record<string, string>, extra: string[] = []) {
  const work = await mkdtemp(join(tmpdir(), 'lease-ops-pack-'));
  const { stdout } = await run('npm', ['pack', '--json', '--pack-destination', work], { cwd: dir, maxBuffer: 16 * 1024 * 1024 });
  const [packed] = JSON.parse(stdout.slice(stdout.indexOf('['))) as { filename: string; files: { path: string }[] }[];
  const consumer = join(work, 'consumer');
  await run('mkdir', ['-p', consumer]);
  await writeFile(join(consumer, 'package.json'), JSON.stringify({ name: 'consumer', private: true, type: 'module', dependencies }));
  const installed = await run('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', join(work, packed!.filename), ...extra], { cwd: consumer, maxBuffer: 16 * 1024 * 1024 });
  return { work, consumer, files: packed!.files.map((f) => f.path), installLog: `${installed.stdout}\n${installed.stderr}` };
}

let started: { main: ReturnType<typeof packAndInstall>; client: ReturnType<typeof packAndInstall> } | null = null;
/**
 * Both packages packed and installed at once, started by whichever describe needs one first:
 * each mostly waits on npm and the disk (about 6 s of the file's wall time the second would add).
 */
function installs(): NonNullable<typeof started> {
  if (!started) {
    started = { main: packAndInstall(ROOT, { bullmq: '6.7.0', ioredis: '5.9.2' }, ['@types/node@20']), client: packAndInstall(join(ROOT, 'packages', 'client'), {}) };
    // Awaited by its describe's beforeAll; one left out by a filter must not fail the run unseen.
    for (const install of Object.values(started)) install.catch(() => {});
  }
  return started;
}

// Each install's directory goes, whichever ended or failed; a slow registry's install may still
// be running when a filtered run's tests end (helper-65: the 30 s default cut it, both left).
afterAll(async () => {
  await Promise.allSettled(Object.values(started ?? {}).map(async (install) => rm((await install).work, { recursive: true, force: true })));
}, 300_000);

describe('the packed package, installed into a consumer', () => {
  let consumer: string;
  let files: string[];
  let installLog: string;
  let builtBefore: number;
  let builtAfter: number;

  beforeAll(async () => {
    // `npm pack` builds first (prepack) when the sources changed, so the tarball holds what
    // the sources say now.
    builtBefore = (await stat(join(ROOT, 'dist', 'cli.js'))).mtimeMs;
    ({ consumer, files, installLog } = await installs().main);
    builtAfter = (await stat(join(ROOT, 'dist', 'cli.js'))).mtimeMs;
  }, 300_000);

  it('holds only what a user runs: compiled code, declarations, the Lua scripts, the CLI, README and LICENSE', () => {
    expect(files).toContain('dist/index.js');
    expect(files).toContain('dist/index.d.ts');
    expect(files).toContain('dist/queues/lua/lane-push.lua');
    expect(files).toContain('bin/lease-ops.js');
    expect(files).toContain('LICENSE');
    const outside = files.filter((f) => !/^(dist\/|bin\/lease-ops\.js$|LICENSE$|README\.md$|package\.json$)/.test(f));
    expect(outside).toEqual([]);
    expect(files.filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts'))).toEqual([]);
  });

  it('imports from plain node as ESM, and with require where this Node allows require(esm)', async () => {
    const esm = await run(process.execPath, ['--input-type=module', '-e', "import { LeaseOpsClient, QueueFullError } from 'lease-ops'; console.log(typeof LeaseOpsClient, typeof QueueFullError)"], { cwd: consumer });
    expect(esm.stdout.trim()).toBe('function function');
    const requireEsm = (process.features as { require_module?: boolean }).require_module === true;
    if (requireEsm) {
      const cjs = await run(process.execPath, ['--input-type=commonjs', '-e', "const m = require('lease-ops'); console.log(typeof m.LeaseOpsClient)"], { cwd: consumer });
      expect(cjs.stdout.trim()).toBe('function');
    }
  });

  it('compiles a strict TypeScript consumer (NodeNext, exactOptionalPropertyTypes, library declarations checked)', async () => {
    await writeFile(
      join(consumer, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: { target: 'ES2022', module: 'NodeNext', moduleResolution: 'NodeNext', strict: true, exactOptionalPropertyTypes: true, noEmit: true, skipLibCheck: false, types: ['node'] },
        include: ['main.ts'],
      }),
    );
    await writeFile(
      join(consumer, 'main.ts'),
      [
        "import { LeaseOpsClient, loadConfig, QueueFullError, type Enqueued, type OperationView } from 'lease-ops';",
        "const client = new LeaseOpsClient(loadConfig({ REDIS_URL: 'redis://127.0.0.1:6379' }));",
        "const lease = { provider: 'daytona', companyId: 'acme', environmentId: 'prod', leaseId: 'sb-1' };",
        "const enqueued: Enqueued = await client.enqueue('stop', lease, { providerLeaseId: 'sb-1' }, { idempotencyKey: 'k1' });",
        'const view: OperationView | null = await client.getOperation(enqueued.jobId);',
        "export const seen: string = view?.state ?? (new QueueFullError('queue', 0, 1) as Error).message;",
        'await client.close();',
      ].join('\n'),
    );
    const compiled = await run(process.execPath, [TSC, '-p', consumer], { cwd: consumer }).catch((err: { stdout: string }) => err);
    expect(compiled.stdout).toBe('');
  });

  it('runs `npx lease-ops --version`', async () => {
    const { stdout } = await run('npx', ['--no-install', 'lease-ops', '--version'], { cwd: consumer });
    expect(stdout.trim()).toBe(version);
  });

  it("serves lease-ops/paperclip to a consumer with paperclip's plugin SDK, and the main entry to one without it (an optional peer)", async () => {
    // Without the SDK: the main entry imports, the paperclip one says what it needs.
    const without = await run(process.execPath, ['--input-type=module', '-e', "import('lease-ops/paperclip').then(() => console.log('loaded'), (e) => console.log(e.code))"], { cwd: consumer });
    expect(without.stdout.trim()).toBe('ERR_MODULE_NOT_FOUND');
    // The SDK version lease-ops pins for its own tests.
    const sdk = (createRequire(import.meta.url)('../package.json') as { devDependencies: Record<string, string> }).devDependencies['@paperclipai/plugin-sdk']!;
    await run('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error', `@paperclipai/plugin-sdk@${sdk}`], { cwd: consumer, maxBuffer: 16 * 1024 * 1024 });
    const withSdk = await run(
      process.execPath,
      ['--input-type=module', '-e', "import { createLeaseOpsPlugin, manifest } from 'lease-ops/paperclip'; const p = createLeaseOpsPlugin(); console.log(manifest.environmentDrivers[0].driverKey, typeof p.definition.onEnvironmentAcquireLease)"],
      { cwd: consumer },
    );
    expect(withSdk.stdout.trim()).toBe('lease-ops function');
  }, 120_000);

  it('packs the dist/ already built from these sources: no rebuild under the other tests that run it', () => {
    // A rebuild removes dist/ first: a CLI started meanwhile (by a test run beside this one, or
    // by hand) found it missing and built it again, beside this one.
    expect(builtAfter).toBe(builtBefore);
  });

  it('runs no script of its own at install (no `prepare`: npm would warn everyone who installs it)', () => {
    const manifest = createRequire(import.meta.url)('../package.json') as { scripts: Record<string, string> };
    for (const hook of ['preinstall', 'install', 'postinstall', 'prepare']) expect(manifest.scripts[hook]).toBeUndefined();
    expect(installLog).not.toMatch(/lease-ops@[\d.]+ \(/);
  });

  it('says what installing it weighs (the light client is the package for a control plane that only enqueues and reads)', async () => {
    const bytes = await bytesUnder(join(consumer, 'node_modules'));
    console.log(`lease-ops installed (with bullmq, ioredis and @types/node the consumer had): ${(bytes / 1024 / 1024).toFixed(1)} MiB`);
    expect(bytes).toBeGreaterThan(1024 * 1024);
  });

  it('gives a host that already uses bullmq and ioredis no second copy of either', async () => {
    const nodeModules = join(consumer, 'node_modules');
    expect(await copiesOf(nodeModules, 'bullmq')).toEqual([join(nodeModules, 'bullmq')]);
    expect(await copiesOf(nodeModules, 'ioredis')).toEqual([join(nodeModules, 'ioredis')]);
  });
});

/** Bytes of every file under `dir`. */
async function bytesUnder(dir: string): Promise<number> {
  let total = 0;
  for (const entry of await readdir(dir, { recursive: true, withFileTypes: true })) if (entry.isFile()) total += (await stat(join(entry.parentPath, entry.name))).size;
  return total;
}

// Issue 26 item 8: a control plane that only enqueues and reads installs the light client
// (packages/client, lease-ops-client): no dependencies, no install scripts, a few tens of KB.
describe('the light client package, installed alone', () => {
  let consumer: string;
  let files: string[];
  let installLog: string;

  beforeAll(async () => {
    ({ consumer, files, installLog } = await installs().client);
  }, 120_000);

  it('ships compiled code and declarations only, with no dependencies and no install scripts (npm warns of none)', async () => {
    expect(files.sort()).toEqual(['README.md', 'dist/index.d.ts', 'dist/index.js', 'package.json']);
    const manifest = JSON.parse(await readFile(join(consumer, 'node_modules', 'lease-ops-client', 'package.json'), 'utf8')) as Record<string, unknown>;
    expect(manifest.dependencies ?? {}).toEqual({});
    expect(manifest.peerDependencies ?? {}).toEqual({});
    expect(manifest.scripts ?? {}).toEqual({});
    expect(installLog).not.toMatch(/install-scripts|prepare/);
    // Nothing but itself in node_modules, and small (the full package pulls express, Bull Board and both cloud SDKs).
    const installed = (await readdir(join(consumer, 'node_modules'))).filter((name) => !name.startsWith('.'));
    expect(installed).toEqual(['lease-ops-client']);
    const bytes = await bytesUnder(join(consumer, 'node_modules'));
    console.log(`lease-ops-client installed: ${(bytes / 1024).toFixed(1)} KiB in 1 package`);
    expect(bytes).toBeLessThan(64 * 1024);
  });

  it('imports from plain node and fails with { code, message } when lease-ops is not there', async () => {
    const script = [
      "import { LeaseOpsHttpClient, LeaseOpsRequestError } from 'lease-ops-client';",
      "const client = new LeaseOpsHttpClient({ url: 'http://127.0.0.1:9', token: 'x' });",
      "const err = await client.getLease({ provider: 'p', companyId: 'c', environmentId: 'e', leaseId: 'l' }).catch((e) => e);",
      'console.log(JSON.stringify({ light: err instanceof LeaseOpsRequestError, code: err.code, status: err.status, message: typeof err.message }));',
    ].join('\n');
    const { stdout } = await run(process.execPath, ['--input-type=module', '-e', script], { cwd: consumer });
    expect(JSON.parse(stdout)).toEqual({ light: true, code: 'unreachable', status: 0, message: 'string' });
  });

  it('compiles a strict TypeScript consumer against its declarations', async () => {
    await run('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error', '@types/node@20'], { cwd: consumer, maxBuffer: 16 * 1024 * 1024 });
    await writeFile(
      join(consumer, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: { target: 'ES2022', module: 'NodeNext', moduleResolution: 'NodeNext', strict: true, exactOptionalPropertyTypes: true, noEmit: true, skipLibCheck: false, types: ['node'] },
        include: ['main.ts'],
      }),
    );
    await writeFile(
      join(consumer, 'main.ts'),
      [
        "import { LeaseOpsHttpClient, type LeaseView, type OperationResult } from 'lease-ops-client';",
        "const client = new LeaseOpsHttpClient({ url: 'http://lease-ops:3000', token: 'a-token-of-sixteen-chars' });",
        "const lease = { provider: 'daytona', companyId: 'acme', environmentId: 'prod', leaseId: 'run-1' };",
        "const { jobId } = await client.enqueue('acquire', lease, { runId: 'run-1' }, { idempotencyKey: 'k1' });",
        'const ended: OperationResult = await client.waitForResult(jobId, 60_000);',
        'const view: LeaseView = await client.getLease(lease);',
        "export const seen: string = ended.error?.code ?? view.observed?.providerState ?? '-';",
      ].join('\n'),
    );
    const compiled = await run(process.execPath, [TSC, '-p', consumer], { cwd: consumer }).catch((err: { stdout: string }) => err);
    expect(compiled.stdout).toBe('');
  }, 60_000);
});

// Issue 26 item 6: the first `npx lease-ops` after a test run took 23 s. npm exec trusts its
// record of the installed tree (node_modules/.package-lock.json) only while node_modules is
// not newer than it; vitest used to create its cache and config folders there, so npx
// walked every installed package. In CI (a clean clone, `npm ci`, then this run) node_modules
// must be as npm left it.
describe.runIf(process.env.CI === 'true' && process.env.npm_lifecycle_event === 'test')('a test run, seen from npm', () => {
  it('leaves node_modules as npm ci left it, so npx reads its record of the tree instead of walking it', async () => {
    const modules = join(ROOT, 'node_modules');
    const entries = await readdir(modules);
    expect(entries.filter((name) => name === '.vite' || name === '.vite-temp')).toEqual([]);
    expect((await stat(modules)).mtimeMs).toBeLessThanOrEqual((await stat(join(modules, '.package-lock.json'))).mtimeMs);
  });
});

describe('provider errors across copies of lease-ops', () => {
  it("an error a provider module raised with the compiled package's classes is told apart by the sources' classes, and the other way round", async () => {
    const src = await import('../src/providers/errors.ts');
    const dist = (await import(new URL('../dist/providers/errors.js', import.meta.url).href)) as typeof src;
    const fromDist = new dist.SettlingError('sandbox_stopping', 'still stopping');
    expect(fromDist instanceof src.SettlingError).toBe(true);
    expect(fromDist instanceof src.ProviderError).toBe(true);
    expect(fromDist instanceof src.PermanentError).toBe(false);
    expect(new src.PermanentError('refused', 'no') instanceof dist.PermanentError).toBe(true);
    expect(new Error('plain') instanceof src.ProviderError).toBe(false);
  });
});
