import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';

/**
 * The BullMQ versions lease-ops was tested with. Its lane scripts write BullMQ's own keys and
 * fields (see test/bullmq-contract.test.ts); another version may store them differently, so
 * a worker or an API refuses to start with one until that suite passes against it.
 */
export const BULLMQ_TESTED_RANGE = '>=6.7.0 <6.8.0';

/** Null when `version` is in the tested range, else the message to refuse with. */
export function checkBullmqVersion(version: string): string | null {
  const m = /^(\d+)\.(\d+)\.(\d+)/.exec(version);
  if (m && Number(m[1]) === 6 && Number(m[2]) === 7) return null;
  return `BullMQ ${version} is installed, but lease-ops was tested with BullMQ ${BULLMQ_TESTED_RANGE}: its lanes write BullMQ's internal keys, which another version may lay out differently. Install a tested version (npm install bullmq@6.7), or run test/bullmq-contract.test.ts against this one first.`;
}

/** The installed BullMQ's version, from its package.json. */
export function installedBullmqVersion(): string {
  const require = createRequire(import.meta.url);
  const path = require.resolve('bullmq/package.json');
  return (JSON.parse(readFileSync(path, 'utf8')) as { version: string }).version;
}

/** Throws, with what to do, unless the installed BullMQ is a tested one. */
export function assertTestedBullmq(): void {
  const problem = checkBullmqVersion(installedBullmqVersion());
  if (problem) throw new Error(problem);
}
