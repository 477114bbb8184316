"""Model FLOPs per token (a transformer's formula) or per sample (measured, any other module), device peak FLOP/s
and the parameter count of a split model: the parts of MFU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_hybrid._lightning_compat import module_device_mesh, module_trainer
from lightning_hybrid.pipeline.boundaries import meta_copy, to_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "count_parameters",
    "device_peak_flops",
    "measure_training_flops",
    "transformer_flops_per_token",
    "unsplit_meta_copy",
]


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


_LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers", "n_layers")
_HIDDEN_KEYS = ("n_embd", "hidden_size", "d_model", "dim")


def transformer_sizes(module: nn.Module) -> tuple[int, int]:
    """``(layers, hidden)`` of a transformer, from the module's hyperparameters, else from the configuration of the
    first submodule that has one (a Hugging Face model kept as an attribute: ``self.net.config``); ``(0, 0)`` when
    neither names a layer count: not a transformer the formula can count.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> holder = nn.Module()
        >>> holder.net = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...                                           num_attention_heads=4, vocab_size=64))
        >>> transformer_sizes(holder)
        (2, 32)
    """
    sources = [dict(getattr(module, "hparams", {}) or {})]
    sources += [vars(m.config) for m in module.modules() if hasattr(getattr(m, "config", None), "__dict__")][:1]
    for values in sources:
        layers = next((int(values[k]) for k in _LAYER_KEYS if isinstance(values.get(k), int)), 0)
        if layers:
            return layers, next((int(values[k]) for k in _HIDDEN_KEYS if isinstance(values.get(k), int)), 0)
    return 0, 0


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


def unsplit_meta_copy(module: nn.Module) -> Optional[nn.Module]:
    """A copy of the LightningModule ``module`` as it is before the strategy splits it, every parameter and buffer on
    the meta device (no memory), sharing its trainer and mesh; its ``log``/``log_dict`` do nothing. None where it
    cannot be copied. Take it before ``HybridStrategy.setup`` (a callback's ``setup`` hook): the rank never holds
    the whole model after that, and may never have (deferred construction: the copy's ``configure_model`` builds its
    layers on meta tensors when it is measured). Its torchmetrics objects are stand-ins that do nothing."""
    trainer = module_trainer(module)
    copy = meta_copy(module, keep=(trainer, module_device_mesh(module), getattr(trainer, "datamodule", None)))
    if copy is not None:
        copy.log = copy.log_dict = _ignore  # its step's values are not the fit's
        _stand_in_for_metrics(copy)
    return copy


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


class _MetricStandIn(nn.Module):
    """Takes a torchmetrics object's place in the meta copy: its states are plain tensors on the fit's device, which
    an update with meta tensors refuses, and a metric does no matrix product the count would include."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), device="meta")

    update = _ignore
    reset = _ignore

    def compute(self) -> torch.Tensor:
        return torch.zeros((), device="meta")


def _stand_in_for_metrics(copy: nn.Module) -> None:
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # torchmetrics is optional for users who log plain tensors
        return
    replaced: list[str] = []
    for name, found in list(copy.named_modules()):
        if not name or not isinstance(found, (Metric, MetricCollection)):
            continue
        if any(name.startswith(outer + ".") for outer in replaced):  # inside a collection or wrapper replaced
            continue
        parent_name, _, attribute = name.rpartition(".")
        setattr(copy.get_submodule(parent_name) if parent_name else copy, attribute, _MetricStandIn())
        replaced.append(name)


def measure_training_flops(unsplit: Any, batch: Any) -> Optional[int]:
    """FLOPs of one training step of ``unsplit`` (from :func:`unsplit_meta_copy`) on ``batch``: its
    ``training_step`` on meta tensors of the batch's shapes and the backward of the loss it returns, counted by
    Lightning's :func:`~lightning.fabric.utilities.throughput.measure_flops` (torch's ``FlopCounterMode``: matrix
    multiplications, convolutions, attention). The same count on every rank, whatever the layout, with no
    collective and no memory; the copy's torchmetrics objects do nothing (:func:`unsplit_meta_copy`). None (with a
    warning) where the step cannot run on meta tensors (it reads values: ``.item()``) or returns no loss.

    Example:
        >>> import lightning as L
        >>> class Linear(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = nn.Linear(8, 4, bias=False)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(batch).sum()
        >>> measure_training_flops(unsplit_meta_copy(Linear()), torch.zeros(2, 8))  # 2x8x4x2 forward, as many for dW
        256
    """
    from lightning.fabric.utilities.throughput import measure_flops

    inputs = to_meta(batch)

    def step() -> torch.Tensor:
        if is_overridden("configure_model", unsplit):  # built there: layers the copy does not have yet
            with torch.device("meta"):
                unsplit.configure_model()
        output = unsplit.training_step(inputs, 0)
        return output["loss"] if isinstance(output, dict) else output

    try:
        return int(measure_flops(unsplit, step, loss_fn=lambda loss: loss))
    except Exception as error:  # the user's step on meta tensors: anything may refuse them
        rank_zero_warn(
            f"HybridMonitor: the training step's FLOPs could not be measured on meta tensors ({type(error).__name__}:"
            f" {error}); FLOP/s and MFU fall back to 6 x parameters per sample. Give the module a"
            " `flops_per_token` attribute or method (FLOPs per sample for a batch without token ids), or pass"
            " `HybridMonitor(flops_per_token=...)`."
        )
        return None
