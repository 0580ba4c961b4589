import type { AliasResult, Lanes } from './lane.ts';

/**
 * A lease has one lane from acquire to destroy, with two names: the id its acquire was
 * enqueued under, and the id of the sandbox the acquire made. The acquire's lane is the lane;
 * the sandbox's own lane id is a second name of it, kept in Redis (Lanes.alias) and learnt
 * here as this process meets it. A name only ever points at the lane its acquire ran in, so
 * what is learnt stays true; it is looked up again now and then (which renews it in Redis, as
 * does every operation of the lane by its other name: AttemptLife.nameSandbox).
 */
export class LaneNames {
  private readonly known = new Map<string, { laneId: string; until: number }>();

  constructor(
    /** The lanes of the partition a lane id belongs to. */
    private readonly lanesOf: (laneId: string) => Lanes,
  ) {}

  /** The lane `own` is a second name of, as this process knows it; undefined when it does not. */
  cached(own: string): string | undefined {
    const entry = this.known.get(own);
    if (!entry) return undefined;
    if (entry.until < Date.now()) {
      this.known.delete(own);
      return undefined;
    }
    return entry.laneId;
  }

  learn(own: string, laneId: string): void {
    if (own === laneId) return;
    // Bounded: the oldest learnt go first (a Map keeps insertion order).
    if (this.known.size >= MAX_KNOWN) this.known.delete(this.known.keys().next().value!);
    this.known.set(own, { laneId, until: Date.now() + KNOWN_FOR_MS });
  }

  /**
   * Makes a sandbox (whose own lane id is `own`) a second name of `laneId`, its acquire's lane
   * (Lanes.alias, in the partition of `own`).
   */
  async name(own: string, laneId: string): Promise<AliasResult> {
    if (own === laneId) return 'named';
    const result = await this.lanesOf(own).alias(own, laneId);
    if (result === 'new' || result === 'named') this.learn(own, laneId);
    return result;
  }

  /** The lane a lease whose own lane id is `own` runs in: the lane it is a second name of, or its own. */
  async resolve(own: string): Promise<string> {
    const cached = this.cached(own);
    if (cached) return cached;
    const laneId = await this.lanesOf(own).aliasOf(own);
    if (!laneId) return own;
    this.learn(own, laneId);
    return laneId;
  }
}

const MAX_KNOWN = 50_000;
/** Long enough to spare the look-ups, short enough that use renews the name in Redis (its TTL is a week). */
const KNOWN_FOR_MS = 10 * 60_000;

/**
 * An operation named a lease whose lane is another (its id is a second name): it must be
 * enqueued into that lane, in whichever partition that lane is. Nothing of it was kept.
 */
export class LaneRedirect extends Error {
  override name = 'LaneRedirect';
  constructor(readonly laneId: string) {
    super(`the lease's operations run in lane ${laneId}`);
  }
}
