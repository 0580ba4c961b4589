import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { FakeReply } from './http-fake.ts';

const MAX_LOG_CHARS = 16 * 1024 * 1024;

/** A command run in a session: a real process (its own process group), its output and exit. */
interface SessionCommand {
  id: string;
  command: string;
  child: ChildProcess;
  stdout: string;
  stderr: string;
  exitCode: number | null;
  ended: boolean;
  /** When the process exited, on the shared clock (process.hrtime.bigint()). */
  endedAt: bigint | null;
}

/**
 * The sandbox daemon's process sessions as Daytona's toolbox serves them (apps/daemon,
 * pkg/toolbox/process/session: CreateSessionRequest {sessionId}, SessionExecuteRequest
 * {command, runAsync} -> {cmdId}, Command {id, command, exitCode?}, SessionCommandLogsResponse
 * {stdout, stderr}, DELETE ends the session's processes). Commands run as real `sh -c`
 * processes in a directory of their sandbox's own, so a test can run one that ignores its
 * SIGTERM for a while, as an agent's command may.
 */
export class DaytonaToolbox {
  private readonly sessions = new Map<string, Map<string, SessionCommand>>();
  private readonly dirs = new Map<string, string>();

  private key = (sandboxId: string, sessionId: string) => `${sandboxId}\0${sessionId}`;

  /** Processes of a sandbox that have not exited yet. */
  alive(sandboxId: string): number {
    let n = 0;
    for (const [key, commands] of this.sessions) if (key.startsWith(`${sandboxId}\0`)) for (const c of commands.values()) if (!c.ended) n++;
    return n;
  }

  /** When each of a sandbox's processes exited (shared clock), in no order; live ones are left out. */
  exits(sandboxId: string): bigint[] {
    const found: bigint[] = [];
    for (const [key, commands] of this.sessions) if (key.startsWith(`${sandboxId}\0`)) for (const c of commands.values()) if (c.endedAt !== null) found.push(c.endedAt);
    return found;
  }

  /** SIGTERM (or `signal`) to every live process of a sandbox, as a stop or a session's end sends. */
  signal(sandboxId: string, signal: NodeJS.Signals = 'SIGTERM', sessionId?: string): void {
    for (const [key, commands] of this.sessions) {
      if (!key.startsWith(`${sandboxId}\0`) || (sessionId !== undefined && key !== this.key(sandboxId, sessionId))) continue;
      for (const c of commands.values()) if (!c.ended && c.child.pid) try { process.kill(-c.child.pid, signal); } catch { /* gone meanwhile */ }
    }
  }

  route(method: string, sandboxId: string, rest: string, body: unknown): FakeReply {
    const json = (status: number, value: unknown): FakeReply => ({ status, body: value });
    if (method === 'POST' && rest === '/process/session') {
      const sessionId = (body as { sessionId?: unknown } | undefined)?.sessionId;
      if (typeof sessionId !== 'string' || !sessionId) return json(400, { message: 'sessionId is required' });
      if (this.sessions.has(this.key(sandboxId, sessionId))) return json(409, { message: `session ${sessionId} already exists` });
      this.sessions.set(this.key(sandboxId, sessionId), new Map());
      return { status: 201, body: undefined };
    }
    const m = /^\/process\/session\/([^/]+)(?:\/(exec)|\/command\/([^/]+)(\/logs)?)?$/.exec(rest);
    if (!m) return json(404, { message: `Cannot ${method} ${rest}` });
    const sessionId = decodeURIComponent(m[1]!);
    const session = this.sessions.get(this.key(sandboxId, sessionId));
    if (!session) return json(404, { message: `session ${sessionId} not found` });
    if (method === 'DELETE' && !m[2] && !m[3]) {
      this.signal(sandboxId, 'SIGTERM', sessionId);
      // The session goes; its commands stay readable until they exit (for this fake's reads).
      return { status: 204, body: undefined };
    }
    if (method === 'POST' && m[2] === 'exec') {
      const command = (body as { command?: unknown } | undefined)?.command;
      if (typeof command !== 'string' || !command) return json(400, { message: 'command is required' });
      const id = randomUUID();
      let child: ChildProcess;
      try {
        child = spawn('sh', ['-c', command], { cwd: this.dirOf(sandboxId), detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
      } catch {
        // Node's own message would quote the command line.
        return json(400, { message: 'the command could not be started' });
      }
      const cmd: SessionCommand = { id, command, child, stdout: '', stderr: '', exitCode: null, ended: false, endedAt: null };
      // A daemon keeps a bounded log per command; the rest of a flood is dropped.
      child.stdout!.on('data', (d) => cmd.stdout.length < MAX_LOG_CHARS && (cmd.stdout += String(d)));
      child.stderr!.on('data', (d) => cmd.stderr.length < MAX_LOG_CHARS && (cmd.stderr += String(d)));
      child.on('close', (code, signal) => {
        cmd.ended = true;
        cmd.endedAt = process.hrtime.bigint();
        // A shell's convention for a command ended by a signal: 128 + its number.
        cmd.exitCode = code ?? 128 + (signal === 'SIGKILL' ? 9 : signal === 'SIGTERM' ? 15 : 1);
      });
      child.on('error', (err) => {
        cmd.ended = true;
        cmd.exitCode = 127;
        cmd.stderr += String(err);
      });
      session.set(id, cmd);
      return json(200, { cmdId: id });
    }
    const cmd = m[3] ? session.get(decodeURIComponent(m[3])) : undefined;
    if (method === 'GET' && cmd && !m[4]) return json(200, { id: cmd.id, command: cmd.command, ...(cmd.ended ? { exitCode: cmd.exitCode } : {}) });
    if (method === 'GET' && cmd && m[4]) return json(200, { stdout: cmd.stdout, stderr: cmd.stderr });
    return json(404, { message: 'command not found' });
  }

  private dirOf(sandboxId: string): string {
    let dir = this.dirs.get(sandboxId);
    if (!dir) {
      dir = mkdtempSync(join(tmpdir(), 'lease-ops-sandbox-'));
      this.dirs.set(sandboxId, dir);
    }
    return dir;
  }

  /** Kills every process left and removes the sandboxes' directories. */
  close(): void {
    for (const [key] of this.sessions) this.signal(key.split('\0')[0]!, 'SIGKILL');
    for (const dir of this.dirs.values()) rmSync(dir, { recursive: true, force: true });
    this.sessions.clear();
    this.dirs.clear();
  }
}
