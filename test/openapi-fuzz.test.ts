// Issue 12, scenario 14: requests generated from the served /v1/openapi.json (fast-check,
// fixed seed), sent over real HTTP by an admin, scoped tokens and strangers; every response
// must be documented for its route and status and match the document's schema (Ajv).
import { request as httpRequest } from 'node:http';
import { Ajv2020 } from 'ajv/dist/2020.js';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startTestApi, type TestApi } from './helpers/api-server.ts';
import { gate, TestBed } from './helpers/env.ts';
import { createRecordingProvider } from './helpers/recording-provider.ts';
import { MasterKeys } from '../src/providers/instances/sealing.ts';
import { randomBytes } from 'node:crypto';
import { arbitraryFor, type JsonSchema } from './helpers/openapi-arbitrary.ts';

const TOKENS = {
  admin: 'adm_0123456789-fuzz-admin',
  acme: 'acme_0123456789-fuzz-company',
  acmeProd: 'acme_0123456789-fuzz-prod-only',
} as const;
const REQUESTS = 4_000;
const SEED = 20261130;

type Reply = { status: number; headers: Record<string, string | string[] | undefined>; body: string };

/** One HTTP request as node:http sends it: GETs may carry a body here, as they can on the wire. */
function send(base: string, method: string, path: string, headers: Record<string, string>, body?: Buffer, retried = false): Promise<Reply> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(`${base}${path}`, { method, headers: { ...headers, ...(body ? { 'content-length': String(body.length) } : {}) } }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (c: Buffer) => chunks.push(c));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks).toString('utf8') }));
      res.on('error', reject);
    });
    req.on('error', (err: NodeJS.ErrnoException) => {
      // A kept-alive connection the server closed as idle just as this request went out on it
      // (a loaded CI machine, 2026-12-07): sent again once on a new one, as Node's documentation
      // advises. A reset of a new connection is the server's answer, and fails the run.
      if (req.reusedSocket && err.code === 'ECONNRESET' && !retried) resolve(send(base, method, path, headers, body, true));
      else reject(err);
    });
    req.end(body);
  });
}

type Operation = { path: string; method: string; spec: JsonSchema };
type Generated = {
  op: Operation;
  path: string;
  query: string;
  auth: keyof typeof TOKENS | 'none' | 'junk' | 'basic-admin';
  idempotencyKey: string | undefined;
  contentType: string | undefined;
  body: Buffer | undefined;
  /** A job id accepted earlier in the run, by index, for /v1/operations/{jobId}. */
  knownJob: number | null;
  /** Whether a body naming a sandbox names the path's lease, as the API requires. */
  sameSandbox: boolean;
  /** A Content-Encoding the body does not have (or one the server does not know). */
  encoding: string | undefined;
};

const deep = (levels: number): unknown => {
  let v: unknown = 'leaf';
  for (let i = 0; i < levels; i++) v = { n: v };
  return v;
};

function requestsFor(document: JsonSchema): fc.Arbitrary<Generated> {
  const operations: Operation[] = [];
  for (const [path, methods] of Object.entries(document.paths as Record<string, Record<string, JsonSchema>>)) {
    for (const [method, spec] of Object.entries(methods)) operations.push({ path, method: method.toUpperCase(), spec });
  }
  // Enqueue has the most to get wrong: it gets most of the requests; the other routes that read a body some more.
  const weightOf = (op: Operation) => (op.path.endsWith('/operations') ? 3 * operations.length : op.spec.requestBody ? 3 : 1);
  return fc.oneof(...operations.map((op) => ({ weight: weightOf(op), arbitrary: requestsOf(op, document) })));
}

/** Requests to one operation: mostly valid by its document, the rest bent in the ways attackers bend them. */
function requestsOf(op: Operation, document: JsonSchema): fc.Arbitrary<Generated> {
  const oddSegment = fc.constantFrom('%', '%E0%A4%A', '%00', '%2F', '..', '%20', 'a%2Fb', '%C0%AF', 'x'.repeat(300), '\u{1F600}', '');
  {
    const params = (op.spec.parameters as JsonSchema[] | undefined) ?? [];
    const segment = (param: JsonSchema) => {
      const schema = param.schema as JsonSchema;
      // Scoped tokens see acme (and acme/prod): bias the path toward them so both answers come up.
      const scoped =
        param.name === 'companyId'
          ? fc.constant('acme')
          : param.name === 'environmentId'
            ? fc.constantFrom('prod', 'staging')
            : param.name === 'provider'
              ? fc.constant('recording')
              : param.name === 'leaseId'
                ? fc.constantFrom('l1', 'l2')
                : null;
      const valid = arbitraryFor(schema, document).map((v) => encodeURIComponent(String(v)));
      const options = [
        { weight: 5, arbitrary: valid },
        { weight: 2, arbitrary: fc.string({ unit: 'grapheme', maxLength: 40 }).map(encodeURIComponent) },
        { weight: 1, arbitrary: oddSegment },
      ];
      if (scoped) options.push({ weight: 6, arbitrary: scoped.map(encodeURIComponent) });
      return fc.oneof(...options);
    };
    const pathParams = params.filter((p) => p.in === 'path');
    const pathArb = fc.tuple(...pathParams.map(segment)).map((values) => {
      let path = op.path;
      pathParams.forEach((p, i) => (path = path.replace(`{${String(p.name)}}`, values[i]!)));
      return path;
    });
    const queryParams = params.filter((p) => p.in === 'query');
    const queryArb = queryParams.length
      ? fc.oneof(
          fc.constant(''),
          ...queryParams.map((p) => arbitraryFor(p.schema as JsonSchema, document).map((v) => `?${String(p.name)}=${encodeURIComponent(String(v))}`)),
          fc.constantFrom('?waitMs=0x10', '?waitMs=', '?waitMs=1e3', '?waitMs=-1', '?waitMs=1&waitMs=2', '?other=1', '?waitMs=99999999999', '?waitMs=%ZZ'),
        )
      : fc.constantFrom('', '?x=1');
    const requestBody = op.spec.requestBody as JsonSchema | undefined;
    const bodySchema = requestBody && ((requestBody.content as Record<string, JsonSchema>)['application/json']!.schema as JsonSchema);
    const json = (v: unknown) => Buffer.from(JSON.stringify(v));
    const bodyArb: fc.Arbitrary<Buffer | undefined> = bodySchema
      ? fc.oneof(
          { weight: 6, arbitrary: arbitraryFor(bodySchema, document).map(json) },
          { weight: 1, arbitrary: fc.jsonValue({ maxDepth: 3 }).map(json) },
          { weight: 1, arbitrary: fc.string({ maxLength: 50 }).map((s) => Buffer.from(s)) },
          {
            weight: 3,
            arbitrary: fc.constantFrom(
              json({ op: 'resume', params: { providerLeaseId: 'l', leaseMetadata: { big: 'x'.repeat(17_000) } } }),
              json({ op: 'resume', params: { providerLeaseId: 'l', leaseMetadata: { d: deep(40) } } }),
              json({ op: 'stop', params: { providerLeaseId: 'y'.repeat(70_000) } }),
              json({ op: 'stop' }),
              json({ op: 'stop', params: { providerLeaseId: 'l' }, extra: 1 }),
              Buffer.from('{"op":'),
              Buffer.from(`${'{"n":'.repeat(5_000)}1${'}'.repeat(5_000)}`),
            ),
          },
        )
      : fc.oneof({ weight: 4, arbitrary: fc.constant(undefined) }, { weight: 1, arbitrary: fc.constantFrom(Buffer.from('{"a":1}'), Buffer.from('{'), Buffer.alloc(70_000, 'a')) });
    return fc.record({
      op: fc.constant(op),
      path: pathArb,
      query: queryArb,
      auth: fc.constantFrom('admin', 'admin', 'admin', 'acme', 'acme', 'acmeProd', 'acmeProd', 'none', 'junk', 'basic-admin') as fc.Arbitrary<Generated['auth']>,
      // A small pool of keys, so the same key comes back with another request (422).
      idempotencyKey: fc.option(fc.oneof(fc.constantFrom('k1', 'k2', 'k3'), fc.string({ maxLength: 300 })), { nil: undefined }),
      contentType: fc.oneof(
        { weight: 6, arbitrary: fc.constant('application/json') },
        { weight: 1, arbitrary: fc.constantFrom('text/plain', 'application/json; charset=utf-16', 'application/json; charset=koi8-zz', 'application/x-www-form-urlencoded', undefined) },
      ),
      body: bodyArb,
      knownJob: op.path.includes('{jobId}') ? fc.option(fc.nat(), { nil: null, freq: 2 }) : fc.constant(null),
      sameSandbox: fc.boolean(),
      encoding: fc.oneof({ weight: 12, arbitrary: fc.constant(undefined) }, { weight: 1, arbitrary: fc.constantFrom('gzip', 'br', 'deflate', 'identity', 'x-junk') }),
    });
  }
}

/** The body with params.providerLeaseId set to the lease in the path, when both read as such. */
function withSandbox(body: Buffer, leaseSegment: string): Buffer {
  try {
    const parsed = JSON.parse(body.toString('utf8')) as { params?: { providerLeaseId?: unknown } };
    if (typeof parsed?.params?.providerLeaseId !== 'string') return body;
    parsed.params.providerLeaseId = decodeURIComponent(leaseSegment);
    return Buffer.from(JSON.stringify(parsed));
  } catch {
    return body;
  }
}

describe('an OpenAPI-driven fuzzer (issue 12, scenario 14)', () => {
  let bed: TestBed;
  let api: TestApi;
  const hold = gate<void>();

  beforeAll(async () => {
    bed = await TestBed.create({
      LEASE_OPS_API_TOKENS: JSON.stringify([{ token: TOKENS.admin }, { token: TOKENS.acme, companyId: 'acme' }, { token: TOKENS.acmeProd, companyId: 'acme', environmentIds: ['prod'] }]),
      LEASE_OPS_API_MAX_WAIT_MS: '20',
      // Small limits, so 429 comes up too.
      LEASE_OPS_MAX_QUEUED_PER_LEASE: '3',
      LEASE_OPS_MAX_QUEUED_PER_COMPANY: '20',
    });
    // With a master key, so provider instances can be saved (and their routes answer more than 503).
    api = await startTestApi(bed, undefined, { masterKeys: new MasterKeys(randomBytes(32)) });
    // A worker runs the accepted operations, so leases have lanes, results and observed
    // states to show; it serves "recording": other provider names are 422 unknown_provider.
    // Operations on lease l2 hold their lane till the end, so its lane fills (429 comes up).
    await bed.startWorker(createRecordingProvider({
        behaviour: async ({ ctx }) => {
          if (ctx.lease.leaseId === 'l2') await hold.promise;
          return 'ok' as const;
        },
      }).provider);
  });

  afterAll(async () => {
    hold.open();
    await api?.close();
    await bed?.close();
  });

  it(`${REQUESTS} generated requests: no server error, no undocumented status, no response off its schema`, { timeout: 240_000 }, async () => {
    const document = (await (await fetch(`${api.base}/v1/openapi.json`)).json()) as JsonSchema;
    const ajv = new Ajv2020({ strict: false, validateFormats: false, validateSchema: false, allErrors: true });
    ajv.addSchema(document, 'doc');
    const pointer = (...parts: string[]) => `doc#/${parts.map((p) => p.replaceAll('~', '~0').replaceAll('/', '~1')).join('/')}`;

    const accepted: string[] = [];
    const statuses = new Map<string, number>();
    const problems: string[] = [];
    const t0 = Date.now();
    // Lease l2 of acme/prod starts full (its head holds, two queue behind it): a generated
    // operation on it answers 429 however the generated cancels and pauses left other lanes.
    for (let i = 0; i < 3; i++) {
      const reply = await send(api.base, 'POST', '/v1/leases/recording/acme/prod/l2/operations', { authorization: `Bearer ${TOKENS.admin}`, 'content-type': 'application/json' }, Buffer.from(JSON.stringify({ op: 'stop', params: { providerLeaseId: 'l2' } })));
      expect(reply.status, reply.body).toBe(202);
    }
    const samples = fc.sample(requestsFor(document), { seed: SEED, numRuns: REQUESTS });
    if (process.env.LEASE_OPS_FUZZ_REPORT) console.log('generated in', Date.now() - t0);
    for (const generated of samples) {
      const { op } = generated;
      let path = generated.path;
      // A known job in place of the generated id (reads, cancels, reruns of real operations).
      if (generated.knownJob !== null && accepted.length > 0) {
        path = `/v1/operations/${encodeURIComponent(accepted[generated.knownJob % accepted.length]!)}${/\/(cancel|rerun)$/.exec(op.path)?.[0] ?? ''}`;
      }
      let sent = generated.body;
      const leaseSegment = /\/v1\/leases\/[^/]+\/[^/]+\/[^/]+\/([^/]+)\/operations$/.exec(path)?.[1];
      if (generated.sameSandbox && sent && leaseSegment) sent = withSandbox(sent, leaseSegment);
      const headers: Record<string, string> = {};
      if (generated.auth in TOKENS) headers.authorization = `Bearer ${TOKENS[generated.auth as keyof typeof TOKENS]}`;
      if (generated.auth === 'junk') headers.authorization = `Bearer ${TOKENS.admin} junk`;
      if (generated.auth === 'basic-admin') headers.authorization = `Basic ${Buffer.from(`admin:${TOKENS.admin}`).toString('base64')}`;
      if (generated.idempotencyKey !== undefined && /^[\x20-\x7e]*$/.test(generated.idempotencyKey)) headers['idempotency-key'] = generated.idempotencyKey;
      if (sent && generated.contentType) headers['content-type'] = generated.contentType;
      if (sent && generated.encoding) headers['content-encoding'] = generated.encoding;
      const reply = await send(api.base, op.method, `${path}${generated.query}`, headers, sent);
      const where = `${op.method} ${path}${generated.query} (${generated.auth}) -> ${reply.status} ${reply.body.slice(0, 200)}`;
      const key = `${op.method} ${op.path} ${reply.status}`;
      if (process.env.LEASE_OPS_FUZZ_REPORT && reply.status === 400 && op.method === 'POST') console.log(where.slice(0, 400));
      statuses.set(key, (statuses.get(key) ?? 0) + 1);
      if (reply.status >= 500) problems.push(`server error: ${where}`);
      const documented = (op.spec.responses as Record<string, JsonSchema>)[String(reply.status)];
      if (!documented) {
        problems.push(`undocumented status: ${where}`);
        continue;
      }
      const content = (documented.content as Record<string, JsonSchema> | undefined)?.['application/json'];
      if (!content) continue;
      if (!String(reply.headers['content-type']).startsWith('application/json')) {
        problems.push(`not JSON: ${where}`);
        continue;
      }
      const validate = ajv.getSchema(pointer('paths', op.path, op.method.toLowerCase(), 'responses', String(reply.status), 'content', 'application/json', 'schema'))!;
      const body = JSON.parse(reply.body) as unknown;
      if (!validate(body)) problems.push(`schema mismatch: ${where}: ${ajv.errorsText(validate.errors)}`);
      if (reply.status === 202) {
        if (!reply.headers.location) problems.push(`202 without Location: ${where}`);
        accepted.push((body as { jobId: string }).jobId);
      }
    }
    if (process.env.LEASE_OPS_FUZZ_REPORT) console.log([...statuses].sort().map(([k, n]) => `${k}: ${n}`).join('\n'));
    expect(problems.slice(0, 10)).toEqual([]);
    // The run reached what it is for: every documented status of the API that a request can
    // provoke came up (503 needs Redis down: test/redis-restart.test.ts).
    const seen = (status: number) => [...statuses.keys()].some((k) => k.endsWith(` ${status}`));
    for (const status of [200, 202, 400, 401, 403, 404, 409, 413, 415, 422, 429]) expect(seen(status), `status ${status} never came up`).toBe(true);
    expect(accepted.length).toBeGreaterThan(50);
    // Every route was called.
    const routes = new Set([...statuses.keys()].map((k) => k.split(' ').slice(0, 2).join(' ')));
    expect(routes.size).toBe(Object.values(document.paths as object).reduce((n: number, methods) => n + Object.keys(methods as object).length, 0));
  });
});
