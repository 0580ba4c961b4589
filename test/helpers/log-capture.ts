import { Writable } from 'node:stream';
import { createLogger, type Logger } from '../../src/logger.ts';

/** A logger (debug and up) whose lines the test can read. */
export function captureLog(): { lines: string[]; log: Logger } {
  const lines: string[] = [];
  const sink = new Writable({
    write(chunk, _enc, done) {
      lines.push(String(chunk));
      done();
    },
  });
  return { lines, log: createLogger({ level: 'debug', destination: sink }) };
}
