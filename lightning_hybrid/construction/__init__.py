"""Deferred construction: build on the meta device, split and shard there, then materialize only this rank's shards
with the values one device would have built (docs/big-models.md)."""

from lightning_hybrid.construction.record import ConstructionRecord, record_construction
from lightning_hybrid.construction.replay import ReplayReport, replay

__all__ = ["ConstructionRecord", "ReplayReport", "record_construction", "replay"]
