#!/usr/bin/env node
// Runs the compiled CLI (dist/, built by `npm run build`; `npm ci` in a checkout builds it too).
try {
  await import('../dist/cli.js');
} catch (err) {
  if (err?.code !== 'ERR_MODULE_NOT_FOUND' || !String(err.message).includes('dist/cli.js')) throw err;
  process.stderr.write('lease-ops: dist/ is missing: run `npm run build` in this checkout\n');
  process.exit(2);
}
