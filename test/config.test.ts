import { describe, expect, it } from 'vitest';
import { ConfigError, loadConfig } from '../src/config.ts';

describe('configuration', () => {
  it('has working defaults', () => {
    const c = loadConfig({});
    expect(c.LEASE_OPS_PREFIX).toBe('{lease-ops}');
    expect(c.LEASE_OPS_CONCURRENCY).toBe(50);
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
