import { watch } from 'node:fs';
import { dirname } from 'node:path';
import type { CallRecord } from './recording-provider.ts';
import { readCallFile } from './invariants.ts';

/** Resolves with the first call record that matches, as soon as the provider writes it. */
export function waitForCall(file: string, match: (c: CallRecord) => boolean, timeoutMs = 30_000): Promise<CallRecord> {
  return new Promise((resolve, reject) => {
    const check = () => {
      const found = readCallFile(file).find(match);
      if (!found) return false;
      watcher.close();
      clearTimeout(timer);
      resolve(found);
      return true;
    };
    const watcher = watch(dirname(file), () => void check());
    const timer = setTimeout(() => {
      watcher.close();
      reject(new Error(`no matching call in ${file} within ${timeoutMs} ms`));
    }, timeoutMs);
    check();
  });
}
