/**
 * Company B's client in the neighbours bench, in a process of its own: B's latencies are
 * what B's client sees, not the time the bench's own event loop spends on A's load.
 * Takes `{ samples }` messages, answers each with B's latencies (ms) and how many of B's
 * requests were refused.
 */

const base = process.env.NB_BASE!;
const token = process.env.NB_TOKEN!;
const headers = { authorization: `Bearer ${token}`, 'content-type': 'application/json' };
type Measure = 'enqueue' | 'read' | 'attention' | 'endToEnd';
let round = 0;

async function measure(samples: number): Promise<{ times: Record<Measure, number[]>; refused: Record<string, number> }> {
  const times: Record<Measure, number[]> = { enqueue: [], read: [], attention: [], endToEnd: [] };
  const refused: Record<string, number> = {};
  const timed = async (what: Measure, run: () => Promise<Response>) => {
    const t0 = performance.now();
    const res = await run();
    await res.arrayBuffer();
    times[what].push(performance.now() - t0);
    if (res.status === 429 || res.status >= 500) refused[`${what} ${res.status}`] = (refused[`${what} ${res.status}`] ?? 0) + 1;
  };
  const post = (path: string, body: unknown, extra: Record<string, string> = {}) =>
    fetch(`${base}${path}`, { method: 'POST', headers: { ...headers, ...extra }, body: JSON.stringify(body) });
  round++;
  for (let i = 0; i < samples; i++) {
    // B keeps to its own budget (a walk 4 times a second, under the default 5): it is measured, not limited.
    const started = performance.now();
    const lease = `/v1/leases/noop/b/env/b-${i % 20}`;
    await timed('enqueue', () => post(`${lease}/operations`, { op: 'stop', params: { providerLeaseId: `b-${i % 20}` } }));
    await timed('read', () => fetch(`${base}${lease}`, { headers }));
    await timed('attention', () => fetch(`${base}/v1/attention?limit=50`, { headers }));
    await timed('endToEnd', () => post(`/v1/leases/noop/b/env/e2e-${round}-${i}/operations`, { op: 'acquire', params: { runId: `e${round}-${i}` } }, { prefer: 'wait=10' }));
    await new Promise((r) => setTimeout(r, Math.max(0, 250 - (performance.now() - started))));
  }
  return { times, refused };
}

process.on('message', (msg: { samples?: number; stop?: true }) => {
  if (msg.stop) process.exit(0);
  void measure(msg.samples ?? 40).then((result) => process.send!(result));
});
process.send!('ready');
