"""Single-process unit tests of everything that can be checked without process groups: configuration errors (each
raised with a message that names the parameter and the fix), rank order, the start-up table, tensor-parallel plans,
and the model-state formula and measurement.

Fast on purpose: no collectives, no launched processes, tiny modules.
"""

from __future__ import annotations

import dataclasses
import datetime
import doctest
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_hybrid import HybridConfigError, HybridStrategy, ParallelLayout
from lightning_hybrid.config import (
    SECTIONS,
    CheckpointOptions,
    PipelineOptions,
    TensorParallelOptions,
    ZeroOptions,
    flat_argument,
)
from lightning_hybrid.layout import LayoutRequest
from lightning_hybrid.options import StrategyOptions, field_docs, flat_options
from lightning_hybrid.sharding import expected_model_state_bytes, measure_model_state_bytes
from lightning_hybrid.structure import find_model_structure
from lightning_hybrid.tensor_parallel import (
    FusedColwiseParallel,
    build_tensor_parallel_plan,
    validate_tensor_parallel_plan,
)
from lightning_hybrid.topology import MESH_DIM_NAMES, format_rank_table

NANOGPT = {"vocab_size": 128, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
LLAMA = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}  # fmt: skip


def nanogpt(**kwargs):
    from examples.nanogpt import NanoGPT

    return NanoGPT(**{**NANOGPT, **kwargs})


@pytest.fixture(scope="module")
def llama_cls():
    pytest.importorskip("transformers")
    from examples.hf_llama import HFLlama

    return HFLlama


def plan_for(module: nn.Module, plan="auto", **kwargs):
    return build_tensor_parallel_plan(module, find_model_structure(module), plan, **kwargs)


# ---------------------------------------------------------------------------------------------------- ParallelLayout
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "tensor_parallel_size": 4},
         r"world size \(6\) is not divisible by tensor_parallel_size x pipeline_parallel_size \(4 x 1 = 4\)"),
        ({"world_size": 8, "tensor_parallel_size": 2, "pipeline_parallel_size": 3},
         r"world size \(8\) is not divisible .* \(2 x 3 = 6\).*launch a multiple of 6 processes"),
        ({"world_size": 8, "tensor_parallel_size": 2, "data_parallel_size": 2},
         r"2 x 1 x 2 = 4, but the world size is 8\. Set `data_parallel_size='auto'` \(= 4\)"),
        ({"world_size": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2},
         r"2 x 2 x 2 = 8, but the world size is 4"),
    ],
)  # fmt: skip
def test_layout_sizes_must_multiply_to_the_world_size(kwargs, match):
    with pytest.raises(HybridConfigError, match=match):
        ParallelLayout.resolve(**kwargs)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", -2),
        ("tensor_parallel_size", 1.5),
        ("tensor_parallel_size", True),
        ("pipeline_parallel_size", 0),
        ("pipeline_parallel_size", "2"),
        ("data_parallel_size", 0),
        ("data_parallel_size", -1),
        ("data_parallel_size", "all"),
        ("world_size", 0),
    ],
)
def test_layout_sizes_must_be_positive_integers(name, value):
    kwargs = {"world_size": 4, name: value}
    match = rf"`{name}` must be a positive integer, got {re.escape(repr(value))}\."
    with pytest.raises(HybridConfigError, match=match):
        ParallelLayout.resolve(**kwargs)


@pytest.mark.parametrize("stage", [True, False, 4, -1, "1", None])
def test_layout_zero_stage_must_be_0_to_3(stage):
    with pytest.raises(HybridConfigError, match=rf"`zero_stage` must be 0, 1, 2 or 3, got {re.escape(repr(stage))}\."):
        ParallelLayout.resolve(world_size=2, zero_stage=stage)


def test_layout_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(HybridConfigError, match=r"`sequence_parallel=True` needs `tensor_parallel_size` > 1"):
        ParallelLayout.resolve(world_size=2, sequence_parallel=True)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "dp", "want_dp"),
    [(8, 2, 2, "auto", 2), (8, 2, 1, "auto", 4), (8, 1, 1, 8, 8), (1, 1, 1, "auto", 1), (12, 2, 3, 2, 2)],
)
def test_layout_fills_in_data_parallel_size(world, tp, pp, dp, want_dp):
    layout = ParallelLayout.resolve(
        world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, zero_stage=2
    )
    assert layout.data_parallel_size == want_dp
    assert layout.tensor_parallel_size * layout.pipeline_parallel_size * layout.data_parallel_size == world
    assert layout.as_dict()["zero_stage"] == 2


def test_layout_pipeline_options_are_recorded_flat():
    layout = ParallelLayout.resolve(
        world_size=4, pipeline_parallel_size=2, pipeline=PipelineOptions(num_microbatches=4)
    )
    assert layout.pipeline.num_microbatches == 4
    assert layout.as_dict()["num_microbatches"] == 4 and "pipeline" not in layout.as_dict()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TensorParallelOptions(plan="manual"), r"`tensor_parallel_plan` must be 'auto' or a dict"),
        (lambda: PipelineOptions(schedule="fast"), r"`pipeline_schedule='fast'` is not one of"),
        (lambda: PipelineOptions(virtual_pipeline_size=2), r"`virtual_pipeline_size=2` needs an interleaved schedule"),
        (lambda: PipelineOptions(verify_pipeline="yes"), r"`verify_pipeline` must be True, False or 'auto'"),
        (lambda: ZeroOptions(bucket_cap_mb=0), r"`bucket_cap_mb` must be a positive number of MiB, got 0\."),
        (lambda: ZeroOptions(zero3_gradient_sync="never"), r"`zero3_gradient_sync` must be 'per_step' or"),
    ],
)  # fmt: skip
def test_option_sections_check_themselves(make, match):
    with pytest.raises(HybridConfigError, match=match):
        make()


def test_option_sections_are_frozen_and_carried_on_the_layout():
    layout = ParallelLayout.resolve(world_size=4, pipeline_parallel_size=2, zero=ZeroOptions(bucket_cap_mb=50))
    assert layout.zero.bucket_cap_mb == 50.0 and layout.pipeline.num_microbatches == 2  # default: the pipeline size
    with pytest.raises(AttributeError):
        layout.zero.bucket_cap_mb = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        PipelineOptions("1f1b")  # type: ignore[misc]  # keyword-only


def test_coordinates_tensor_fastest_pipeline_slowest():
    layout = ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert MESH_DIM_NAMES == ("pipeline", "data", "tensor")
    assert layout.coordinates(5) == (1, 0, 1)
    assert [layout.coordinates(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip


def test_coordinates_match_a_row_major_pipeline_data_tensor_mesh():
    # the same order as init_device_mesh(shape=(pp, dp, tp)), which lays ranks out row-major
    layout = ParallelLayout.resolve(world_size=24, tensor_parallel_size=2, pipeline_parallel_size=3)
    mesh = torch.arange(24).view(3, 4, 2)
    for rank in range(24):
        p, d, t = layout.coordinates(rank)
        assert mesh[p, d, t].item() == rank


def test_rank_table_lists_every_rank_with_its_coordinates():
    layout = ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1)
    devices = [(f"node{r // 4}", "cpu", 1000 + r) for r in range(8)]
    table = format_rank_table(layout, devices)
    lines = table.splitlines()
    assert lines[0].startswith("lightning-hybrid: world=8  tp=2  pp=2  dp=2  zero_stage=1")
    for rank in range(8):
        p, d, t = layout.coordinates(rank)
        pattern = rf"^\s+{rank}\s+{p}\s+{d}\s+{t}\s+node{rank // 4}:cpu$"
        assert sum(bool(re.match(pattern, line)) for line in lines) == 1, f"rank {rank} missing:\n{table}"


def test_rank_table_shows_extras():
    layout = ParallelLayout.resolve(
        world_size=2, pipeline_parallel_size=2, pipeline=PipelineOptions(num_microbatches=4)
    )
    assert "num_microbatches=4" in format_rank_table(layout, [("h", "cpu", 1), ("h", "cpu", 2)])


# ---------------------------------------------------------------------------------------------------- HybridStrategy
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_size": 0}, r"`tensor_parallel_size` must be a positive integer, got 0\."),
        ({"tensor_parallel_size": True}, r"`tensor_parallel_size` must be a positive integer, got True\."),
        ({"pipeline_parallel_size": -1}, r"`pipeline_parallel_size` must be a positive integer, got -1\."),
        ({"data_parallel_size": 0}, r"`data_parallel_size` must be a positive integer, got 0\."),
        ({"zero_stage": True}, r"`zero_stage` must be 0, 1, 2 or 3, got True\."),
        ({"zero_stage": 4}, r"`zero_stage` must be 0, 1, 2 or 3, got 4\."),
        ({"zero_stage": -1}, r"`zero_stage` must be 0, 1, 2 or 3, got -1\."),
        ({"sequence_parallel": True}, r"`sequence_parallel=True` needs `tensor_parallel_size` > 1"),
        ({"tensor_parallel_plan": "manual"}, r"`tensor_parallel_plan` must be 'auto' or a dict"),
    ],
)  # fmt: skip
def test_strategy_constructor_rejects_bad_configuration(kwargs, match):
    with pytest.raises(HybridConfigError, match=match):
        HybridStrategy(**kwargs)


def test_strategy_constructor_accepts_a_good_configuration():
    strategy = HybridStrategy(tensor_parallel_size=2, data_parallel_size=2, zero_stage=3, sequence_parallel=True)
    assert strategy.strategy_name == "hybrid"
    assert strategy.model_state_bytes == {}
    with pytest.raises(RuntimeError, match="before"):
        strategy.layout  # noqa: B018 - the layout needs the world size, known only once processes exist


# ------------------------------------------------------------------------- one definition per option, the tree
# the tree's option fields (sections apart), read here from the dataclasses themselves: (owner, field)
TREE_OPTIONS = [(LayoutRequest, f) for f in dataclasses.fields(LayoutRequest) if f.name not in SECTIONS] + [
    (StrategyOptions, f) for f in dataclasses.fields(StrategyOptions) if f.name not in ("request", *SECTIONS)
]
# one value other than the default for each (a size alone, so that each is valid by itself)
TREE_VALUES = {
    "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3,
    "sequence_parallel": True, "expert_parallel_size": 2, "context_parallel_size": 2,
    "activation_checkpointing": "selective", "activation_checkpointing_every": 2, "transformer_blocks": "model.h",
    "compile": True, "track_gradient_norm": True, "process_group_backend": "gloo", "timeout": 90.0,
    "health_checks": False, "monitor": False, "layout": "auto", "device_memory": 16.0,
}  # fmt: skip
TOGETHER_FLAT = {"sequence_parallel": {"tensor_parallel_size": 2}}  # what a value is only accepted with


def test_the_constructor_signature_is_read_from_the_option_tree():
    """Every parameter of ``HybridStrategy``'s signature (what LightningCLI reads) is a field of the tree, with its
    type and default: the sizes and settings by their names, the sections' fields by the rule, each section by its
    keyword, then Lightning's own arguments; keyword-only, in the tree's order."""
    from lightning.pytorch.strategies.parallel import ParallelStrategy

    parameters = list(inspect.signature(HybridStrategy).parameters.values())
    hints = typing.get_type_hints(HybridStrategy.__init__)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    expected = [o.name for o in flat_options()] + list(SECTIONS)
    lightning = list(inspect.signature(ParallelStrategy.__init__).parameters)[1:]
    assert [p.name for p in parameters] == expected + lightning
    assert set(TREE_VALUES) == {f.name for _, f in TREE_OPTIONS}  # every option of the tree is tried below
    for owner, f in TREE_OPTIONS:
        parameter = inspect.signature(HybridStrategy).parameters[f.name]
        assert parameter.default == f.default, f.name
        assert hints[f.name] == typing.get_type_hints(owner)[f.name], f.name
    assert HybridStrategy()._options == StrategyOptions()  # nothing given: every default is the tree's


@pytest.mark.parametrize("name", sorted(TREE_VALUES))
def test_each_flat_option_arrives_in_the_tree(name):
    value = TREE_VALUES[name]
    options = HybridStrategy(**TOGETHER_FLAT.get(name, {}), **{name: value})._options
    where = options.request if name in {f.name for f in dataclasses.fields(LayoutRequest)} else options
    got = getattr(where, name)
    assert got == (datetime.timedelta(seconds=value) if name == "timeout" else value), (name, got)


def test_an_unknown_argument_is_a_type_error_naming_the_nearest_option():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'pipline_schedule'; did you mean 'pipeline_sc"):
        HybridStrategy(pipline_schedule="gpipe")
    with pytest.raises(TypeError, match=r"takes 1 positional argument"):
        HybridStrategy(2)  # type: ignore[misc]  # keyword-only, as the sections are
    request = HybridStrategy(pipeline_parallel_size=2, pipeline_schedule="gpipe", bucket_cap_mb=50)._options.request
    assert (request.pipeline.schedule, request.zero.bucket_cap_mb) == ("gpipe", 50.0)


def test_the_constructor_docstring_lists_every_option_with_its_definition_help():
    """``HybridStrategy.__init__``'s ``Arguments`` (what ``--help`` shows, parsed as jsonargparse parses it) are the
    fields' own docstrings; a field of the tree without one fails here."""
    import docstring_parser

    documented = {p.arg_name: " ".join(p.description.split()) for p in docstring_parser.parse(
        HybridStrategy.__init__.__doc__).params}  # fmt: skip
    assert list(documented) == [o.name for o in flat_options()] + list(SECTIONS)
    owners = [*[(owner, f) for owner, f in TREE_OPTIONS], *SECTION_FIELDS]
    for owner, f in owners:
        cls = SECTIONS[owner] if isinstance(owner, str) else owner
        name = flat_argument(owner, f.name) if isinstance(owner, str) else f.name
        doc = " ".join(field_docs(cls).get(f.name, "").split())
        assert doc, f"{cls.__name__}.{f.name} has no docstring: its help"
        assert documented[name].startswith(doc), name
    for section, options in SECTIONS.items():
        assert f":class:`~lightning_hybrid.{options.__name__}`" in documented[section]


def _readme_table() -> list[list[str]]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text.split("## Constructor arguments", 1)[1].split("\n| argument |", 1)[1].split("\n\n", 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in table.splitlines()[2:]]


def _shown(default: typing.Any) -> str:
    if isinstance(default, datetime.timedelta):
        return f"{default.total_seconds() / 60:g} minutes"
    return f'`"{default}"`' if isinstance(default, str) else f"`{default!r}`"


def test_the_readme_constructor_table_is_the_option_tree():
    """The README's table: every option, in the tree's order, with its section field and its default."""
    rows = _readme_table()
    assert [row[0] for row in rows] == [f"`{o.name}`" for o in flat_options()]
    for row, option in zip(rows, flat_options()):
        assert row[1] == (f"`{option.section}`" if option.section else "—"), row
        assert row[2] == _shown(option.default), row
        assert row[3], row  # its meaning


# ------------------------------------------------------------------------- typed sections: one option, two forms
# one value other than the default for every field of every section, valid together (SECTIONS lists the sections)
SECTION_VALUES = {
    ("tensor_parallel", "plan"): {"*.mlp.c_fc": "colwise", "*.mlp.c_proj": "rowwise"},
    ("tensor_parallel", "vocab_parallel_loss"): False,
    ("tensor_parallel", "verify_tensor_parallel"): True,
    ("pipeline", "num_microbatches"): 4,
    ("pipeline", "schedule"): "interleaved_1f1b",
    ("pipeline", "virtual_pipeline_size"): 2,
    ("pipeline", "partition"): [1, 1, 2],
    ("pipeline", "network"): "model",
    ("pipeline", "verify_pipeline"): False,
    ("zero", "zero3_gradient_sync"): "per_microbatch",
    ("zero", "overlap_grad_reduce"): False,
    ("zero", "bucket_cap_mb"): 50.0,
    ("zero", "offload_optimizer"): True,
    ("checkpoint", "async_checkpoint"): True,
    ("checkpoint", "verify"): False,
    ("checkpoint", "pretrained_weights"): "WEIGHTS",  # a folder made per test (the value is checked on disk)
}
# a second value other than the default, for the fields that have one (the others cannot disagree both ways)
OTHER_VALUES = {
    ("tensor_parallel", "plan"): {"*.attn.c_attn": "colwise", "*.attn.c_proj": "rowwise"},
    ("tensor_parallel", "verify_tensor_parallel"): False,
    ("pipeline", "num_microbatches"): 8,
    ("pipeline", "schedule"): "zbv_zero_bubble",
    ("pipeline", "virtual_pipeline_size"): 3,
    ("pipeline", "partition"): "parameters",
    ("pipeline", "network"): "model.transformer",
    ("pipeline", "verify_pipeline"): True,
    ("zero", "bucket_cap_mb"): 10.0,
    ("checkpoint", "pretrained_weights"): "OTHER",
}
SECTION_FIELDS = [(section, f) for section, options in SECTIONS.items() for f in dataclasses.fields(options)]
# fields a section only accepts together (a section checks itself when made)
TOGETHER = {("pipeline", "schedule"): ("pipeline", "virtual_pipeline_size"),
            ("pipeline", "virtual_pipeline_size"): ("pipeline", "schedule")}  # fmt: skip


@pytest.fixture
def section_values(tmp_path) -> dict[tuple[str, str], typing.Any]:
    """:data:`SECTION_VALUES` with the weights folders made (``pretrained_weights`` is checked on disk)."""
    pytest.importorskip("safetensors")
    for name in ("WEIGHTS", "OTHER"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").touch()
    weights = ("checkpoint", "pretrained_weights")
    return {**SECTION_VALUES, weights: str(tmp_path / SECTION_VALUES[weights])}


def _flat(values: dict) -> dict[str, typing.Any]:
    return {flat_argument(section, name): value for (section, name), value in values.items()}


def _sections(values: dict) -> dict[str, typing.Any]:
    grouped: dict[str, dict] = {}
    for (section, name), value in values.items():
        grouped.setdefault(section, {})[name] = value
    return {section: SECTIONS[section](**fields) for section, fields in grouped.items()}


def test_every_section_field_has_one_flat_argument_by_the_rule_with_its_type_and_default():
    """Read from the dataclasses, so a field added to a section without its flat argument (or with another name, type
    or default) fails here; the constructor takes each section by its keyword."""
    assert set(SECTION_VALUES) == {(section, f.name) for section, f in SECTION_FIELDS}
    flat_hints = typing.get_type_hints(HybridStrategy.__init__)
    parameters = inspect.signature(HybridStrategy.__init__).parameters
    flat_names = []
    for section, f in SECTION_FIELDS:
        name = flat_argument(section, f.name)
        flat_names.append(name)
        assert name == (f.name if "_" in f.name else f"{section}_{f.name}")
        assert name in parameters, f"{SECTIONS[section].__name__}.{f.name} has no flat argument `{name}`"
        assert parameters[name].default == f.default, name
        assert flat_hints[name] == typing.get_type_hints(SECTIONS[section])[f.name], name
    assert len(set(flat_names)) == len(flat_names)  # one flat name per option
    for section, options in SECTIONS.items():
        assert parameters[section].kind is inspect.Parameter.KEYWORD_ONLY and parameters[section].default is None
        assert flat_hints[section] == typing.Optional[options]


def test_sections_give_the_same_options_as_the_flat_arguments(section_values):
    flat = HybridStrategy(pipeline_parallel_size=2, **_flat(section_values))._options
    assert flat == HybridStrategy(pipeline_parallel_size=2, **_sections(section_values))._options
    for (section, name), value in section_values.items():  # every value arrived where the strategy reads it
        where = flat.checkpoint if section == "checkpoint" else getattr(flat.request, section)
        assert getattr(where, name) == value, (section, name)


@pytest.mark.parametrize(("section", "name"), [(s, f.name) for s, f in SECTION_FIELDS], ids=lambda x: str(x))
def test_each_option_is_reachable_in_its_section_with_the_others_flat(section_values, section, name):
    whole = HybridStrategy(**_flat(section_values))._options
    given = {(section, name), TOGETHER.get((section, name))}
    rest = {key: value for key, value in section_values.items() if key not in given}
    one = {key: value for key, value in section_values.items() if key in given}
    assert HybridStrategy(**_flat(rest), **_sections(one))._options == whole
    # given both ways with the same value, it is the same option: accepted
    assert HybridStrategy(**_flat(section_values), **_sections(one))._options == whole


def test_an_option_given_both_ways_with_different_values_is_refused_naming_both(section_values):
    two_valued = {(s, f.name) for s, f in SECTION_FIELDS
                  if typing.get_type_hints(SECTIONS[s])[f.name] is bool or f.name == "zero3_gradient_sync"}  # fmt: skip
    assert set(OTHER_VALUES) == set(SECTION_VALUES) - two_valued  # the others cannot disagree: one side is the default
    for (section, name), other in OTHER_VALUES.items():
        if name == "pretrained_weights":
            other = section_values[(section, name)].replace("WEIGHTS", other)
        flat_name, value = flat_argument(section, name), section_values[(section, name)]
        companion = {key: section_values[key] for key in [TOGETHER.get((section, name))] if key}
        given = _sections({**companion, (section, name): other})
        with pytest.raises(HybridConfigError) as raised:
            HybridStrategy(**{flat_name: value}, **given)
        message = str(raised.value)
        assert f"`{flat_name}={value!r}`" in message, message
        assert f"`{section}={SECTIONS[section].__name__}({name}={other!r})`" in message, message
        assert "Give it once" in message


def test_a_section_is_checked_as_its_flat_arguments_are():
    with pytest.raises(HybridConfigError, match=r"`pipeline_schedule='interleaved_1f1b'` runs several stages"):
        HybridStrategy(pipeline_schedule="interleaved_1f1b")
    with pytest.raises(HybridConfigError, match=r"`pipeline_schedule='interleaved_1f1b'` runs several stages"):
        PipelineOptions(schedule="interleaved_1f1b")
    # the flat arguments are checked together with the section, once: alone, this one would be refused
    with pytest.raises(HybridConfigError, match=r"`virtual_pipeline_size=2` needs an interleaved schedule"):
        HybridStrategy(virtual_pipeline_size=2)
    interleaved = PipelineOptions(schedule="interleaved_1f1b", virtual_pipeline_size=2)
    assert HybridStrategy(virtual_pipeline_size=2, pipeline=interleaved)._options.request.pipeline == interleaved
    # the checks across sections run on the sections too
    with pytest.raises(HybridConfigError, match=r"`num_microbatches=2` is smaller than `pipeline_parallel_size=4`"):
        HybridStrategy(pipeline_parallel_size=4, pipeline=PipelineOptions(num_microbatches=2))
    with pytest.raises(HybridConfigError, match=r"`compile=True` cannot run with `pipeline_schedule='zbv_zero"):
        HybridStrategy(compile=True, pipeline=PipelineOptions(schedule="zbv_zero_bubble", virtual_pipeline_size=2))
    with pytest.raises(HybridConfigError, match=r"explicit sizes were given \(num_microbatches=4\)"):
        HybridStrategy(layout="auto", pipeline=PipelineOptions(num_microbatches=4))
    with pytest.raises(HybridConfigError, match=r"`zero` must be a lightning_hybrid\.ZeroOptions\(\.\.\.\) or None"):
        HybridStrategy(zero={"bucket_cap_mb": 50})  # type: ignore[arg-type]


def test_the_checkpoint_section_reaches_the_writer():
    strategy = HybridStrategy(checkpoint=CheckpointOptions(async_checkpoint=True, verify=False))
    assert strategy._checkpoint_writer.asynchronous and strategy._checkpoints.options.verify is False


def test_the_constructor_examples_run():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    import lightning_hybrid.strategy as module

    for test in finder.find(HybridStrategy, "HybridStrategy", module=module, globs=vars(module).copy()):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_takes_fields_of_example_runs():
    import lightning_hybrid.config as module

    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(module.takes_fields_of, "takes_fields_of", module=module, globs=vars(module).copy()):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 4)  # failed, attempted


def test_strategy_is_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "hybrid" in StrategyRegistry
    assert StrategyRegistry["hybrid"]["strategy"] is HybridStrategy


def test_config_error_is_a_value_error():
    assert issubclass(HybridConfigError, ValueError)


# ---------------------------------------------------------------------------------------------------- model structure
def test_structure_of_nanogpt():
    s = find_model_structure(nanogpt())
    assert (s.network_name, s.blocks_name, s.num_blocks) == ("model", "model.h", 2)
    assert (s.token_embedding_name, s.output_head_name) == ("model.wte", "model.lm_head")
    assert s.tied_parameters == []
    assert s.block_names() == ["model.h.0", "model.h.1"]


def test_structure_finds_tied_weights():
    s = find_model_structure(nanogpt(tie_weights=True))
    assert s.tied_parameters == [("model.wte.weight", "model.lm_head.weight")]


def test_structure_of_hf_llama(llama_cls):
    s = find_model_structure(llama_cls(**LLAMA))
    assert (s.network_name, s.blocks_name, s.num_blocks) == ("model", "model.model.layers", 2)
    assert (s.token_embedding_name, s.output_head_name) == ("model.model.embed_tokens", "model.lm_head")


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ("model.blocks", r"`transformer_blocks='model.blocks'` names no submodule of NanoGPT\."),
        ("model.wte", r"`transformer_blocks='model.wte'` is a Embedding; it must name an nn.ModuleList"),
    ],
)
def test_structure_rejects_a_bad_transformer_blocks_name(blocks, match):
    with pytest.raises(HybridConfigError, match=match):
        find_model_structure(nanogpt(), blocks)


def test_structure_without_a_block_list_asks_for_transformer_blocks_where_needed():
    assert find_model_structure(nn.Linear(4, 4)).blocks_name is None  # data parallel and ZeRO need none
    with pytest.raises(HybridConfigError, match=r"Could not find the repeated transformer blocks in Linear.*Pass"):
        find_model_structure(nn.Linear(4, 4), needed_by=["`activation_checkpointing=True`"])


# ---------------------------------------------------------------------------------------------------- TP plans
def _exact(style, cls) -> bool:
    return type(style) is cls


def test_auto_plan_for_nanogpt():
    module = nanogpt()
    plan = plan_for(module)
    for i in range(2):
        b = f"model.h.{i}"
        assert _exact(plan.styles[f"{b}.attn.c_attn"], FusedColwiseParallel)
        assert plan.styles[f"{b}.attn.c_attn"].num_blocks == 3
        assert _exact(plan.styles[f"{b}.attn.c_proj"], RowwiseParallel)
        assert _exact(plan.styles[f"{b}.mlp.c_fc"], ColwiseParallel)
        assert _exact(plan.styles[f"{b}.mlp.c_proj"], RowwiseParallel)
    wte = plan.styles["model.wte"]  # vocab-parallel embedding: each rank looks up its vocabulary range
    assert _exact(wte, RowwiseParallel) and wte.input_layouts == (Replicate(),)
    head = plan.styles["model.lm_head"]  # logits stay split over the vocabulary (tensor_parallel/vocab.py)
    assert _exact(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and head.use_local_output is False
    assert plan.vocab_parallel_head == "model.lm_head"
    assert "model.wpe" not in plan.styles
    assert plan.attention_modules == {"model.h.0.attn", "model.h.1.attn"}
    assert plan.sharded_region_modules == {"model.h.0.attn", "model.h.1.attn", "model.h.0.mlp", "model.h.1.mlp"}
    assert "model.h.0.attn.c_attn: FusedColwiseParallel" in plan.describe()


def test_auto_plan_without_vocab_parallel_loss_gathers_the_logits():
    plan = plan_for(nanogpt(), vocab_parallel_loss=False)
    head = plan.styles["model.lm_head"]
    assert _exact(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert plan.vocab_parallel_head is None


def test_auto_plan_for_hf_llama_uses_the_declared_tp_plan(llama_cls):
    module = llama_cls(**LLAMA)
    declared = module.model._tp_plan
    assert declared, "transformers' LlamaForCausalLM declares a tensor-parallel plan"
    plan = plan_for(module)
    expected = {
        "self_attn.q_proj": ColwiseParallel,
        "self_attn.k_proj": ColwiseParallel,
        "self_attn.v_proj": ColwiseParallel,
        "self_attn.o_proj": RowwiseParallel,
        "mlp.gate_proj": ColwiseParallel,
        "mlp.up_proj": ColwiseParallel,
        "mlp.down_proj": RowwiseParallel,
    }
    for i in range(2):
        for leaf, cls in expected.items():
            assert _exact(plan.styles[f"model.model.layers.{i}.{leaf}"], cls), leaf
    assert _exact(plan.styles["model.model.embed_tokens"], RowwiseParallel)
    # declared "colwise_gather_output" for the head is replaced by the vocab-parallel head (logits stay sharded)
    assert declared["lm_head"] == "colwise_gather_output"
    assert plan.styles["model.lm_head"].output_layouts == (Shard(-1),)
    assert plan.vocab_parallel_head == "model.lm_head"
    assert len(plan.styles) == 2 * len(expected) + 2


def test_auto_plan_follows_a_changed_declared_plan(llama_cls):
    module = llama_cls(**LLAMA)
    module.model._tp_plan = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                             "model.layers.*.mlp.down_proj": "rowwise"}  # fmt: skip
    plan = plan_for(module)
    assert not any("self_attn" in name for name in plan.styles)
    assert _exact(plan.styles["model.model.layers.1.mlp.down_proj"], RowwiseParallel)
    # the vocabulary layers are added even when the declared plan leaves them out
    assert {"model.model.embed_tokens", "model.lm_head"} <= plan.styles.keys()


def test_dict_plan_with_string_styles():
    plan = plan_for(nanogpt(), {"model.h.*.attn.c_attn": "fused_colwise_3", "model.h.*.attn.c_proj": "rowwise",
                                "model.h.*.mlp.c_fc": "colwise", "model.h.*.mlp.c_proj": "rowwise"})  # fmt: skip
    assert _exact(plan.styles["model.h.1.attn.c_attn"], FusedColwiseParallel)
    assert plan.styles["model.h.1.attn.c_attn"].num_blocks == 3
    assert _exact(plan.styles["model.h.0.mlp.c_fc"], ColwiseParallel)
    assert {"model.wte", "model.lm_head"} <= plan.styles.keys()


def test_dict_plan_rejects_an_unknown_style_string():
    match = r"gives 'model.h.0.mlp.c_fc' the style 'diagonal', which is not one of"
    with pytest.raises(HybridConfigError, match=match):
        plan_for(nanogpt(), {"model.h.*.mlp.c_fc": "diagonal", "model.h.*.mlp.c_proj": "rowwise"})


def test_dict_plan_rejects_a_pattern_that_matches_nothing():
    with pytest.raises(HybridConfigError, match=r"pattern 'model\.h\.\*\.nope' matches no module of NanoGPT"):
        plan_for(nanogpt(), {"model.h.*.nope": "colwise"})


def test_dict_plan_rejects_a_split_region_without_a_rowwise_layer():
    match = r"splits layers of 'model.h.0.mlp' but has no row-wise \(output\) projection"
    with pytest.raises(HybridConfigError, match=match):
        plan_for(nanogpt(), {"model.h.*.mlp.c_fc": "colwise"})


def test_dict_plan_rejects_a_split_region_without_a_colwise_layer():
    match = r"splits layers of 'model.h.0.mlp' but has no column-wise \(input\) projection"
    with pytest.raises(HybridConfigError, match=match):
        plan_for(nanogpt(), {"model.h.*.mlp.c_proj": "rowwise"})


def test_plan_must_be_auto_or_a_dict():
    with pytest.raises(HybridConfigError, match=r"`tensor_parallel_plan` must be 'auto' or a dict"):
        plan_for(nanogpt(), "megatron")


def test_auto_plan_that_finds_nothing_asks_for_a_plan():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    net = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([Block(), Block()]))
    # neither the names table nor (without an example input) the data flow can tell: the error asks for a plan
    match = r"`tensor_parallel_plan='auto'` could not tell the split layers .* no `example_input_array`.* give a plan"
    with pytest.raises(HybridConfigError, match=match):
        plan_for(net)
    # with an example input, the data flow finds no projection feeding another (a and b are never called)
    net.example_input_array = torch.zeros(2, 4)
    net.forward = lambda x: net[1][0].a(net[0](x))
    with pytest.raises(HybridConfigError, match=r"found no pair of projections to split in '1.0'.*Give a plan"):
        plan_for(net)


# ---------------------------------------------------------------------------------------------------- TP divisibility
def test_validate_accepts_divisible_sizes():
    module = nanogpt()
    validate_tensor_parallel_plan(module, plan_for(module), 4)


def test_validate_rejects_tp_not_dividing_heads():
    module = nanogpt(n_head=3, n_embd=48)
    match = r"`tensor_parallel_size=2` does not divide .*model\.h\.0\.attn\.n_head=3"
    with pytest.raises(HybridConfigError, match=match):
        validate_tensor_parallel_plan(module, plan_for(module), 2)


def test_validate_rejects_tp_not_dividing_the_vocabulary():
    module = nanogpt(vocab_size=129)
    match = r"does not divide model\.wte\.num_embeddings \(vocabulary\)=129.*pad the vocabulary"
    with pytest.raises(HybridConfigError, match=match):
        validate_tensor_parallel_plan(module, plan_for(module), 2)


def test_validate_rejects_tp_not_dividing_the_hidden_size(llama_cls):
    module = llama_cls(**{**LLAMA, "intermediate_size": 66})
    match = r"`tensor_parallel_size=4` does not divide model\.model\.layers\.0\.mlp\.gate_proj\.out_features=66"
    with pytest.raises(HybridConfigError, match=match):
        validate_tensor_parallel_plan(module, plan_for(module), 4)


def test_validate_rejects_tp_not_dividing_fused_blocks():
    module = nanogpt(n_head=3, n_embd=48)  # c_attn: 3 blocks of 48 outputs; 48 % 32 != 0
    with pytest.raises(HybridConfigError, match=r"c_attn\.out_features per fused block=48"):
        validate_tensor_parallel_plan(module, plan_for(module), 32)


# ---------------------------------------------------------------------------------------------------- model state
@pytest.mark.parametrize(
    ("stage", "want"),
    [
        (0, {"parameters": 4000, "gradients": 4000, "optimizer_state": 8000}),
        (1, {"parameters": 4000, "gradients": 4000, "optimizer_state": 3000}),  # (4 master + 8 Adam) / 4
        (2, {"parameters": 4000, "gradients": 1000, "optimizer_state": 3000}),
        (3, {"parameters": 1000, "gradients": 1000, "optimizer_state": 2000}),  # no separate fp32 master copy
    ],
)
def test_expected_model_state_bytes_per_stage(stage, want):
    assert expected_model_state_bytes(1000, zero_stage=stage, data_parallel_size=4) == want


def test_expected_model_state_bytes_with_bf16_parameters():
    got = expected_model_state_bytes(1000, zero_stage=1, data_parallel_size=2, param_bytes=2, grad_bytes=2)
    assert got == {"parameters": 2000, "gradients": 2000, "optimizer_state": 6000}


def test_expected_model_state_bytes_at_dp1_is_the_replicated_model_plus_master():
    assert expected_model_state_bytes(10, zero_stage=3, data_parallel_size=1) == {
        "parameters": 40, "gradients": 40, "optimizer_state": 80}  # fmt: skip


def test_measure_model_state_bytes_after_an_adam_step():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # 40 + 18 = 58 parameters
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    before = measure_model_state_bytes(module, [optimizer])
    assert before == {"parameters": 58 * 4, "gradients": 0, "optimizer_state": 0, "total": 58 * 4}
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    after = measure_model_state_bytes(module, [optimizer])
    # Adam keeps exp_avg and exp_avg_sq per parameter; its 0-dim `step` counters are not counted
    assert after == {"parameters": 232, "gradients": 232, "optimizer_state": 464, "total": 928}
    assert after == {**expected_model_state_bytes(58, zero_stage=0, data_parallel_size=1), "total": 928}


@pytest.mark.parametrize("dp", [2, 3])
def test_zero2_bucket_spans_groups_with_one_reduction_per_owner(dp):
    """A ZeRO-2 bucket may hold parameters of several optimizer groups (decay and no-decay alternate in every block):
    its buffer is ordered by the rank that owns each piece, so it is one contiguous reduction per owner; each element
    of each group's flat buffer lands in exactly one run, at the place the parameter's gradient is added."""
    from lightning_hybrid.sharding.sharded_buckets import _ShardBucket

    torch.manual_seed(0)
    sizes = {"decay": [12, 7, 30], "rest": [5, 9, 4]}
    groups = {k: [nn.Parameter(torch.randn(n)) for n in v] for k, v in sizes.items()}
    flat = {k: torch.zeros(sum(v)) for k, v in sizes.items()}
    shards = [-(-sum(sizes[k]) // dp) for k in ("decay", "rest")]  # ceil: the last rank's slice is padded
    offsets = {
        id(p): (gi, sum(sizes[k][:i])) for gi, k in enumerate(("decay", "rest")) for i, p in enumerate(groups[k])
    }
    # backward order, alternating groups as in a transformer block
    order = [groups["rest"][2], groups["decay"][2], groups["rest"][1], groups["decay"][1], groups["rest"][0],
             groups["decay"][0]]  # fmt: skip
    bucket = _ShardBucket(0, [(p, *offsets[id(p)]) for p in order], shards)

    # one range per owner, in rank order, tiling the buffer
    assert [q for q, _, _ in bucket.owners] == sorted({lo // shards[g] for _, g, lo, _, _ in bucket.runs})
    ends = [0] + [hi for _, _, hi in bucket.owners]
    assert [lo for _, lo, _ in bucket.owners] == ends[:-1] and ends[-1] == bucket.numel == sum(map(sum, sizes.values()))
    buffer = torch.zeros(bucket.numel)
    for i, p in enumerate(bucket.params):  # what the gradient hook does
        for at, offset, n in bucket.slots[i]:
            buffer[at : at + n].add_(p.detach()[offset : offset + n])
    for q, lo, hi in bucket.owners:  # each owner's range holds only its own slices' elements
        assert all(r[0] == q for r in bucket.runs if lo <= r[4] < hi)
    names = ("decay", "rest")
    for q, g, lo, hi, at in bucket.runs:  # what the owner adds into its slices
        assert lo // shards[g] == q and (hi - 1) // shards[g] == q
        flat[names[g]][lo:hi] += buffer[at : at + hi - lo]
    for k in names:
        torch.testing.assert_close(flat[k], torch.cat([p.detach() for p in groups[k]]), rtol=0, atol=0)
    params, views = bucket.views(buffer)  # the tensor-parallel sync's view: each parameter whole, in element order
    for p in bucket.params:
        got = torch.cat([v for q, v in zip(params, views) if q is p])
        torch.testing.assert_close(got, p.detach(), rtol=0, atol=0)


def test_measure_model_state_bytes_counts_tied_parameters_once():
    module = nanogpt(tie_weights=True, n_layer=1)
    numel = sum(p.numel() for p in module.parameters())  # parameters() already removes the duplicate
    assert measure_model_state_bytes(module, [])["parameters"] == 4 * numel


def test_hugging_face_head_counts_on_the_config_are_checked(llama_cls):
    """Hugging Face attention reads its head counts from the model config: a tensor_parallel_size that divides every
    projection (hidden 32, 2 key/value heads of 8 = 16 features) but not num_key_value_heads=2 is refused before the
    split, not left to a reshape error in the first forward pass."""
    module = llama_cls(**{**LLAMA, "num_key_value_heads": 2})
    match = r"tensor_parallel_size=4` does not divide config.num_key_value_heads=2"
    with pytest.raises(HybridConfigError, match=match):
        validate_tensor_parallel_plan(module, plan_for(module), 4)
    validate_tensor_parallel_plan(module, plan_for(module), 2)


def test_token_embedding_is_the_one_the_head_predicts():
    """A position table with more rows than the vocabulary is not taken for the token embedding: the head's
    out_features name the vocabulary."""
    module = nanogpt(block_size=256)  # wpe has 256 rows, the vocabulary 128
    structure = find_model_structure(module)
    assert (structure.token_embedding_name, structure.output_head_name) == ("model.wte", "model.lm_head")


def test_checkpointed_blocks_run_without_the_key_value_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers builds a key/value cache in training too (config.use_cache): a checkpointed block gets none, so
    its recomputation appends no keys a second time; gradients stay those of the plain model, bit for bit."""
    import copy

    from transformers import cache_utils

    from lightning_hybrid.activation_checkpointing import apply_activation_checkpointing
    from lightning_hybrid.structure import find_model_structure
    from tests.harness import build_module

    updates = []
    update = cache_utils.DynamicCache.update
    monkeypatch.setattr(
        cache_utils.DynamicCache, "update", lambda self, *a, **k: updates.append(1) or update(self, *a, **k)
    )
    torch.manual_seed(0)
    plain = build_module("llama")
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, find_model_structure(checkpointed).block_names())
    batch = (torch.randint(0, 16, (2, 16)), torch.randint(0, 16, (2, 16)))
    plain._loss(batch).backward()
    layers = len(updates)
    assert layers == find_model_structure(plain).num_blocks  # the plain model does update it, once per layer
    checkpointed._loss(batch).backward()
    assert len(updates) == layers, "a checkpointed block updated the cache"
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad)
