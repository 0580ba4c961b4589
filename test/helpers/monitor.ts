import { connect, type Socket } from 'node:net';

/** One command a Redis MONITOR saw: its arguments, and who sent it ('lua' for a script's own calls). */
export interface MonitoredCommand {
  args: string[];
  source: string;
}

/**
 * Redis' MONITOR over a socket of its own. ioredis' `monitor()` marks its connection as
 * monitoring only in a promise callback after MONITOR's +OK, so a monitor line that arrives in
 * the same read as the +OK reaches its command queue and throws "Command queue state error"
 * (seen in a suite run on a busy machine).
 */
export class RedisMonitor {
  private constructor(private readonly socket: Socket) {}

  static async start(host: string, port: number, seen: (command: MonitoredCommand) => void): Promise<RedisMonitor> {
    const socket = connect({ host, port });
    socket.setEncoding('utf8');
    const refused = (err: Error) => {
      socket.destroy();
      throw err;
    };
    await new Promise<void>((resolve, reject) => {
      socket.once('error', reject);
      let buffered = '';
      let ok = false;
      socket.on('data', (chunk: string) => {
        buffered += chunk;
        let end: number;
        while ((end = buffered.indexOf('\r\n')) !== -1) {
          const line = buffered.slice(0, end);
          buffered = buffered.slice(end + 2);
          if (!ok) {
            if (line !== '+OK') return reject(new Error(`MONITOR answered ${line}`));
            ok = true;
            resolve();
          } else if (line.startsWith('+')) {
            const parsed = parseMonitorLine(line.slice(1));
            if (parsed) seen(parsed);
          }
        }
      });
      socket.write('MONITOR\r\n');
    }).catch(refused);
    return new RedisMonitor(socket);
  }

  close(): void {
    this.socket.destroy();
  }
}

/** `1700000000.123456 [0 127.0.0.1:5000] "evalsha" "ab" "1"` (or `[0 lua]`) as its parts. */
export function parseMonitorLine(line: string): MonitoredCommand | null {
  const match = /^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$/.exec(line);
  if (!match) return null;
  const args: string[] = [];
  const quoted = match[2]!;
  let i = 0;
  while (i < quoted.length) {
    if (quoted[i] !== '"') {
      i++;
      continue;
    }
    let arg = '';
    i++;
    while (i < quoted.length && quoted[i] !== '"') {
      if (quoted[i] === '\\') {
        const next = quoted[i + 1];
        if (next === 'x') {
          arg += String.fromCharCode(parseInt(quoted.slice(i + 2, i + 4), 16));
          i += 4;
          continue;
        }
        arg += next === 'n' ? '\n' : next === 'r' ? '\r' : next === 't' ? '\t' : next === 'a' ? '\u0007' : next === 'b' ? '\b' : next;
        i += 2;
        continue;
      }
      arg += quoted[i];
      i++;
    }
    args.push(arg);
    i++;
  }
  return { args, source: match[1]! };
}
