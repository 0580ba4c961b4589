import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../src/index.ts';
import { startTestApi, type TestApi } from '../helpers/api-server.ts';
import { lease, TestBed } from '../helpers/env.ts';
import { createRecordingProvider } from '../helpers/recording-provider.ts';

const TOKEN = 'tenants-token-0123456789';

describe('issue 12, scenario 3: the lease in the path and the sandbox in the params cannot disagree', () => {
  let bed: TestBed;
  let api: TestApi;
  beforeAll(async () => {
    bed = await TestBed.create({ LEASE_OPS_API_TOKENS: TOKEN });
    await bed.startWorker(createRecordingProvider().provider);
    api = await startTestApi(bed);
  });
  afterAll(async () => {
    await api.close();
    await bed.close();
  });

  it('the API refuses a stop on lease x1 that names sandbox "other", with 400 and the field, and queues nothing', async () => {
    const before = await bed.ops.queue.getJobCounts();
    const res = await fetch(`${api.base}/v1/leases/recording/co/env/x1/operations`, {
      method: 'POST',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
      body: JSON.stringify({ op: 'stop', params: { providerLeaseId: 'other' } }),
    });
    expect(res.status).toBe(400);
    const body = (await res.json()) as { error: { code: string; details: { path: (string | number)[] }[] } };
    expect(body.error.code).toBe('invalid_request');
    expect(body.error.details.map((d) => d.path.join('.'))).toContain('params.providerLeaseId');
    expect(await bed.ops.queue.getJobCounts()).toEqual(before);
  });

  it('the client refuses it with InvalidRequestError; an acquire names its own lane freely', async () => {
    await expect(api.client.enqueue('release', lease('x1'), { providerLeaseId: 'other', resourceDisposition: 'destroy' })).rejects.toBeInstanceOf(InvalidRequestError);
    const { jobId } = await api.client.enqueue('acquire', lease('caller-chosen'), { runId: 'r' });
    expect((await bed.waitForAll([jobId])).get(jobId)).toBe('completed');
  });
});
