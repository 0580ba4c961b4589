import { metrics, SpanKind, SpanStatusCode, trace, type Attributes, type Span } from '@opentelemetry/api';
import { forceStopCounted, stuckStoppingObserved } from './metrics.ts';

// OpenTelemetry hooks for the settling path (force-stops are Prometheus metrics too). Through the global API they cost nothing
// until an application registers a tracer or meter provider. Instruments are looked up on
// each use, so a provider registered after start-up is honoured; these paths are rare.
const tracer = () => trace.getTracer('lease-ops');
const meter = () => metrics.getMeter('lease-ops');

/** A settling error became a delayed retry: the operation waits out a transition. */
export function waitTransition(attributes: Attributes): void {
  // The provider's own word for the state is any string it sends: on the span, never a metric attribute.
  const { 'lease.provider_state': _providerState, ...bounded } = attributes;
  meter().createCounter('lease_ops.settling_retries', { description: 'settling errors turned into delayed retries' }).add(1, bounded);
  tracer().startSpan('lease.wait_transition', { attributes }).end();
}

export function deadlineFailure(attributes: Attributes): void {
  meter().createCounter('lease_ops.deadline_failures', { description: 'operations failed at their deadline' }).add(1, attributes);
}

/** A force-stop was queued by the watchdog, succeeded, or was refused by the provider. */
export function forceStop(outcome: 'queued' | 'succeeded' | 'refused', attributes: Attributes): void {
  forceStopCounted(String(attributes['lease.provider'] ?? 'unknown'), outcome);
  meter().createCounter('lease_ops.force_stops', { description: 'force-stops by outcome' }).add(1, { ...attributes, outcome });
}

/** How long a sandbox had been stuck in `stopping` when the watchdog queued a force-stop. */
export function stuckStopping(seconds: number, attributes: Attributes): void {
  stuckStoppingObserved(String(attributes['lease.provider'] ?? 'unknown'), seconds);
  meter().createHistogram('lease_ops.stuck_stopping_seconds', { unit: 's', description: 'time stuck in stopping before a force-stop' }).record(seconds, attributes);
}

/**
 * A failed span: status ERROR with the error's code, also as error.type (not its message:
 * messages carry ids, and span statuses are read in aggregate).
 */
function failed(span: Span, err: unknown): void {
  const code = (err as { code?: unknown }).code;
  const type = typeof code === 'string' ? code : 'error';
  span.setStatus({ code: SpanStatusCode.ERROR, message: type });
  span.setAttribute('error.type', type);
}

/** Runs a force-stop attempt inside a `lease.force_stop` span. */
export async function forceStopSpan<T>(attributes: Attributes, run: () => Promise<T>): Promise<T> {
  return tracer().startActiveSpan('lease.force_stop', { attributes }, async (span) => {
    try {
      return await run();
    } catch (err) {
      span.recordException(err as Error);
      failed(span, err);
      throw err;
    } finally {
      span.end();
    }
  });
}

/**
 * One attempt of an operation, as OpenTelemetry's messaging conventions name a consumer's
 * processing of a message: span `process <queue>`, kind CONSUMER, with messaging.system,
 * messaging.operation.type and .name, messaging.destination.name (the queue) and
 * messaging.message.id (the job), beside lease-ops' own lease.* attributes. A failed attempt
 * (a retry or the end) is an error with its code as error.type.
 */
export async function processSpan<T>(queue: string, jobId: string, attributes: Attributes, run: () => Promise<T>): Promise<T> {
  return tracer().startActiveSpan(
    `process ${queue}`,
    {
      kind: SpanKind.CONSUMER,
      attributes: {
        'messaging.system': 'bullmq',
        'messaging.operation.type': 'process',
        'messaging.operation.name': 'process',
        'messaging.destination.name': queue,
        'messaging.message.id': jobId,
        ...attributes,
      },
    },
    async (span) => {
      try {
        return await run();
      } catch (err) {
        failed(span, err);
        throw err;
      } finally {
        span.end();
      }
    },
  );
}
