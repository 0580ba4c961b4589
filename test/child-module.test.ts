import { mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { basename, join, relative } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { childModule } from './helpers/child-module.ts';

// The tests' TypeScript modules handed to worker children compiled (test/helpers/child-module.ts).
const ROOT = fileURLToPath(new URL('..', import.meta.url));
mkdirSync(join(ROOT, '.cache'), { recursive: true });
const dir = mkdtempSync(join(ROOT, '.cache', 'child-module-test-'));
// The modules' names start with the directory's own: what was compiled of them is removed at the end.
const tag = basename(dir);
afterAll(() => {
  rmSync(dir, { recursive: true, force: true });
  const out = join(ROOT, '.cache', 'child-modules');
  for (const file of readdirSync(out)) if (file.startsWith(tag)) rmSync(join(out, file), { force: true });
});

describe('a test module compiled for a child process', () => {
  it("imports src/ as the compiled dist/ the child runs, and another test module compiled too", async () => {
    const toErrors = relative(dir, join(ROOT, 'src', 'providers', 'errors.ts'));
    writeFileSync(join(dir, `${tag}-inner.ts`), 'export const answer: number = 1;\n');
    writeFileSync(join(dir, `${tag}-outer.ts`), `import { SettlingError } from '${toErrors}';\nimport type { LeaseProvider } from '../../src/providers/types.ts';\nimport { answer } from './${tag}-inner.ts';\nexport const seen: Pick<LeaseProvider, 'name'> = { name: 'x' };\nexport { answer, SettlingError };\n`);
    const compiled = (await import(pathToFileURL(childModule(join(dir, `${tag}-outer.ts`))).href)) as { answer: number; SettlingError: unknown };
    const dist = (await import(pathToFileURL(join(ROOT, 'dist', 'providers', 'errors.js')).href)) as { SettlingError: unknown };
    expect(compiled.answer).toBe(1);
    expect(compiled.SettlingError).toBe(dist.SettlingError);
  });

  it('keeps its other relative imports and import.meta.url pointing beside its source', async () => {
    writeFileSync(join(dir, `${tag}-plain.mjs`), 'export const plain = "beside";\n');
    const source = join(dir, `${tag}-where.ts`);
    writeFileSync(source, `import { plain } from './${tag}-plain.mjs';\nexport const here: string = import.meta.url;\nexport { plain };\n`);
    const compiled = (await import(pathToFileURL(childModule(source)).href)) as { here: string; plain: string };
    expect({ here: compiled.here, plain: compiled.plain }).toEqual({ here: pathToFileURL(source).href, plain: 'beside' });
  });

  it("reads imports as TypeScript does: not in comments or strings, a type-only one loads nothing, a .js name finds its .ts (helper-41)", async () => {
    writeFileSync(join(dir, `${tag}-a.ts`), [
      `// imported from './${tag}-gone.ts' once; gone now`,
      `import type { B } from './${tag}-b.ts';`,
      `import { b } from './${tag}-b.js';`,
      `export const a: B = { value: b.value + 1, said: 'from import.meta.url' };`,
      '',
    ].join('\n'));
    writeFileSync(join(dir, `${tag}-b.ts`), [`import type { A } from './${tag}-a.ts';`, 'export interface B { value: number; said: string }', 'export const b: B = { value: 1, said: "" };', 'export type { A };', ''].join('\n'));
    const compiled = (await import(pathToFileURL(childModule(join(dir, `${tag}-a.ts`))).href)) as { a: { value: number; said: string } };
    expect({ ...compiled.a }).toEqual({ value: 2, said: 'from import.meta.url' });
  });

  it('is compiled again when a module it imports changes, not only when it changes itself', async () => {
    writeFileSync(join(dir, `${tag}-dep.ts`), 'export const version = 1;\n');
    writeFileSync(join(dir, `${tag}-user.ts`), `export { version } from './${tag}-dep.ts';\n`);
    const first = childModule(join(dir, `${tag}-user.ts`));
    expect(childModule(join(dir, `${tag}-user.ts`))).toBe(first);
    writeFileSync(join(dir, `${tag}-dep.ts`), 'export const version = 2;\n');
    const second = childModule(join(dir, `${tag}-user.ts`));
    expect(second).not.toBe(first);
    expect(((await import(pathToFileURL(second).href)) as { version: number }).version).toBe(2);
  });
});
