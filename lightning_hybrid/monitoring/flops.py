"""Model FLOPs per token, device peak FLOP/s and the parameter count of a split model: the parts of MFU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PEAK_FLOPS", "count_parameters", "device_peak_flops", "transformer_flops_per_token"]

# Dense (no sparsity) tensor-core peak FLOP/s per device from the vendors' data sheets: 16-bit (bf16/fp16) and fp32
# (fp32 on Ampere+ counts TF32 tensor cores, which torch uses for matmuls only if allowed; the plain-fp32 figure is
# far lower). Matched as a substring of torch.cuda.get_device_name(), first match wins: longer names first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"16": 989e12, "32": 494e12},
    "H100 PCIe": {"16": 756e12, "32": 378e12},
    "H100": {"16": 989e12, "32": 494e12},
    "GH200": {"16": 989e12, "32": 494e12},
    "B200": {"16": 2250e12, "32": 1100e12},
    "A100": {"16": 312e12, "32": 156e12},
    "A10G": {"16": 70e12, "32": 35e12},
    "A10": {"16": 125e12, "32": 62.5e12},
    "L40S": {"16": 362e12, "32": 183e12},
    "L4": {"16": 121e12, "32": 60e12},
    "V100": {"16": 125e12, "32": 15.7e12},
    "T4": {"16": 65e12, "32": 8.1e12},
    "RTX 4090": {"16": 165e12, "32": 82.6e12},
    "RTX 3090": {"16": 71e12, "32": 35.6e12},
    "MI300X": {"16": 1307e12, "32": 654e12},
    "MI250X": {"16": 383e12, "32": 95.7e12},
}


def device_peak_flops(device: torch.device, precision: str = "bf16-mixed") -> Optional[float]:
    """Peak FLOP/s of one ``device`` for ``precision`` from :data:`PEAK_FLOPS`, or None when it is not known (CPUs,
    unlisted GPUs): pass ``peak_flops=`` to :class:`~lightning_hybrid.monitoring.HybridMonitor` then.

    Example:
        >>> device_peak_flops(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    width = "16" if ("16" in precision) else "32"
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks[width]
    return None


def transformer_flops_per_token(
    num_parameters: int, num_layers: int = 0, hidden_size: int = 0, sequence_length: int = 0
) -> float:
    """Training FLOPs per token of a decoder transformer: ``6 N`` for the weight matmuls (forward 2N, backward 4N)
    plus ``12 L H T`` for attention scores (PaLM, Chowdhery et al. 2022, appendix B). Recomputation is not counted:
    MFU counts the model's FLOPs, not the hardware's.

    Example:
        >>> transformer_flops_per_token(1_000_000, num_layers=2, hidden_size=64, sequence_length=128)
        6196608.0
    """
    return 6.0 * num_parameters + 12.0 * num_layers * hidden_size * sequence_length


def count_parameters(module: nn.Module, device_mesh: Optional[DeviceMesh] = None) -> int:
    """Parameters of the whole (unsplit) model, counted on any rank of a 3D run: a DTensor counts its global size
    (tensor parallel, ZeRO-3 shards), and pipeline stages are summed over the pipeline dimension (a collective over
    it when ``device_mesh`` has one; call it on all ranks)."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()  # a DTensor's numel() is its global size
    if device_mesh is None or "pipeline" not in (device_mesh.mesh_dim_names or ()):
        return total
    pipeline = device_mesh["pipeline"]
    if pipeline.size() == 1:
        return total
    count = torch.tensor([total], dtype=torch.int64, device=_mesh_device(device_mesh))
    dist.all_reduce(count, group=pipeline.get_group())
    return int(count.item())


def _mesh_device(device_mesh: Any) -> torch.device:
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)
