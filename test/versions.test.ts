// Issue 13, part 2: the Node range lease-ops declares is one every dependency supports, and
// the Node running the tests is in it (npm warned EBADENGINE for commander 15 and zod-openapi 6).
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { describe, expect, it } from 'vitest';

// npm's own range arithmetic (semver, installed with bullmq), typed here for the two calls made.
const semver = createRequire(import.meta.url)('semver') as { subset(sub: string, dom: string): boolean; satisfies(version: string, range: string): boolean };

const pkg = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')) as { engines: { node: string } };
const lock = JSON.parse(readFileSync(new URL('../package-lock.json', import.meta.url), 'utf8')) as {
  packages: Record<string, { version?: string; engines?: { node?: string } | string[] }>;
};

describe('the Node range in engines', () => {
  it('is supported by every package the lock file installs (production, dev and optional)', () => {
    const declared = pkg.engines.node;
    const narrower = Object.entries(lock.packages)
      .filter(([path, entry]) => path !== '' && !Array.isArray(entry.engines) && typeof entry.engines?.node === 'string')
      .filter(([, entry]) => !semver.subset(declared, (entry.engines as { node: string }).node))
      .map(([path, entry]) => `${path.replace(/^.*node_modules\//, '')}@${entry.version}: node ${(entry.engines as { node: string }).node}`);
    expect(narrower).toEqual([]);
  });

  it("holds this machine's Node", () => {
    expect(semver.satisfies(process.version, pkg.engines.node)).toBe(true);
  });
});
