"""Admission webhooks: inject opted-in engine pods, validate WeightCaches.

`register(registry, config)` installs everything on a kopf registry (docs/interfaces.md,
"Admission"). The rooms, one concern each:

* `registration` - the kopf handlers, the webhook server set-up, kopf's patch workaround;
* `lookup` - which WeightCache an admission is for (kopf index, bounded re-reads);
* `cacheview` - the parts of a WeightCache that injection reads;
* `cmdline` - an engine container's command line as its shell and vLLM read it;
* `inject` - the isolation table and the injectors: pure (pod, cache) -> JSON patch;
* `notify` - Warning events on the cache for what the engine would silently get wrong;
* `validate` - the WeightCache validating webhook;
* `config`, `certs`, `keeper`, `metrics` - settings, certificates, configurations, metrics.

This package may import `weightcache.constants`, the operator's `spec`, `imageref`, `events`
and `kube`, kopf and aiohttp; nothing here imports the agent, the native cache, `bench` or
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
