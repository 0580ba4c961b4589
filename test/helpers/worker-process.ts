import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { copyFileSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { childModule } from './child-module.ts';
import type { Finished } from './env.ts';

const BIN = fileURLToPath(new URL('../../bin/lease-ops.js', import.meta.url));

/** A `lease-ops worker` child process started from the real entry point. */
export class WorkerProcess {
  readonly child: ChildProcess;
  readonly ready: Promise<void>;
  readonly exited: Promise<number | null>;
  readonly logs: string[] = [];
  private readonly reports: string;
  private readonly lineListeners = new Set<(line: string) => void>();

  constructor(env: Record<string, string>) {
    // The CLI runs compiled code; a provider module given as a .ts file (the tests' own) is
    // handed to it compiled (childModule), so the child needs no TypeScript loader; unless the
    // test gives it tsx's loader itself, as docs/providers.md tells a user to.
    if (env.LEASE_OPS_PROVIDERS && !env.NODE_OPTIONS?.includes('tsx')) env = { ...env, LEASE_OPS_PROVIDERS: env.LEASE_OPS_PROVIDERS.split(',').map((name) => (name.trim().endsWith('.ts') ? childModule(resolve(name.trim())) : name)).join(',') };
    // A diagnostic report on SIGUSR2 (written by Node's own signal listener, so only while the
    // event loop turns): terminate() asks for one when the worker does not stop, and shows its stacks.
    this.reports = mkdtempSync(join(tmpdir(), 'lease-ops-worker-report-'));
    const report = ['--report-on-signal', '--report-signal=SIGUSR2', `--report-directory=${this.reports}`];
    this.child = spawn(process.execPath, [...report, BIN, 'worker'], {
      env: { ...process.env, LEASE_OPS_LOG_LEVEL: 'info', ...env },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    this.exited = once(this.child, 'exit').then(([code]) => {
      rmSync(this.reports, { recursive: true, force: true });
      return code as number | null;
    });
    let onReady!: () => void;
    this.ready = new Promise((resolve, reject) => {
      onReady = resolve;
      void this.exited.then((code) => reject(new Error(`worker exited (${code}) before it was ready:\n${this.logs.join('\n')}`)));
    });
    this.ready.catch(() => undefined);
    for (const stream of [this.child.stdout!, this.child.stderr!]) {
      createInterface({ input: stream }).on('line', (line) => {
        this.logs.push(line);
        // The latest lines only: a long campaign's workers log hundreds of thousands.
        if (this.logs.length > 20_000) this.logs.splice(0, 10_000);
        if (line.includes('"worker started"')) onReady();
        for (const listener of this.lineListeners) listener(line);
      });
    }
  }

  /**
   * Resolves when the worker logs a line containing `text`. A fault point's pause line resolves
   * once the process has stopped: it writes the line just before it stops itself, and a SIGCONT
   * sent in between would be lost, leaving it stopped for good (a flaky test under load).
   */
  async waitForLog(text: string, timeoutMs = 30_000): Promise<string> {
    const line = await this.logLine(text, timeoutMs);
    if (/lease-ops fault point \S+: pause/.test(line)) await this.stopped(timeoutMs);
    return line;
  }

  /** Resolves when the process is stopped (state T in /proc): a state, looked at until it holds. */
  private async stopped(timeoutMs: number): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const state = (() => {
        try {
          return /^\d+ \(.*\) (\S)/.exec(readFileSync(`/proc/${this.pid}/stat`, 'utf8'))?.[1];
        } catch {
          return 'gone';
        }
      })();
      if (state === 'T' || state === 't') return;
      if (state === 'gone' || Date.now() > deadline) throw new Error(`worker did not stop at its pause fault point (state ${state})`);
      await new Promise((r) => setTimeout(r, 2));
    }
  }

  private logLine(text: string, timeoutMs: number): Promise<string> {
    const seen = this.logs.find((l) => l.includes(text));
    if (seen) return Promise.resolve(seen);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`worker never logged "${text}"; its last lines:\n${this.logs.slice(-15).join('\n')}`)), timeoutMs);
      const onLine = (line: string) => {
        if (!line.includes(text)) return;
        clearTimeout(timer);
        this.lineListeners.delete(onLine);
        resolve(line);
      };
      this.lineListeners.add(onLine);
    });
  }

  get pid(): number {
    return this.child.pid!;
  }

  /**
   * SIGKILL: no clean-up, no hand-back. Returns, on the shared clock, when the process was
   * seen dead: the signal lands a moment after it is sent, and the process may still write
   * a record in between, so the time it was sent is no bound for its last call.
   */
  async kill(): Promise<bigint> {
    this.child.kill('SIGKILL');
    await this.exited;
    return process.hrtime.bigint();
  }

  /**
   * SIGTERM: graceful stop; resolves with the exit code. A worker still running `timeoutMs`
   * later is killed, and this rejects with what it was doing (each thread's state, a
   * diagnostic report's stacks, kept in the temporary directory) and its last lines: a stop
   * that hangs fails its test with that, not as a hook's timeout.
   */
  async terminate(timeoutMs = 20_000): Promise<number | null> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return this.exited;
    this.child.kill('SIGTERM');
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), timeoutMs)));
    const code = await Promise.race([this.exited, late]).finally(() => clearTimeout(timer));
    if (code !== 'late') return code;
    // What the process was doing: stopped, sleeping in the kernel, or running (a busy loop).
    const state = (() => {
      try {
        const status = readFileSync(`/proc/${this.pid}/status`, 'utf8');
        const threads = readdirSync(`/proc/${this.pid}/task`).map((t) => `${t}:${/^State:\s+(\S+)/m.exec(readFileSync(`/proc/${this.pid}/task/${t}/status`, 'utf8'))?.[1]}/${readFileSync(`/proc/${this.pid}/task/${t}/wchan`, 'utf8')}`);
        return `${/^State:\s+(.*)$/m.exec(status)?.[1]}; SigPnd ${/^ShdPnd:\s+(.*)$/m.exec(status)?.[1]}; SigCgt ${/^SigCgt:\s+(.*)$/m.exec(status)?.[1]}; threads ${threads.join(' ')}`;
      } catch {
        return 'unknown';
      }
    })();
    this.child.kill('SIGUSR2');
    const kept = join(tmpdir(), `lease-ops-worker-report-${this.pid}.json`);
    let stack = 'no report';
    for (let i = 0; i < 30 && stack === 'no report'; i++) {
      await new Promise((r) => setTimeout(r, 100));
      const file = readdirSync(this.reports).find((f) => f.endsWith('.json'));
      try {
        if (file) {
          copyFileSync(join(this.reports, file), kept);
          const r = JSON.parse(readFileSync(join(this.reports, file), 'utf8')) as { javascriptStack?: { message?: string; stack?: string[] }; nativeStack?: { symbol?: string }[] };
          stack = [r.javascriptStack?.message, ...(r.javascriptStack?.stack ?? []).slice(0, 25), 'native:', ...(r.nativeStack ?? []).slice(0, 25).map((f) => f.symbol)].join('\n');
        }
      } catch {
        // Still being written.
      }
    }
    this.child.kill('SIGKILL');
    await this.exited;
    throw new Error(`worker ${this.pid} did not stop within ${timeoutMs} ms of SIGTERM (state: ${state}); its stacks (whole report: ${kept}):\n${stack}\nits last lines:\n${this.logs.slice(-30).join('\n')}`);
  }
}

/** Kills every worker of the list (paused ones too) and empties it, once each has exited. */
export async function killAll(workers: WorkerProcess[]): Promise<void> {
  for (const w of workers.splice(0)) {
    w.child.kill('SIGCONT');
    w.child.kill('SIGKILL');
    await w.exited;
  }
}

/** A worker process killed (paused or not) when the test ends, pass or fail: pass the test context's onTestFinished. */
export function workerFor(finished: Finished, env: Record<string, string>): WorkerProcess {
  const worker = new WorkerProcess(env);
  finished(async () => {
    worker.child.kill('SIGCONT');
    await worker.kill();
  });
  return worker;
}
