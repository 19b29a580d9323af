"""The operator: the kopf process that turns WeightCache objects into agent groups (`weightcache
operator`), and the admission webhooks it serves.

The CRD (`crd`, its spec schema generated from the typed API `weightcache.api`), the semantic
rules of a spec (`spec`; its defaults live in `weightcache.api.v1alpha1`), node eligibility and
sticky node ranks (`placement`), the owned objects it builds (`resources`: the placement plan
ConfigMap, the rendezvous Service, the agent DaemonSet), the reconciler (`handlers`), status,
events, node readiness labels (`nodes`), agent status over gRPC (`agentstatus`), and the
webhooks (`admission`).

May import: `weightcache.constants`, `weightcache.api` (the typed spec),
`weightcache.contracts` (the plan it writes, the gRPC API it reads agents with, the shared
vocabulary), `weightcache.errors`, kopf, aiohttp. Never the node agent, the native
cache, `bench` or `testing`: the operator meets agents only through the plan and gRPC, and its
image carries no torch.
"""
