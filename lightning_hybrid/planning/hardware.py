"""The hardware a layout is planned for: device memory, devices per node, nodes, bandwidths and peak compute."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["GB", "PRESETS", "Hardware"]

GB = 1e9
"""Figures are in decimal gigabytes (1e9 bytes), as GPU vendors and the papers the seeds cite count them."""


@dataclass(frozen=True)
class Hardware:
    """One cluster: ``nodes`` x ``devices_per_node`` devices of ``device_memory`` bytes each.

    Bandwidths are per device and per direction, in bytes/s: ``intra_node_bandwidth`` for NVLink-class links inside a
    node, ``inter_node_bandwidth`` for the network between nodes. ``peak_flops`` is the dense bf16 peak per device.

    Example:
        >>> Hardware.preset("H100", nodes=4).world_size
        32
    """

    device_memory: float
    devices_per_node: int = 8
    nodes: int = 1
    intra_node_bandwidth: float = 450 * GB
    inter_node_bandwidth: float = 50 * GB
    peak_flops: float = 989e12
    name: str = "custom"
    usable_fraction: float = 0.9
    """Share of the device memory a layout may plan to use (the rest: allocator fragmentation, CUDA context)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory(self) -> float:
        return self.device_memory * self.usable_fraction

    @classmethod
    def preset(cls, name: str, *, nodes: int = 1, devices_per_node: Optional[int] = None) -> Hardware:
        """A common GPU by name: ``H100`` (80 GB), ``H200`` (141 GB), ``A100-40GB``, ``A100`` / ``A100-80GB``."""
        key = name.upper().replace(" ", "").replace("_", "-")
        if key not in PRESETS:
            from lightning_hybrid.config import HybridConfigError

            raise HybridConfigError(f"`gpu={name!r}` is not a known preset: use one of {sorted(PRESETS)}.")
        hw = replace(PRESETS[key], nodes=nodes)
        return replace(hw, devices_per_node=devices_per_node) if devices_per_node else hw


# Dense bf16 peaks from the vendors' data sheets; NVLink per direction (H100/H200 SXM: 900 GB/s both ways, A100:
# 600 GB/s); the network as one 400 Gb/s (H100/H200) or 200 Gb/s (A100) adapter per GPU.
PRESETS: dict[str, Hardware] = {
    "H100": Hardware(80 * GB, name="H100 80GB", peak_flops=989e12, intra_node_bandwidth=450 * GB),
    "H200": Hardware(141 * GB, name="H200 141GB", peak_flops=989e12, intra_node_bandwidth=450 * GB),
    "A100": Hardware(80 * GB, name="A100 80GB", peak_flops=312e12, intra_node_bandwidth=300 * GB,
                     inter_node_bandwidth=25 * GB),
    "A100-80GB": Hardware(80 * GB, name="A100 80GB", peak_flops=312e12, intra_node_bandwidth=300 * GB,
                          inter_node_bandwidth=25 * GB),
    "A100-40GB": Hardware(40 * GB, name="A100 40GB", peak_flops=312e12, intra_node_bandwidth=300 * GB,
                          inter_node_bandwidth=25 * GB),
}  # fmt: skip
