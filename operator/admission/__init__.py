"""Admission webhooks: inject opted-in engine pods, validate WeightCaches.

`register(registry, config)` installs everything on a kopf registry (docs/interfaces.md,
"Admission"). The rooms, one concern each:

* `registration` - the kopf handlers, the webhook server set-up, kopf's patch workaround;
* `lookup` - which WeightCache an admission is for (kopf index, bounded re-reads);
* `cacheview` - the parts of a WeightCache that injection reads;
* `cmdline` - an engine container's command line as its shell and vLLM read it;
* `inject` - the isolation table and the injectors: pure (pod, cache) -> JSON patch;
* `notify` - Warning events on the cache for what the engine would silently get wrong;
* `podsecurity` - warnings where the namespace's Pod Security level refuses the injection;
* `alignment` - GPU ordering (CUDA_VISIBLE_DEVICES) of the engine against the cache;
* `fingerprint`, `loaderconfig`, `shellscript` - vLLM's fingerprint fields, the loader's
  accepted keys, the shell grammar (used by `inject` and `cmdline`);
* `validate` - the WeightCache validating webhook;
* `config`, `certs`, `keeper`, `metrics` - settings, certificates, configurations, metrics.

May import: the operator's modules, `weightcache.constants` and `weightcache.contracts`
(plus kopf, aiohttp, jsonpatch, bashlex); never the agent, the native cache, `bench` or
`testing`. The decisions (`inject`, `cmdline`, `validate`) import neither kopf nor the API.
"""

from __future__ import annotations

from weightcache.operator.admission.config import (
    AdmissionConfig,
    add_arguments,
    mutating_configuration,
    validating_configuration,
)
from weightcache.operator.admission.registration import register

__all__ = [
    "AdmissionConfig",
    "add_arguments",
    "mutating_configuration",
    "register",
    "validating_configuration",
]
