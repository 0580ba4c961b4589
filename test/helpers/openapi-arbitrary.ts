import fc from 'fast-check';

/** A JSON Schema as an OpenAPI 3.1 document holds it (the subset lease-ops' document uses). */
export type JsonSchema = { [keyword: string]: unknown };

/** The schema a local `$ref` (`#/components/schemas/X`) points at in `document`. */
export function resolveRef(document: JsonSchema, ref: string): JsonSchema {
  let at: unknown = document;
  for (const part of ref.replace(/^#\//, '').split('/')) at = (at as Record<string, unknown>)[part.replaceAll('~1', '/').replaceAll('~0', '~')];
  if (at === undefined) throw new Error(`unresolved $ref ${ref}`);
  return at as JsonSchema;
}

/**
 * Values that validate against `schema`, generated from its keywords (types, bounds,
 * patterns, const, enum, null, oneOf/anyOf, objects with required and additional properties,
 * date-time); a keyword it does not know fails loudly rather than generating wrong values.
 */
export function arbitraryFor(schema: JsonSchema, document: JsonSchema): fc.Arbitrary<unknown> {
  if (typeof schema.$ref === 'string') return arbitraryFor(resolveRef(document, schema.$ref), document);
  if (Array.isArray(schema.oneOf)) return fc.oneof(...(schema.oneOf as JsonSchema[]).map((s) => arbitraryFor(s, document)));
  if (Array.isArray(schema.anyOf)) return fc.oneof(...(schema.anyOf as JsonSchema[]).map((s) => arbitraryFor(s, document)));
  if ('const' in schema) return fc.constant(schema.const);
  if (Array.isArray(schema.enum)) return fc.constantFrom(...(schema.enum as unknown[]));
  switch (schema.type) {
    case 'string':
      return stringFor(schema);
    case 'integer': {
      const min = typeof schema.exclusiveMinimum === 'number' ? schema.exclusiveMinimum + 1 : ((schema.minimum as number | undefined) ?? -1_000_000);
      return fc.integer({ min, max: (schema.maximum as number | undefined) ?? 1_000_000_000 });
    }
    case 'number': {
      const excluded = typeof schema.exclusiveMinimum === 'number';
      const min = excluded ? (schema.exclusiveMinimum as number) : ((schema.minimum as number | undefined) ?? -1e9);
      return fc.double({ min, minExcluded: excluded, max: (schema.maximum as number | undefined) ?? 1e9, noNaN: true, noDefaultInfinity: true });
    }
    case 'boolean':
      return fc.boolean();
    case 'null':
      return fc.constant(null);
    case 'array':
      return fc.array(arbitraryFor((schema.items as JsonSchema | undefined) ?? {}, document), { maxLength: 3 });
    case 'object':
      return objectFor(schema, document);
    case undefined:
      return fc.jsonValue({ maxDepth: 2 });
    default:
      throw new Error(`no arbitrary for type ${JSON.stringify(schema.type)}`);
  }
}

function stringFor(schema: JsonSchema): fc.Arbitrary<string> {
  if (schema.format === 'date-time') {
    return fc.date({ min: new Date('2000-01-01T00:00:00Z'), max: new Date('2999-12-31T23:59:59Z'), noInvalidDate: true }).map((d) => d.toISOString());
  }
  if (schema.format !== undefined) throw new Error(`no arbitrary for format ${String(schema.format)}`);
  const patterns = [schema.pattern, ...((schema.allOf as JsonSchema[] | undefined) ?? []).map((s) => s.pattern)]
    .filter((p): p is string => typeof p === 'string')
    .map((p) => new RegExp(p, 'u'));
  const minLength = (schema.minLength as number | undefined) ?? 0;
  const maxLength = (schema.maxLength as number | undefined) ?? 64;
  // The most specific pattern drives generation; every pattern and both lengths filter.
  const driver = patterns.at(-1);
  const base = driver ? fc.stringMatching(driver) : fc.string({ unit: 'grapheme', minLength, maxLength: Math.min(maxLength, 64) });
  return base.filter((s) => s.length >= minLength && s.length <= maxLength && patterns.every((p) => p.test(s)));
}

function objectFor(schema: JsonSchema, document: JsonSchema): fc.Arbitrary<Record<string, unknown>> {
  const properties = (schema.properties as Record<string, JsonSchema> | undefined) ?? {};
  const required = (schema.required as string[] | undefined) ?? [];
  const known = fc.record(
    Object.fromEntries(Object.entries(properties).map(([name, s]) => [name, arbitraryFor(s, document)])),
    { requiredKeys: required.filter((name) => name in properties) },
  );
  if (schema.additionalProperties === false || schema.additionalProperties === undefined) return known;
  const keys = (schema.propertyNames as JsonSchema | undefined) ?? { type: 'string', maxLength: 32 };
  const extra = fc.dictionary(stringFor({ type: 'string', ...keys }), arbitraryFor(schema.additionalProperties as JsonSchema, document), { maxKeys: 3 });
  return fc.tuple(known, extra).map(([k, e]) => ({ ...e, ...k }));
}
