// npm run chaos [-- --json] [-- --short]: the chaos campaign, with a table (or one JSON
// object) of what the independent checker found. Exit code 1 if any violation count is not 0.
import { FULL, formatReport, runChaos, SHORT, violations } from './chaos.ts';

const args = new Set(process.argv.slice(2));
const opts = args.has('--short') ? SHORT : FULL;
const report = await runChaos({ ...opts, progress: (line) => process.stderr.write(`${line}\n`) });
process.stdout.write(args.has('--json') ? `${JSON.stringify(report)}\n` : `${formatReport(report)}\n`);
process.exit(violations(report) === 0 ? 0 : 1);
