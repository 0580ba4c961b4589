import { describe, expect, it } from 'vitest';
import { readFile } from 'node:fs/promises';
import { ConfigError, QUEUE_NAMES_REFUSED, loadConfig } from '../src/config.ts';

describe('configuration', () => {
  it('has working defaults', () => {
    const c = loadConfig({});
    expect(c.LEASE_OPS_PREFIX).toBe('{lease-ops}');
    expect(c.LEASE_OPS_CONCURRENCY).toBe(200);
  });

  it("derives the API's wait budgets from its connections where they are not set: half of them in all, a fifth of those per company", () => {
    expect(loadConfig({ LEASE_OPS_API_MAX_CONNECTIONS: '50' })).toMatchObject({ LEASE_OPS_API_MAX_WAITS: 25, LEASE_OPS_API_MAX_WAITS_PER_COMPANY: 5 });
    expect(loadConfig({})).toMatchObject({ LEASE_OPS_API_MAX_WAITS: 500, LEASE_OPS_API_MAX_WAITS_PER_COMPANY: 100 });
    expect(loadConfig({ LEASE_OPS_API_MAX_CONNECTIONS: '50', LEASE_OPS_API_MAX_WAITS_PER_COMPANY: '20' })).toMatchObject({ LEASE_OPS_API_MAX_WAITS_PER_COMPANY: 20 });
  });

  it("refuses a queue named as a family of lease-ops' own keys that end in a name a caller chooses, and that list is the key table of docs/design.md's (helper-33)", async () => {
    const design = await readFile(new URL('../docs/design.md', import.meta.url), 'utf8');
    const table = design.slice(design.indexOf('Keys under the prefix'), design.indexOf('A lane id is a hash'));
    const families = new Set([...table.matchAll(/`<prefix>:([^:<`]+):[^`]*<(company|scope)>[^`]*`/g)].map((m) => m[1]!));
    expect([...QUEUE_NAMES_REFUSED].sort()).toEqual([...families].sort());
    expect(() => loadConfig({ LEASE_OPS_QUEUE: 'deadlines' })).toThrow(/LEASE_OPS_QUEUE.*names a family of lease-ops' own keys/s);
    expect(() => loadConfig({ LEASE_OPS_QUEUE: 'bytes' })).toThrow(ConfigError);
    // Names a deployment may well have used, whose families are keyed by lane id: still taken (helper-34).
    for (const name of ['lease-ops-jobs', 'lease', 'lanes', 'history', 'providers', 'failures', 'stopping']) expect(loadConfig({ LEASE_OPS_QUEUE: name }).LEASE_OPS_QUEUE).toBe(name);
  });

  it('names every bad variable and why', () => {
    const attempt = () => loadConfig({ LEASE_OPS_CONCURRENCY: 'many', LEASE_OPS_PREFIX: 'no-hash-tag', REDIS_URL: 'nope' });
    expect(attempt).toThrow(ConfigError);
    try {
      attempt();
    } catch (err) {
      const msg = (err as Error).message;
      expect(msg).toMatch(/LEASE_OPS_CONCURRENCY="many"/);
      expect(msg).toMatch(/LEASE_OPS_PREFIX="no-hash-tag": must contain exactly one \{hash tag\}/);
      expect(msg).toMatch(/REDIS_URL="nope"/);
    }
  });
});

describe('per-operation settings', () => {
  it('take JSON, checked, naming the variable when it is wrong', () => {
    const c = loadConfig({ LEASE_OPS_BACKOFF_BY_OP: '{"resume":{"baseMs":100}}', LEASE_OPS_DEADLINES_MS: '{"stop":60000}' });
    expect(c.LEASE_OPS_BACKOFF_BY_OP).toEqual({ resume: { baseMs: 100 } });
    expect(c.LEASE_OPS_DEADLINES_MS).toEqual({ stop: 60_000 });
    expect(() => loadConfig({ LEASE_OPS_DEADLINES_MS: '{"stop":' })).toThrow(/LEASE_OPS_DEADLINES_MS=.*must be JSON/);
    expect(() => loadConfig({ LEASE_OPS_DEADLINES_MS: '{"explode":1}' })).toThrow(/LEASE_OPS_DEADLINES_MS/);
  });
});

describe('secrets as files (<VARIABLE>_FILE, as Docker and Kubernetes mount them)', () => {
  it('reads a provider key from its file, and refuses both or an unreadable one by name, never by value', async () => {
    const { mkdtemp, rm, writeFile } = await import('node:fs/promises');
    const { tmpdir } = await import('node:os');
    const { join } = await import('node:path');
    const { loadProviders } = await import('../src/providers/registry.ts');
    const dir = await mkdtemp(join(tmpdir(), 'lease-ops-key-'));
    try {
      await writeFile(join(dir, 'daytona'), 'dtn_file_key_value\n');
      const registry = await loadProviders('daytona', { DAYTONA_API_KEY_FILE: join(dir, 'daytona') });
      expect(registry.get('daytona')?.name).toBe('daytona');
      await registry.close();
      await expect(loadProviders('daytona', { DAYTONA_API_KEY_FILE: join(dir, 'daytona'), DAYTONA_API_KEY: 'dtn_direct' })).rejects.toThrow(/set DAYTONA_API_KEY or DAYTONA_API_KEY_FILE, not both/);
      const missing = (await loadProviders('daytona', { DAYTONA_API_KEY_FILE: join(dir, 'nope') }).then(() => new Error('loaded'), (e: unknown) => e)) as Error;
      expect(missing.message).toMatch(/DAYTONA_API_KEY_FILE=.*nope: cannot read it \(ENOENT\)/);
      expect(missing.message).not.toContain('dtn_');
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
