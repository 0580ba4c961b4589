import { metrics, trace, type Attributes } from '@opentelemetry/api';

// OpenTelemetry hooks for the settling path. Through the global API they cost nothing
// until an application registers a tracer or meter provider. Instruments are looked up on
// each use, so a provider registered after start-up is honoured; these paths are rare.
const tracer = () => trace.getTracer('lease-ops');
const meter = () => metrics.getMeter('lease-ops');

/** A settling error became a delayed retry: the operation waits out a transition. */
export function waitTransition(attributes: Attributes): void {
  meter().createCounter('lease_ops.settling_retries', { description: 'settling errors turned into delayed retries' }).add(1, attributes);
  tracer().startSpan('lease.wait_transition', { attributes }).end();
}

export function deadlineFailure(attributes: Attributes): void {
  meter().createCounter('lease_ops.deadline_failures', { description: 'operations failed at their deadline' }).add(1, attributes);
}

/** A force-stop was queued by the watchdog, succeeded, or was refused by the provider. */
export function forceStop(outcome: 'queued' | 'succeeded' | 'refused', attributes: Attributes): void {
  meter().createCounter('lease_ops.force_stops', { description: 'force-stops by outcome' }).add(1, { ...attributes, outcome });
}

/** How long a sandbox had been stuck in `stopping` when the watchdog queued a force-stop. */
export function stuckStopping(seconds: number, attributes: Attributes): void {
  meter().createHistogram('lease_ops.stuck_stopping_seconds', { unit: 's', description: 'time stuck in stopping before a force-stop' }).record(seconds, attributes);
}

/** Runs a force-stop attempt inside a `lease.force_stop` span. */
export async function forceStopSpan<T>(attributes: Attributes, run: () => Promise<T>): Promise<T> {
  return tracer().startActiveSpan('lease.force_stop', { attributes }, async (span) => {
    try {
      return await run();
    } catch (err) {
      span.recordException(err as Error);
      throw err;
    } finally {
      span.end();
    }
  });
}
