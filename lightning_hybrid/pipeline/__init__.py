"""Pipeline parallel: partitioning blocks into stages, cutting the network without rewriting it, and running a
LightningModule's steps through torch's ``pipelining`` schedules."""

from lightning_hybrid.pipeline.microbatch import merge_microbatches, split_batch
from lightning_hybrid.pipeline.partition import StagePlan, partition_blocks
from lightning_hybrid.pipeline.runner import PipelineRunner
from lightning_hybrid.pipeline.stage import NetworkSplit, StageModule, split_network
from lightning_hybrid.pipeline.step_data import StepContext, StepResults
from lightning_hybrid.pipeline_schedules import SCHEDULES

__all__ = [
    "SCHEDULES",
    "NetworkSplit",
    "PipelineRunner",
    "StageModule",
    "StepContext",
    "StepResults",
    "StagePlan",
    "merge_microbatches",
    "partition_blocks",
    "split_batch",
    "split_network",
]
