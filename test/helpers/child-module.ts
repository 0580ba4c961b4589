import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { basename, dirname, join, relative, resolve, sep } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const ROOT = fileURLToPath(new URL('../..', import.meta.url));
const SRC = join(ROOT, 'src') + sep;
const DIST = join(ROOT, 'dist') + sep;
const OUT = join(ROOT, '.cache', 'child-modules');
/** A relative import: `from './x.ts'`, `import './x.json'`, `import('../y.js')`. */
const RELATIVE_IMPORT = /(\bfrom\s*|\bimport\s*\(?\s*)(['"])(\.\.?\/[^'"]+)\2/g;
const compiling = new Set<string>();

/**
 * A test's TypeScript module (a provider given to a `lease-ops worker` child) as JavaScript
 * the child can load without tsx: Node 20 cannot run TypeScript, and tsx's loader took a
 * worker's start from 0.45 to 0.9 s of CPU here, in a suite that starts a hundred of them.
 * Its imports of `src/` point at the compiled `dist/` (the code the child runs, built before
 * the tests), as a provider package's imports of lease-ops would; its imports of other test
 * modules are compiled the same way, and its other relative imports and `import.meta.url`
 * still name the files beside its source. Compiled once per content (its own and its
 * imports'), into `.cache/child-modules`.
 */
export function childModule(file: string): string {
  if (compiling.has(file)) throw new Error(`childModule: ${file} imports itself through other test modules`);
  const source = readFileSync(file, 'utf8');
  const imports = new Map<string, string>();
  compiling.add(file);
  try {
    for (const [, , , specifier] of source.matchAll(RELATIVE_IMPORT)) {
      const target = resolve(dirname(file), specifier!);
      // The compiled module lives elsewhere: every relative import is made absolute.
      const compiled = !target.endsWith('.ts') ? target : target.startsWith(SRC) ? join(DIST, relative(SRC, target)).replace(/\.ts$/, '.js') : childModule(target);
      imports.set(specifier!, pathToFileURL(compiled).href);
    }
  } finally {
    compiling.delete(file);
  }
  // The imports' compiled names carry their own content's hash: a changed import changes this one's.
  const hash = createHash('sha256').update(file).update('\0').update(source).update('\0').update(JSON.stringify([...imports])).digest('hex').slice(0, 16);
  const out = join(OUT, `${basename(file, '.ts')}-${hash}.mjs`);
  if (existsSync(out)) return out;
  // typescript is loaded only when something is compiled: a run compiles each module once.
  const ts = createRequire(import.meta.url)('typescript') as typeof import('typescript');
  const js = ts
    .transpileModule(source, { fileName: file, compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 } })
    .outputText.replace(RELATIVE_IMPORT, (whole, keyword: string, quote: string, specifier: string) => (imports.has(specifier) ? `${keyword}${quote}${imports.get(specifier)}${quote}` : whole))
    // And it still knows itself by the file it was compiled from.
    .replace(/\bimport\.meta\.(url|filename|dirname)\b/g, (_, name: string) => JSON.stringify(name === 'url' ? pathToFileURL(file).href : name === 'filename' ? file : dirname(file)));
  mkdirSync(OUT, { recursive: true });
  // Written whole, then renamed: vitest's worker processes may compile the same module at once.
  const partial = `${out}.${process.pid}.partial`;
  writeFileSync(partial, js);
  renameSync(partial, out);
  return out;
}
