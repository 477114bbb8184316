"""Model FLOPs per token, device peak FLOP/s and the parameter count of a split model: the parts of MFU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["count_parameters", "device_peak_flops", "transformer_flops_per_token"]


# A GPU named plainly "NVIDIA H200" matches no key of Lightning 2.6's table (it knows "h200 sxm1"/"nvl1", and lists
# those with sparsity). The H200's compute is the H100 SXM's: the dense figures of Lightning's "h100 sxm" entry.
_H200_DENSE_FLOPS = {torch.float64: 33.5e12, torch.float32: 66.9e12, "tf32": 494.7e12, torch.bfloat16: 989.4e12,
                     torch.float16: 989.4e12, torch.int8: 1978.9e12}  # fmt: skip


def device_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """Peak FLOP/s of one ``device`` for matmuls in ``dtype``, from Lightning's device table
    (:func:`lightning.fabric.utilities.throughput.get_available_flops`; fp32 on Ampere or later counts TF32 when
    ``torch.get_float32_matmul_precision()`` allows it), and for an H200 that table does not match, the H100 SXM's
    dense figures; None for a device neither knows (CPUs, unlisted GPUs): pass ``peak_flops=`` to
    :class:`~lightning_hybrid.monitoring.HybridMonitor` then.

    Example:
        >>> device_peak_flops(torch.device("cpu")) is None
        True
    """
    from lightning.fabric.utilities.throughput import get_available_flops

    flops = get_available_flops(device, dtype)
    if not flops and device.type == "cuda" and "h200" in torch.cuda.get_device_name(device).lower():
        tf32 = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
        flops = _H200_DENSE_FLOPS.get("tf32" if tf32 else dtype)
    return float(flops) if flops else None


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
