"""The operator: the kopf process that turns WeightCache objects into agent groups (`weightcache
operator`), and the admission webhooks it serves.

The CRD schema (`crd`), defaults and semantic rules of a spec (`spec`), node eligibility and
sticky node ranks (`placement`), the owned objects it builds (`resources`: the placement plan
ConfigMap, the rendezvous Service, the agent DaemonSet), the reconciler (`handlers`), status,
events, node readiness labels (`nodes`), agent status over gRPC (`agentstatus`), and the
webhooks (`admission`).

May import: `weightcache.constants`, `weightcache.contracts` (the plan it writes, the gRPC API
it reads agents with, the shared vocabulary), kopf, aiohttp. Never the node agent, the native
cache, `bench` or `testing`: the operator meets agents only through the plan and gRPC, and its
image carries no torch.
"""
