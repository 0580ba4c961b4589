import { InvalidRequestError } from './errors.ts';
import { err, EXIT, out, withClient } from './cli-commands.ts';
import { CredentialsRefusedError } from './providers/instances/manager.ts';
import type { InstanceView } from './providers/instances/schemas.ts';
import { ProviderInstanceError } from './providers/instances/store.ts';
import type { ProviderProbe } from './queues/provider-probes.ts';

/**
 * `lease-ops providers ...` and `lease-ops secrets rewrap`: the provider registry from a
 * shell. An API key is read from a variable the caller names or from standard input, never
 * from the command line (where `ps` and shell history would show it).
 */

export interface ProviderCliOptions {
  company?: string;
  type?: string;
  environments?: string;
  allEnvironments?: boolean;
  config?: string;
  apiKeyEnv?: string;
  apiKeyStdin?: boolean;
  probe?: boolean;
  ifRev?: string;
  cursor?: string;
  limit?: string;
  json?: boolean;
}

class BadInput extends Error {}

async function readApiKey(opts: ProviderCliOptions): Promise<string | undefined> {
  if (opts.apiKeyEnv && opts.apiKeyStdin) throw new BadInput('give the API key one way: --api-key-env or --api-key-stdin');
  if (opts.apiKeyEnv) {
    const value = process.env[opts.apiKeyEnv];
    if (!value) throw new BadInput(`${opts.apiKeyEnv} is not set (--api-key-env names the variable that holds the key)`);
    return value;
  }
  if (opts.apiKeyStdin) {
    const chunks: Buffer[] = [];
    for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
    const value = Buffer.concat(chunks).toString('utf8').trim();
    if (!value) throw new BadInput('standard input held no API key');
    return value;
  }
  return undefined;
}

function parseJson(text: string | undefined, what: string): unknown {
  if (text === undefined) return undefined;
  try {
    return JSON.parse(text) as unknown;
  } catch {
    throw new BadInput(`${what} is not JSON`);
  }
}

function requireCompany(opts: ProviderCliOptions): string {
  if (!opts.company) throw new BadInput('--company <id> is required');
  return opts.company;
}

function parseRev(text: string | undefined): number | undefined {
  if (text === undefined) return undefined;
  if (!/^\d{1,15}$/.test(text)) throw new BadInput('--if-rev takes the revision number a read showed');
  return Number(text);
}

const environmentsOf = (text: string | undefined) => text?.split(',').map((s) => s.trim()).filter(Boolean);

function show(instance: InstanceView, probe?: ProviderProbe): void {
  out(`${instance.companyId}/${instance.name}: ${instance.type}, environments ${instance.environmentIds?.join(', ') ?? 'all'}, key ${instance.credentials.fingerprint}, revision ${instance.rev}, updated ${instance.updatedAt} by ${instance.updatedBy}`);
  if (probe) out(`  probe: ${probe.ok ? 'ok' : `${probe.code}: ${probe.message}`}`);
}

/** Runs one `providers` action; returns the exit code (README, Commands). */
export async function runProviders(action: 'list' | 'show' | 'add' | 'update' | 'remove', name: string | undefined, opts: ProviderCliOptions): Promise<number> {
  try {
    return await withClient(async (client) => {
      const instances = client.instances;
      if (action === 'list') {
        const limit = opts.limit === undefined ? 100 : Number(opts.limit);
        if (!Number.isInteger(limit) || limit < 1 || limit > 500) throw new BadInput('--limit is 1 to 500');
        const page = await instances.list({ ...(opts.company ? { companyId: opts.company } : {}), ...(opts.cursor ? { after: opts.cursor } : {}), limit });
        if (opts.json) out(JSON.stringify(page));
        else {
          for (const instance of page.instances) show(instance);
          if (page.instances.length === 0) out('no provider instances');
          if (page.nextCursor) out(`more: --cursor '${page.nextCursor}'`);
        }
        return EXIT.ok;
      }
      const company = requireCompany(opts);
      if (action === 'show') {
        const instance = await instances.require(company, name!);
        const probe = opts.probe ? await instances.probe(company, name!, instance.environmentIds?.[0], instance.rev) : undefined;
        if (opts.json) out(JSON.stringify({ ...instance, ...(probe ? { probe } : {}) }));
        else show(instance, probe);
        return probe && !probe.ok ? EXIT.operationFailed : EXIT.ok;
      }
      if (action === 'remove') {
        await instances.remove(company, name!, parseRev(opts.ifRev));
        if (!opts.json) out(`removed ${company}/${name}`);
        else out(JSON.stringify({ removed: `${company}/${name}` }));
        return EXIT.ok;
      }
      const apiKey = await readApiKey(opts);
      const config = parseJson(opts.config, '--config');
      const environmentIds = opts.allEnvironments ? null : environmentsOf(opts.environments);
      const saveOpts = { by: `cli:${process.env.USER ?? 'unknown'}`, probe: opts.probe !== false };
      const saved =
        action === 'add'
          ? await (() => {
              if (!apiKey) throw new BadInput('an instance needs its API key: --api-key-env VAR or --api-key-stdin');
              return instances.create({ name, type: opts.type, companyId: company, ...(environmentIds ? { environmentIds } : {}), ...(config === undefined ? {} : { config }), credentials: { apiKey } }, saveOpts);
            })()
          : await instances.update(
              company,
              name!,
              { ...(environmentIds === undefined ? {} : { environmentIds }), ...(config === undefined ? {} : { config }), ...(apiKey ? { credentials: { apiKey } } : {}) },
              { ...saveOpts, ...(opts.ifRev === undefined ? {} : { expectedRev: parseRev(opts.ifRev)! }) },
            );
      if (opts.json) out(JSON.stringify({ ...saved.instance, ...(saved.probe ? { probe: saved.probe } : {}) }));
      else show(saved.instance, saved.probe);
      return EXIT.ok;
    });
  } catch (caught) {
    return reportError(caught);
  }
}

/** `lease-ops secrets rewrap`: every instance's data key wrapped by the current master key. */
export async function runRewrap(opts: { json?: boolean }): Promise<number> {
  try {
    return await withClient(async (client) => {
      // A key that opens none of what it should re-wrap is a wrong key: exit 2, as a worker's.
      await client.checkMasterKeys();
      const report = await client.instances.rewrapAll();
      if (opts.json) out(JSON.stringify(report));
      else {
        out(`rewrapped ${report.rewrapped}, already under the current key ${report.current}, failed ${report.failed.length}`);
        for (const failure of report.failed) out(`  ${failure.companyId}/${failure.name}: ${failure.reason}`);
      }
      return report.failed.length > 0 ? EXIT.operationFailed : EXIT.ok;
    });
  } catch (caught) {
    return reportError(caught);
  }
}

function reportError(caught: unknown): number {
  if (caught instanceof BadInput) {
    err(caught.message);
    return EXIT.badInput;
  }
  if (caught instanceof InvalidRequestError) {
    err(caught.message);
    return EXIT.badInput;
  }
  if (caught instanceof CredentialsRefusedError || caught instanceof ProviderInstanceError) {
    err(`${caught.code}: ${caught.message}`);
    return caught.status === 400 || caught.code === 'secrets_key_missing' ? EXIT.badInput : EXIT.operationFailed;
  }
  throw caught;
}
