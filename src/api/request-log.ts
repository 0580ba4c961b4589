import type { NextFunction, Request, Response } from 'express';
import type { Logger } from '../logger.ts';

type Level = 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace' | 'silent';

export interface RequestLogOptions {
  /** Requests that get no line of their own (probes, scrapes). */
  ignore: (req: Request) => boolean;
  /** What the request is on its line, already stripped of what must not be logged. */
  describe: (req: Request) => Record<string, unknown>;
  /** Bindings read when the line is written (whose request it was). */
  props: (res: Response) => Record<string, unknown>;
  /** The line's level; 'silent' writes none. */
  level: (res: Response, err: Error | undefined) => Level;
  /** The fields of a line for a 5xx or an error, from what would be logged. */
  errorFields: (res: Response, fields: Record<string, unknown>) => Record<string, unknown>;
  errorMessage: (res: Response) => string;
}

const LOGGER = Symbol('requestLogger');
const STARTED = Symbol('requestStarted');
type Logged = Request & { id?: number; [LOGGER]?: Logger; [STARTED]?: number };

let lastId = 0;

/**
 * The logger of one request: the API's, bound to the request (its id, method and URL), made
 * the first time something logs for it.
 */
export function requestLogger(log: Logger, req: Request, describe: RequestLogOptions['describe']): Logger {
  const logged = req as Logged;
  return (logged[LOGGER] ??= log.child({ req: describe(req) }));
}

/**
 * One line per request when its answer is done or its connection closed, with pino-http's
 * fields (`req`, `res`, `responseTime`, `err`) and messages ("request completed", "request
 * aborted" for one its caller left or whose connection was cut, or the error's message).
 * pino-http built a child logger (two, with bindings of its own) for every request, logged or
 * not: about 200 µs of a /healthz answer's 880 µs of the API's CPU here. Here the line's
 * level is decided first, and nothing is built for a request whose line is not written (a
 * probe, a level below the logger's, a company's refusal counted instead).
 */
export function requestLog(log: Logger, options: RequestLogOptions) {
  return (req: Request, res: Response, next: NextFunction): void => {
    const logged = req as Logged;
    logged.id ??= lastId = (lastId + 1) & 0x7fffffff;
    logged[STARTED] = Date.now();
    if (!options.ignore(req)) {
      const done = (err?: Error) => {
        res.off('close', onClose);
        res.off('finish', onClose);
        res.off('error', done);
        writeLine(log, options, logged, res, err);
      };
      const onClose = () => done();
      res.on('close', onClose);
      res.on('finish', onClose);
      res.on('error', done);
    }
    next();
  };
}

function writeLine(log: Logger, options: RequestLogOptions, req: Logged, res: Response, err: Error | undefined): void {
  const level = options.level(res, err);
  if (level === 'silent' || !log.isLevelEnabled(level)) return;
  const line = requestLogger(log, req, options.describe);
  const props = options.props(res);
  const fields = { ...props, res: { statusCode: res.statusCode }, responseTime: Date.now() - (req[STARTED] ?? Date.now()) };
  if (err || res.statusCode >= 500) {
    const error = err ?? new Error(`failed with status code ${res.statusCode}`);
    line[level](options.errorFields(res, { ...fields, err: error }), options.errorMessage(res));
    return;
  }
  // As pino-http said: a request its caller left, or whose connection was cut, was not answered.
  line[level](fields, !req.readableAborted && res.writableEnded ? 'request completed' : 'request aborted');
}
