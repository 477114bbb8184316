"""Expert parallel: each mixture-of-experts layer's experts spread over the expert-parallel ranks (carved out of the
data-parallel ones), tokens sent to their experts' ranks by all-to-all and combined back (docs/expert-parallel.md).

Three pieces: finding the experts modules by structure (``discover``), sharding their packed weights and
dispatching tokens (``dispatch``), and the gradient reduction over the ranks that hold the same experts
(``gradients``)."""

from lightning_hybrid.expert_parallel.discover import ExpertModule, find_expert_modules
from lightning_hybrid.expert_parallel.dispatch import apply_expert_parallel
from lightning_hybrid.expert_parallel.gradients import ExpertGradientSync

__all__ = ["ExpertGradientSync", "ExpertModule", "apply_expert_parallel", "find_expert_modules"]
