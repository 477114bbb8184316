"""Expert parallel: each mixture-of-experts layer's experts spread over the expert-parallel ranks (carved out of the
data-parallel ones), tokens sent to their experts' ranks by all-to-all and combined back (docs/expert-parallel.md).

Two pieces: finding the experts modules by structure (``discover``), and sharding their packed weights and
dispatching tokens (``dispatch``). Their gradients are reduced by ZeRO over the ranks holding the same experts
(``sharding.flat.DataDomain``; FSDP2 at ZeRO-3)."""

from lightning_hybrid.expert_parallel.discover import ExpertModule, find_expert_modules
from lightning_hybrid.expert_parallel.dispatch import ExpertLoad, ExpertShards, apply_expert_parallel, shard_experts

__all__ = [
    "ExpertLoad",
    "ExpertModule",
    "ExpertShards",
    "apply_expert_parallel",
    "find_expert_modules",
    "shard_experts",
]
