"""The typed WeightCache API: one dataclass per spec object, each default written once.

`v1alpha1` holds the types (and parses a spec once, `WeightCacheSpec.from_spec`); `schema`
generates the CRD's OpenAPI schema from them. Torch-free and free of the operator, the agent
and the native cache, so every component reads the same typed fields.
"""
