import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { basename, dirname, join, relative, resolve, sep } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { threadId } from 'node:worker_threads';

const require = createRequire(import.meta.url);
const ROOT = fileURLToPath(new URL('../..', import.meta.url));
const SRC = join(ROOT, 'src') + sep;
const DIST = join(ROOT, 'dist') + sep;
const OUT = join(ROOT, '.cache', 'child-modules');
const COMPILER_OPTIONS = { module: 'ESNext', target: 'ES2022' } as const;
/** What makes the output: this file's rules, TypeScript's version and the options. A change of any compiles everything again. */
const COMPILER = createHash('sha256')
  .update(readFileSync(fileURLToPath(import.meta.url)))
  .update((JSON.parse(readFileSync(require.resolve('typescript/package.json'), 'utf8')) as { version: string }).version)
  .update(JSON.stringify(COMPILER_OPTIONS))
  .digest('hex');

/**
 * A test's TypeScript module (a provider given to a `lease-ops worker` child) as JavaScript
 * the child can load without tsx: Node 20 cannot run TypeScript, and tsx's loader took a
 * worker's start from 0.45 to 0.9 s of CPU here, in a suite that starts a hundred of them.
 * Its imports of `src/` point at the compiled `dist/` (the code the child runs, built before
 * the tests), as a provider package's imports of lease-ops would; its imports of other test
 * modules are compiled the same way; its other relative imports, and `import.meta.url`,
 * `.filename` and `.dirname`, still name the files beside its source. Not rewritten: an
 * import whose specifier is not a string literal, and `import.meta.resolve`. Compiled once
 * per content (its own, its imports' and the compiler's), into `.cache/child-modules`; a run
 * compiles in its global setup what its children load (test/helpers/build-setup.ts), so no
 * test waits on TypeScript loading in its own process.
 */
export function childModule(file: string, importing: readonly string[] = []): string {
  if (importing.includes(file)) throw new Error(`childModule: ${[...importing, file].join(' -> ')} is a cycle of test modules`);
  const chain = [...importing, file];
  const source = readFileSync(file, 'utf8');
  const own = join(OUT, `${basename(file, '.ts')}-${createHash('sha256').update(COMPILER).update(file).update('\0').update(source).digest('hex').slice(0, 16)}`);
  // The test modules it imports, found once per content of its own.
  let compiled: { js: string; testModules: string[] } | null = null;
  let testModules = existsSync(`${own}.imports.json`) ? (JSON.parse(readFileSync(`${own}.imports.json`, 'utf8')) as string[]) : null;
  if (!testModules) {
    compiled = compile(file, source, chain);
    testModules = compiled.testModules;
    mkdirSync(OUT, { recursive: true });
    writeWhole(`${own}.imports.json`, JSON.stringify(testModules));
  }
  // Its name takes in theirs, which take in their content: a changed import makes a new name.
  const out = `${own}-${createHash('sha256').update(testModules.map((dep) => childModule(dep, chain)).join('\0')).digest('hex').slice(0, 8)}.mjs`;
  if (existsSync(out)) return out;
  compiled ??= compile(file, source, chain);
  mkdirSync(OUT, { recursive: true });
  writeWhole(out, compiled.js);
  return out;
}

/** Written whole, then renamed: vitest's workers (processes, or threads of one) may compile the same module at once. */
function writeWhole(path: string, text: string): void {
  const partial = `${path}.${process.pid}.${threadId}.${Math.random().toString(36).slice(2)}.partial`;
  writeFileSync(partial, text);
  renameSync(partial, path);
}

function compile(file: string, source: string, importing: readonly string[]): { js: string; testModules: string[] } {
  // Loaded only here, where something is compiled (0.3-0.4 s the first time in a process).
  const ts = require('typescript') as typeof import('typescript');
  const tree = ts.createSourceFile(file, source, ts.ScriptTarget.ES2022, true);
  const edits: { start: number; end: number; text: string }[] = [];
  const testModules: string[] = [];
  const specifierAt = (literal: import('typescript').StringLiteral) => {
    const specifier = literal.text;
    if (!/^\.\.?\//.test(specifier)) return;
    let target = resolve(dirname(file), specifier);
    // NodeNext's way of naming a .ts module, as tsx resolves it.
    if (target.endsWith('.js') && !existsSync(target) && existsSync(target.replace(/\.js$/, '.ts'))) target = target.replace(/\.js$/, '.ts');
    // What the child loads in its place: dist's module for src's, a compiled test module, or the file itself.
    let loaded = target;
    if (target.endsWith('.ts') && target.startsWith(SRC)) loaded = join(DIST, relative(SRC, target)).replace(/\.ts$/, '.js');
    else if (target.endsWith('.ts')) {
      loaded = childModule(target, importing);
      if (!testModules.includes(target)) testModules.push(target);
    }
    edits.push({ start: literal.getStart(tree), end: literal.getEnd(), text: JSON.stringify(pathToFileURL(loaded).href) });
  };
  const visit = (node: import('typescript').Node): void => {
    // Type-only imports and exports vanish from the output: nothing to load, and no cycle.
    if ((ts.isImportDeclaration(node) && !node.importClause?.isTypeOnly) || (ts.isExportDeclaration(node) && !node.isTypeOnly)) {
      if (node.moduleSpecifier && ts.isStringLiteral(node.moduleSpecifier)) specifierAt(node.moduleSpecifier);
    } else if (ts.isCallExpression(node) && node.expression.kind === ts.SyntaxKind.ImportKeyword && node.arguments[0] && ts.isStringLiteralLike(node.arguments[0])) {
      specifierAt(node.arguments[0] as import('typescript').StringLiteral);
    } else if (ts.isPropertyAccessExpression(node) && ts.isMetaProperty(node.expression) && node.expression.keywordToken === ts.SyntaxKind.ImportKeyword) {
      const value = { url: pathToFileURL(file).href, filename: file, dirname: dirname(file) }[node.name.text];
      if (value !== undefined) edits.push({ start: node.getStart(tree), end: node.getEnd(), text: JSON.stringify(value) });
    }
    ts.forEachChild(node, visit);
  };
  visit(tree);
  let edited = source;
  for (const { start, end, text } of edits.sort((a, b) => b.start - a.start)) edited = edited.slice(0, start) + text + edited.slice(end);
  const js = ts.transpileModule(edited, { fileName: file, compilerOptions: { module: ts.ModuleKind[COMPILER_OPTIONS.module], target: ts.ScriptTarget[COMPILER_OPTIONS.target] } }).outputText;
  return { js, testModules };
}
