import { randomUUID } from 'node:crypto';
import axios from 'axios';
import { z } from 'zod';
import { isAxiosError } from 'axios';
import { PermanentError, TransientError } from '../errors.ts';
import { errorForStatus, networkError } from '../http-errors.ts';
import { fencedTransport } from '../fenced-transport.ts';
import type { ExecRequest, ExecResult, OperationContext } from '../types.ts';

const ExecReplySchema = z.object({ cmdId: z.string().min(1) });
const CommandReplySchema = z.object({ id: z.string(), exitCode: z.number().int().nullish() });
const LogsReplySchema = z.object({ stdout: z.string().default(''), stderr: z.string().default('') });

/** A word for `sh`: single-quoted, with any quote in it closed, escaped and reopened. */
export const shellQuote = (word: string) => `'${word.replaceAll("'", `'\\''`)}'`;

/**
 * The one shell line the daemon runs: `cd` to the cwd, the environment, the command (with
 * its arguments quoted when given apart; as a shell line when not), stdin piped in.
 */
export function shellLine(request: ExecRequest): string {
  const env = Object.entries(request.env ?? {}).map(([k, v]) => `${k}=${shellQuote(v)}`);
  const program = request.args ? [shellQuote(request.command), ...request.args.map(shellQuote)].join(' ') : request.command;
  const run = `${env.length ? `env ${env.join(' ')} ` : ''}sh -c ${shellQuote(program)}`;
  const withInput = request.stdin === undefined ? `${run} < /dev/null` : `printf '%s' ${shellQuote(request.stdin)} | ${run}`;
  return request.cwd ? `cd ${shellQuote(request.cwd)} && ${withInput}` : withInput;
}

export interface ToolboxDeps {
  name: string;
  apiKey: string;
  organizationId: string | undefined;
  timeoutMs: number;
  /** The toolbox's address for this sandbox (GET /sandbox/{id}/toolbox-proxy-url), paced like any read. */
  proxyUrl(ctx: OperationContext, sandboxId: string): Promise<string>;
  /** Waits for the 'authenticated' throttler's turn. */
  pace(ctx: OperationContext): Promise<void>;
}

/** The most of a command's output read back from the toolbox (its answer then says it was cut). */
const MAX_LOGS_BYTES = 8 * 1024 * 1024;

/**
 * A toolbox call's failure by its status alone: the toolbox may quote the request (the
 * command line, with the env it carries) in its message, which must not reach anyone.
 */
function toolboxError(name: string, err: unknown): Error {
  if (isAxiosError(err) && err.response) {
    const status = err.response.status;
    if (status === 400 && /not started/i.test(JSON.stringify(err.response.data ?? '').slice(0, 500))) {
      return new PermanentError('sandbox_not_running', `${name}: the sandbox is not running`);
    }
    return errorForStatus(name, status, `the toolbox refused the request`);
  }
  if (isAxiosError(err) && err.code === 'ERR_BAD_RESPONSE') return new TransientError('exec_output_too_large', `${name}: the command's output is larger than ${MAX_LOGS_BYTES} bytes`);
  return networkError(name, err) ?? new TransientError('provider_error', `${name}: the toolbox could not be reached`);
}

/**
 * Runs a command in a Daytona sandbox through its toolbox's process sessions: a session of
 * its own, the command run async, its state read until it exits. A cancel (ctx.signal) or
 * the timeout deletes the session (the daemon ends its processes); the command is read on
 * until it exits or `graceMs` passed, so a caller learns when the work really ended.
 */
export async function daytonaExec(deps: ToolboxDeps, ctx: OperationContext, sandboxId: string, request: ExecRequest, graceMs: number): Promise<ExecResult> {
  const base = `${(await deps.proxyUrl(ctx, sandboxId)).replace(/\/+$/, '')}/${encodeURIComponent(sandboxId)}`;
  const toolbox = async (method: 'GET' | 'POST' | 'DELETE', path: string, data?: unknown): Promise<unknown> => {
    await deps.pace(ctx);
    try {
      const res = await axios.request({
        method,
        url: `${base}${path}`,
        data,
        timeout: deps.timeoutMs,
        maxRedirects: 0,
        headers: {
          authorization: `Bearer ${deps.apiKey}`,
          'X-Lease-Ops-Attempt': ctx.attemptId,
          ...(deps.organizationId ? { 'X-Daytona-Organization-ID': deps.organizationId } : {}),
        },
        transport: fencedTransport(() => ctx.fenceIsFresh()),
        maxContentLength: MAX_LOGS_BYTES,
      });
      return res.data;
    } catch (err) {
      throw toolboxError(deps.name, err);
    }
  };
  const parse = <T>(schema: z.ZodType<T>, data: unknown): T => {
    const parsed = schema.safeParse(data);
    if (!parsed.success) throw new TransientError('invalid_provider_reply', `${deps.name}: unexpected toolbox reply: ${z.prettifyError(parsed.error)}`);
    return parsed.data;
  };
  const sessionId = `lease-ops-${randomUUID()}`;
  const session = `/process/session/${encodeURIComponent(sessionId)}`;
  await toolbox('POST', '/process/session', { sessionId });
  let sessionOpen = true;
  const endSession = async () => {
    if (!sessionOpen) return;
    sessionOpen = false;
    await toolbox('DELETE', session).catch((err: unknown) => ctx.log.warn({ err }, 'could not end the exec session'));
  };
  try {
    const { cmdId } = parse(ExecReplySchema, await toolbox('POST', `${session}/exec`, { command: shellLine(request), runAsync: true }));
    const command = `${session}/command/${encodeURIComponent(cmdId)}`;
    const startedAt = Date.now();
    let stoppedAt: number | null = null;
    let timedOut = false;
    let cancelled = false;
    let exitCode: number | null = null;
    // Read often at first (most commands are short), then once a second.
    for (let wait = 50; ; wait = Math.min(wait * 2, 1_000)) {
      let reply: z.infer<typeof CommandReplySchema> | null = null;
      try {
        reply = parse(CommandReplySchema, await toolbox('GET', command));
      } catch (err) {
        // The sandbox stopped under the command (stopped by someone else): it ended with it.
        if (err instanceof PermanentError && err.code === 'sandbox_not_running') {
          sessionOpen = false;
          return { exitCode: null, signal: 'SIGKILL', timedOut, cancelled, stdout: '', stderr: '[lease-ops: the sandbox stopped while the command ran; its output went with it]' };
        }
        // After the session was deleted the daemon may not know the command any more.
        if (stoppedAt === null || !(err instanceof PermanentError)) throw err;
      }
      if (reply && typeof reply.exitCode === 'number') {
        exitCode = reply.exitCode;
        break;
      }
      const now = Date.now();
      if (stoppedAt === null && (ctx.signal.aborted || now - startedAt >= request.timeoutMs)) {
        stoppedAt = now;
        cancelled = ctx.signal.aborted;
        timedOut = !cancelled;
        await endSession();
      }
      if (stoppedAt !== null && (reply === null || now - stoppedAt >= graceMs)) break;
      const untilTimeout = stoppedAt === null ? Math.max(1, request.timeoutMs - (now - startedAt)) : wait;
      await new Promise<void>((resolve) => {
        const timer = setTimeout(done, Math.min(wait, untilTimeout));
        function done() {
          clearTimeout(timer);
          ctx.signal.removeEventListener('abort', done);
          resolve();
        }
        ctx.signal.addEventListener('abort', done, { once: true });
      });
    }
    const logs = await toolbox('GET', `${command}/logs`)
      .then((data) => parse(LogsReplySchema, data))
      .catch((err: unknown) => ({ stdout: '', stderr: `[lease-ops: the output could not be read: ${(err as Error).message}]` }));
    return { exitCode, signal: null, timedOut, cancelled, stdout: logs.stdout, stderr: logs.stderr };
  } finally {
    await endSession();
  }
}
