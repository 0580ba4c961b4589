import type { ProviderProbe, ProbeTarget } from '../../queues/provider-probes.ts';
import { BUILT_IN_PROVIDER_NAMES } from '../registry.ts';
import type { InstanceCreate, InstancePatch, InstanceView } from './schemas.ts';
import { instanceNotFound, ProviderInstanceError, type ProviderInstanceStore } from './store.ts';

/** Probe answers that mean the service refused the credentials: such a save is refused. */
const REFUSED = new Set(['unauthorized', 'forbidden']);
/** Probe answers that mean the worker could not open the sealed credentials (another master key). */
const UNOPENED = new Set(['provider_credentials_unreadable', 'secrets_key_missing']);

/** A save refused because the service refused the credentials; `probe` says what it answered. */
export class CredentialsRefusedError extends ProviderInstanceError {
  override name = 'CredentialsRefusedError';
  constructor(readonly probe: ProviderProbe) {
    super('credentials_refused', 422, `the service refused these credentials (${probe.code}: ${probe.message}); nothing was saved`);
  }
}

export interface SaveOptions {
  /** Who saves it (shown as updatedBy). */
  by?: string;
  /** Ask the service first (default true): refused credentials are not saved. */
  probe?: boolean;
  /** Save only if the instance is still at this revision (If-Match). */
  expectedRev?: number;
}

/**
 * Provider instances as a caller manages them (the client's `instances`, the API's
 * /v1/providers and the CLI's `providers`): saves are checked per type, their credentials
 * probed by a worker before they are kept, and names of configured providers are refused.
 */
export class ProviderInstances {
  constructor(
    readonly store: ProviderInstanceStore,
    private readonly deps: {
      /** The names of the providers the workers' configuration holds (shared by every company). */
      configuredNames: () => Promise<string[]>;
      /** Whether any worker has said what it serves since Redis last lost its data (it may serve no configured provider). */
      workersAnnounced: () => Promise<boolean>;
      probe: (target: ProbeTarget) => Promise<ProviderProbe>;
      /** Runs a call once Redis answers (the client's fail-fast wrapper); as is if left out. */
      call?: <T>(run: () => Promise<T>) => Promise<T>;
    },
  ) {}

  private call<T>(run: () => Promise<T>): Promise<T> {
    return this.deps.call ? this.deps.call(run) : run();
  }

  /** Creates a company's instance; returns it with the probe's answer (unless asked not to probe). */
  create(body: unknown, opts: SaveOptions = {}): Promise<{ instance: InstanceView; probe?: ProviderProbe }> {
    return this.call(() => this.createNow(body, opts));
  }

  private async createNow(body: unknown, opts: SaveOptions): Promise<{ instance: InstanceView; probe?: ProviderProbe }> {
    const input = this.store.parseCreate(body);
    if (input.companyId === undefined) throw new ProviderInstanceError('invalid_request', 400, 'a provider instance needs a companyId');
    const configured = await this.deps.configuredNames();
    // Nothing to check a name against (no worker said what it serves: none started, or Redis
    // lost its data): an instance named like an admin-only provider of theirs would have its
    // company's leases run by that provider, with the operator's key (helper-58).
    if (configured.length === 0 && !(await this.deps.workersAnnounced())) {
      throw new ProviderInstanceError('providers_unannounced', 503, 'no worker has said which providers it serves yet (none started, or Redis lost its data): an instance name cannot be checked against them; retry once a worker runs');
    }
    if ((BUILT_IN_PROVIDER_NAMES as readonly string[]).includes(input.name) || configured.includes(input.name)) {
      throw nameTaken(input.name);
    }
    if ((await this.store.get(input.companyId, input.name)) !== null) {
      throw new ProviderInstanceError('provider_exists', 409, `company ${input.companyId} has a provider named "${input.name}" already: update it, or choose another name`);
    }
    const probe = opts.probe === false ? undefined : await this.probeDraft(input.companyId, input);
    const instance = await this.store.create(input.companyId, input, opts.by ?? 'client');
    // A worker may have begun to serve the name meanwhile (the probe takes seconds): it read
    // the instances it shadows after it said so, perhaps before this save landed (helper-59).
    // Such a save is taken back, leaving no tombstone (nothing was accepted for it).
    if ((await this.deps.configuredNames()).includes(input.name)) {
      await this.store.remove(input.companyId, input.name, instance.rev, { takeBack: true }).catch(() => undefined);
      throw nameTaken(input.name);
    }
    return { instance, ...(probe ? { probe } : {}) };
  }

  /** Checks a patch against the instance's type (400 with the field path), or 404. */
  parsePatch(companyId: string, name: string, body: unknown): Promise<{ patch: InstancePatch; current: InstanceView }> {
    return this.call(() => this.store.parsePatch(companyId, name, body));
  }

  /** Replaces the fields a patch gives; new credentials are probed first (with the settings they will be used with). */
  update(companyId: string, name: string, body: unknown, opts: SaveOptions = {}): Promise<{ instance: InstanceView; probe?: ProviderProbe }> {
    return this.call(() => this.updateNow(companyId, name, body, opts));
  }

  private async updateNow(companyId: string, name: string, body: unknown, opts: SaveOptions): Promise<{ instance: InstanceView; probe?: ProviderProbe }> {
    const { patch, current } = await this.store.parsePatch(companyId, name, body);
    if (opts.expectedRev !== undefined && current.rev !== opts.expectedRev) {
      throw new ProviderInstanceError('rev_conflict', 412, `the provider "${name}" changed meanwhile (now revision ${current.rev}): read it again`);
    }
    let probe: ProviderProbe | undefined;
    if (patch.credentials && opts.probe !== false) {
      probe = await this.probeDraft(companyId, { name, type: current.type, config: patch.config ?? current.config, credentials: patch.credentials } as InstanceCreate);
    }
    const instance = await this.store.update(companyId, name, patch, opts.by ?? 'client', opts.expectedRev);
    return { instance, ...(probe ? { probe } : {}) };
  }

  remove(companyId: string, name: string, expectedRev?: number): Promise<void> {
    return this.call(() => this.store.remove(companyId, name, expectedRev));
  }

  get(companyId: string, name: string): Promise<InstanceView | null> {
    return this.call(() => this.store.get(companyId, name));
  }

  async require(companyId: string, name: string): Promise<InstanceView> {
    const view = await this.get(companyId, name);
    if (!view) throw instanceNotFound(name);
    return view;
  }

  list(opts: { companyId?: string; after?: string; limit?: number } = {}): Promise<{ instances: InstanceView[]; nextCursor: string | null }> {
    return this.call(() => this.store.list({ ...opts, limit: opts.limit ?? 100 }));
  }

  /** Has a worker probe an instance's saved credentials. */
  probe(companyId: string, name: string, environmentId?: string, rev?: number): Promise<ProviderProbe> {
    return this.deps.probe({ provider: name, companyId, instance: true, ...(environmentId ? { environmentId } : {}), ...(rev === undefined ? {} : { rev }) });
  }

  rewrapAll(): ReturnType<ProviderInstanceStore['rewrapAll']> {
    return this.call(() => this.store.rewrapAll());
  }

  /** Probes credentials before they are saved: a worker reads them from a short-lived draft. */
  private async probeDraft(companyId: string, input: InstanceCreate): Promise<ProviderProbe> {
    const draft = await this.store.saveDraft(companyId, input);
    try {
      const probe = await this.deps.probe({ provider: input.name, draft });
      if (REFUSED.has(probe.code)) throw new CredentialsRefusedError(probe);
      // A worker that cannot open what this process sealed could not run the instance either.
      if (UNOPENED.has(probe.code)) {
        throw new ProviderInstanceError('secrets_key_mismatch', 503, 'a worker could not open the credentials this process sealed: LEASE_OPS_SECRETS_KEY differs between the API (or client) and the workers; nothing was saved');
      }
      return probe;
    } finally {
      await this.store.dropDraft(draft).catch(() => undefined);
    }
  }
}

function nameTaken(name: string): ProviderInstanceError {
  return new ProviderInstanceError('provider_name_taken', 409, `"${name}" names a provider of the workers' configuration: choose another name`);
}
