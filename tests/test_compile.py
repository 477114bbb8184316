"""Issue 18 item 3: ``compile=True`` (torch.compile per transformer block) trains exactly like one device without it.

The scenarios run in the shared 2-process launch. Compile time dominates their cost (a cold inductor compile of a
block's forward and backward takes tens of CPU-seconds), so the model is the smallest nanoGPT (2 blocks, which share
one compiled graph), and the pipeline scenario feeds its blocks micro-batches of the ZeRO-3 scenario's shape with
activation checkpointing as there, so it needs no new graph.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from torch import nn

from lightning_hybrid import HybridConfigError, HybridStrategy
from lightning_hybrid.compile import compile_needs_blocks
from lightning_hybrid.structure import find_model_structure
from tests.conftest import share
from tests.test_any_module import scenario as any_module_scenario
from tests.test_foundation import BATCH, assert_parity, reference_for, scenario

TINY = {"n_layer": 2}
_GRAPHS_BEFORE = [0, 0]  # dynamo graphs and inductor cache hits up to the last compile scenario


def compiled_blocks(trainer: Any, directory: Any) -> dict[str, Any]:
    """After the fit (on every rank, rank 0's answer is kept): the blocks this rank compiled, how many graphs dynamo
    made during this scenario and how many of them inductor read from its on-disk cache (the counters are per
    process; the previous compile scenario's counts are subtracted)."""
    from torch._dynamo.utils import counters

    from lightning_hybrid.pipeline.stage import SkippedBlock

    structure = trainer.strategy.parallelized.structure
    module = trainer.lightning_module
    blocks = {n: module.get_submodule(n) for n in structure.block_names()}
    graphs, hits = counters["stats"]["unique_graphs"], counters["inductor"]["fxgraph_cache_hit"]
    made, cached = graphs - _GRAPHS_BEFORE[0], hits - _GRAPHS_BEFORE[1]
    _GRAPHS_BEFORE[:] = [graphs, hits]
    return {
        "compiled": sorted(n for n, b in blocks.items() if b._compiled_call_impl is not None),
        "held": sorted(n for n, b in blocks.items() if not isinstance(b, SkippedBlock)),
        "graphs": made,
        "fx_graph_cache_hits": cached,  # compiled code read from inductor's on-disk cache (not checked: informative)
    }


def _compiled(name: str, strategy: dict[str, Any], dp: int, **extra: Any) -> dict[str, Any]:
    return scenario(name, "nanogpt", {**strategy, "compile": True}, dp, model_kwargs=TINY,
                    after_fit="tests.test_compile:compiled_blocks", **extra)  # fmt: skip


AC = {"activation_checkpointing": True}
WORLD2 = [
    # ZeRO-3 (FSDP2 wraps the compiled blocks) and activation checkpointing inside the compiled region
    _compiled("compile-dp2-zero3-ac", {"zero_stage": 3, **AC}, 2),
    # each stage compiles the one block it holds, not the other stage's stand-in; batches of 2 x BATCH in 2
    # micro-batches: the blocks see the ZeRO-3 scenario's shapes
    _compiled("compile-pp2-ac", {"pipeline_parallel_size": 2, "num_microbatches": 2, **AC}, 1, batch_size=2 * BATCH),
    # tensor parallel: the compiled graph holds DTensor parameters and the tensor-parallel collectives
    _compiled("compile-tp2", {"tensor_parallel_size": 2}, 1),
]
ERRORS = [any_module_scenario("error-cnn-compile", "cnn", {"compile": True}, expect_error=True)]
share(2, WORLD2 + ERRORS)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", WORLD2, ids=[s["name"] for s in WORLD2])
def test_compiled_blocks_match_one_device_without_compile(shared_groups, case: dict[str, Any]) -> None:
    """Losses, final parameters and first-step gradients within 1e-5 (fp32) of one device running the module
    uncompiled; every block the rank holds, and only those, compiled; two blocks of one class share one graph."""
    result = shared_groups(2).get(case["name"])
    assert_parity(result, reference_for(case))
    report = result["after_fit"]
    assert report["compiled"] == report["held"] and report["held"], report
    if len(report["held"]) == 2 and "pp2" not in case["name"]:
        assert report["graphs"] == 1, f"the two blocks should reuse one compiled graph: {report}"


def test_compile_without_a_block_list_is_refused_on_every_rank(shared_groups) -> None:
    messages = shared_groups(2).expected_errors("error-cnn-compile")
    assert len(messages) == 2, messages
    for message in messages:
        assert message.startswith("HybridConfigError") and re.search(r"`compile=True` \(each transformer", message)


def test_compile_settings_are_checked_in_the_constructor() -> None:
    with pytest.raises(HybridConfigError, match=r"`compile` must be True or False, got 'yes'"):
        HybridStrategy(compile="yes")
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
        with pytest.raises(HybridConfigError, match=rf"`compile=True` cannot run with `pipeline_schedule='{schedule}'"):
            HybridStrategy(compile=True, pipeline_parallel_size=2, pipeline_schedule=schedule, virtual_pipeline_size=2)
    HybridStrategy(
        compile=True, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2
    )


def test_compile_needs_the_block_list() -> None:
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())  # no list of same-type blocks
    with pytest.raises(HybridConfigError, match=r"`compile=True` .* needs them"):
        find_model_structure(cnn, None, compile_needs_blocks(True))
    assert find_model_structure(cnn, None, compile_needs_blocks(False)).blocks_name is None
