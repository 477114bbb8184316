"""Issue 28, item 3: pretrained weights, sharded. ``HybridStrategy(pretrained_weights=...)`` fills the split model
from a Hugging Face folder or ``lightning-hybrid consolidate`` output, each rank reading only its own slices.

Multi-process (in the session's shared 8-process launch): a ``save_pretrained`` folder sharded with an index into
2x2x2 ZeRO-3 (tensor-parallel and FSDP2 shards, pipeline stages), and the consolidated step-6 checkpoint of
tests/test_checkpoint.py's source scenario into 2x2x2 ZeRO-1 (a fused q|k|v projection split by tensor parallel):
losses, first-step gradients and final parameters equal one device that loaded the same weights its own way
(``from_pretrained``; ``load_state_dict`` of the consolidated file), and each rank read its own share of the bytes.
A source that does not fit is refused with the same message on all 8 ranks. Single-process: key mapping, refusals.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_hybrid import HybridConfigError, HybridStrategy
from lightning_hybrid.checkpoint.pretrained import load_pretrained, match_keys, weight_files
from tests.conftest import relative_error, share
from tests.harness import build_module, run_reference
from tests.pretrained_source import pretrained_folder, write_hf

TOL = 1e-5
STEPS = 2


def _case(name: str, model: str, zero: int, pretrained: dict[str, Any], **extra: Any) -> dict[str, Any]:
    strategy = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": zero, "num_microbatches": 2}
    return {"name": name, "model": model, "strategy": strategy, "steps": STEPS, "batch_size": 4,
            "data_parallel_size": 2, "pretrained": pretrained, **extra}  # fmt: skip


HF_CASE = _case("pretrained-hf-2x2x2-zero3", "llama", 3, {"write": "hf", "seed": 7, "max_shard_size": "20KB"})
# the same folder into the network built in configure_model: made on meta, then filled from the files
DEFERRED_CASE = {**HF_CASE, "name": "pretrained-hf-deferred-2x2x2-zero3", "model": "deferred_llama"}
# the head tied to the embedding, on the first and the last pipeline stage: save_pretrained leaves it out of the files
TIED_CASE = _case(
    "pretrained-hf-tied-2x2x2", "llama", 1, {"write": "hf", "seed": 7, "max_shard_size": "20KB"},
    model_kwargs={"tie_word_embeddings": True},
)  # fmt: skip
# the model of tests/test_checkpoint.py's "reshard-source", whose step-6 checkpoint (same group, earlier) is
# consolidated
CONSOLIDATED_CASE = _case(
    "pretrained-consolidated-2x2x2", "nanogpt", 1,
    {"write": "consolidated", "checkpoint": "reshard-source/*step=6.ckpt"},
    model_kwargs={"n_layer": 4, "bias": False},
)  # fmt: skip
# the fused projection split over tensor and, by FSDP2, over data in the same dimension
CONSOLIDATED_ZERO3_CASE = {**CONSOLIDATED_CASE, "name": "pretrained-consolidated-2x2x2-zero3",
                           "strategy": {**CONSOLIDATED_CASE["strategy"], "zero_stage": 3}}  # fmt: skip
REFUSED_CASE = _case(
    "pretrained-refused-2x2x2", "llama", 1, {"write": "hf", "seed": 7, "model_kwargs": {"intermediate_size": 48}},
    expect_error=True,
)  # fmt: skip
# pretrained weights (step 6) and a resume (step 3) together: the resume wins
RESUMED_CASE = {
    **CONSOLIDATED_CASE, "name": "pretrained-then-resume-2x2x2", "steps": 4, "batch_size": 16,
    "resume_from": "reshard-source/*step=3.ckpt", "record_start_params": True,
}  # fmt: skip
# after test_checkpoint.py's scenarios (collected earlier), whose checkpoints two of these read
share(8, [HF_CASE, DEFERRED_CASE, TIED_CASE, CONSOLIDATED_CASE, CONSOLIDATED_ZERO3_CASE, REFUSED_CASE, RESUMED_CASE])


def _compare(result: dict[str, Any], reference: dict[str, Any], tied: dict[str, str] | None = None) -> None:
    """As tests/test_foundation.py's parity check: ``tied`` maps a tied weight's second copy (another pipeline stage's,
    absent on one device) to the weight it must still equal."""
    for extra, partner in (tied or {}).items():
        assert relative_error(result["params"].pop(extra), reference["params"][partner]) <= TOL, f"{extra} untied"
        result["grads"].pop(extra, None)
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got} vs one device {want}"
    for kind in ("grads", "params"):  # first-step gradients, final parameters (gathered over the shards)
        assert result[kind].keys() == reference[kind].keys(), kind
        for name, want in reference[kind].items():
            err = relative_error(result[kind][name], want)
            assert err <= TOL, f"{kind} {name}: relative error {err:.2e}"


def _check_reads(result: dict[str, Any], total_bytes: int) -> list[dict[str, int]]:
    """Each rank read exactly its own share (no slab twice, nothing it does not keep) and no single read larger than
    its share; at 2x2x2 every rank's share is well under the whole model."""
    reads = [rank["pretrained_reads"] for rank in result["per_rank"]]
    for rank, r in enumerate(reads):
        assert 0 < r["bytes"] <= r["share"], (rank, r)
        assert r["bytes"] >= r["share"] - 1024, (rank, r)  # every tensor it keeps was filled from the files
        assert r["bytes"] < 0.6 * total_bytes, (rank, r, total_bytes)
    return reads


@pytest.mark.timeout(2400)  # waits for the session's shared 8-process launch
@pytest.mark.parametrize("case", [HF_CASE, DEFERRED_CASE, TIED_CASE], ids=lambda c: c["name"])
def test_hugging_face_folder_loads_sharded_into_2x2x2(shared_groups, case: dict[str, Any]) -> None:
    """A ``save_pretrained`` folder (7 files and an index) into tp2 x pp2 x dp2 ZeRO-3, and with a tied head (held by
    the first and the last stage, left out of the files) at ZeRO-1: equal to one device that loaded it with
    ``from_pretrained``, and each rank read only its slices."""
    from transformers import LlamaForCausalLM

    group = shared_groups(8)
    result = group.get(case["name"])
    folder = pretrained_folder(case["name"], group.out_dir)
    assert len(set(weight_files(folder).values())) > 2  # sharded, with an index
    module = build_module("llama", **case.get("model_kwargs", {}))
    module.model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa").train()
    total = sum(p.numel() * 4 for p in module.parameters())
    tied = {"model.lm_head.weight": "model.model.embed_tokens.weight"} if case is TIED_CASE else None
    _compare(result, run_reference(case, module=module), tied)
    reads = _check_reads(result, total)
    report = result["per_rank"][0]["pretrained_report"]
    assert (report.module_prefix, report.file_prefix, report.bytes_read) == ("model.", "", reads[0]["bytes"])
    # the log line's file count is what the rank read from, not the folder's: here fewer than all of them
    for rank, r in zip(result["per_rank"], reads):
        assert rank["pretrained_report"].files_read == r["files"] <= rank["pretrained_report"].files, (rank, r)
    assert min(r["files"] for r in reads) < report.files, reads


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", [CONSOLIDATED_CASE, CONSOLIDATED_ZERO3_CASE], ids=lambda c: c["name"])
def test_consolidated_checkpoint_loads_sharded_into_2x2x2(shared_groups, case: dict[str, Any]) -> None:
    """``consolidate`` output of a 2x2x2 checkpoint (the module's own names) into 2x2x2 at ZeRO-1 and ZeRO-3, with
    nanoGPT's fused q|k|v projection split by tensor parallel (and by FSDP2 over data): equal to one device that
    ``load_state_dict``-ed the file."""
    from safetensors.torch import load_file

    group = shared_groups(8)
    result = group.get(case["name"])
    weights = load_file(pretrained_folder(case["name"], group.out_dir) / "model.safetensors")
    module = build_module("nanogpt", **case["model_kwargs"])
    module.load_state_dict(weights, strict=True)
    _compare(result, run_reference(case, module=module))
    _check_reads(result, sum(w.numel() * w.element_size() for w in weights.values()))


@pytest.mark.timeout(2400)
def test_a_source_that_does_not_fit_is_refused_on_every_rank(shared_groups) -> None:
    """A Llama folder with another MLP width: every rank raises the same error (what each pipeline stage found,
    merged), naming the option, the mismatched shapes and the fix."""
    messages = shared_groups(8).expected_errors(REFUSED_CASE["name"])
    assert len(messages) == 8 and len(set(messages)) == 1, messages
    assert messages[0].startswith("HybridConfigError: `pretrained_weights="), messages[0]
    assert "shapes differ" in messages[0] and "mlp.up_proj.weight" in messages[0]
    assert "layers.0." in messages[0] and "layers.1." in messages[0]  # both pipeline stages' findings


@pytest.mark.timeout(2400)
def test_a_resume_overwrites_the_pretrained_weights(shared_groups, tmp_path: Path) -> None:
    """``pretrained_weights`` (the step-6 weights) with ``ckpt_path`` (the step-3 checkpoint): training starts from
    the checkpoint's weights exactly."""
    from safetensors.torch import load_file

    from lightning_hybrid.checkpoint import consolidate

    group = shared_groups(8)
    result = group.get(RESUMED_CASE["name"])
    checkpoint = next(group.out_dir.glob(RESUMED_CASE["resume_from"]))
    at_step3 = load_file(consolidate(checkpoint, tmp_path) / "model.safetensors")
    pretrained = load_file(pretrained_folder(RESUMED_CASE["name"], group.out_dir) / "model.safetensors")
    assert result["start_params"].keys() == at_step3.keys()
    for name, value in result["start_params"].items():
        assert torch.equal(value, at_step3[name]), name
    assert not torch.equal(pretrained["model.lm_head.weight"], at_step3["model.lm_head.weight"])
    assert all(rank["pretrained_report"] is not None for rank in result["per_rank"])  # read, then overwritten


# ---------------------------------------------------------------- single process: mapping and refusals
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pretrained") / "llama"
    write_hf("llama", {}, 7, folder, "20KB")
    return folder


def test_a_wrapped_hugging_face_model_maps_by_its_prefix(hf_folder: Path) -> None:
    """The LightningModule's ``model.`` prefix is swapped away; the result equals ``from_pretrained`` bit for bit;
    one process reads every byte once."""
    from transformers import LlamaForCausalLM

    module = build_module("llama")
    report = load_pretrained(module, hf_folder)
    expected = LlamaForCausalLM.from_pretrained(hf_folder).state_dict()
    for name, value in module.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert (report.module_prefix, report.file_prefix, report.files, report.files_read) == ("model.", "", 7, 7)
    assert report.bytes_read == sum(v.numel() * 4 for v in expected.values())


def test_a_damaged_shard_is_named(hf_folder: Path, tmp_path: Path) -> None:
    """A truncated shard (an interrupted download) or one with a broken header: the error names the file and says to
    fetch it again, instead of safetensors' bare "Error while deserializing header"."""
    import shutil

    folder = tmp_path / "llama"
    shutil.copytree(hf_folder, folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    data = shards[2].read_bytes()
    shards[2].write_bytes(data[: len(data) // 2])
    shards[4].write_bytes(b"\x00" * 16 + data[16:])
    with pytest.raises(HybridConfigError, match=rf"the file {re.escape(str(shards[2]))} \([\d,]+ bytes\) is not a"
                       r" readable safetensors file \(.*incomplete.*\).* Download or copy that file again"):
        load_pretrained(build_module("llama"), folder)
    shards[2].write_bytes(data)
    with pytest.raises(HybridConfigError, match=rf"the file {re.escape(str(shards[4]))} .*damaged or incomplete"):
        load_pretrained(build_module("llama"), folder)


def test_match_keys_swaps_prefixes_and_falls_back_on_tied_weights() -> None:
    keys = {"model.embed_tokens.weight", "model.norm.weight"}  # lm_head left out: tied to the embedding
    names = ["net.model.embed_tokens.weight", "net.model.norm.weight", "net.lm_head.weight"]
    found, missing = match_keys(names, keys)
    assert missing == ["net.lm_head.weight"]
    aliases = {"net.lm_head.weight": "net.model.embed_tokens.weight"}
    found, missing = match_keys(names, keys, aliases=aliases)
    assert missing == [] and found["net.lm_head.weight"] == "model.embed_tokens.weight"
    # a file written by another wrapper: module prefix and file prefix both swapped
    found, _ = match_keys(["model.a.weight", "model.b.weight"], {"backbone.a.weight", "backbone.b.weight"})
    assert found == {"model.a.weight": "backbone.a.weight", "model.b.weight": "backbone.b.weight"}


def test_a_tied_head_left_out_of_the_files_loads_from_the_embedding(tmp_path: Path) -> None:
    """``save_pretrained`` leaves ``lm_head.weight`` out when it is tied: the strategy's aliases (the structure's tied
    parameters) read the embedding in its place, once; without them the head is refused as missing."""
    from lightning_hybrid.checkpoint.pretrained import load_pretrained_weights
    from lightning_hybrid.parallelize import Parallelized
    from lightning_hybrid.structure import find_model_structure

    write_hf("llama", {"tie_word_embeddings": True}, 7, tmp_path, "20KB")
    assert "lm_head.weight" not in weight_files(tmp_path)
    module = build_module("llama", tie_word_embeddings=True)
    with pytest.raises(HybridConfigError, match=r"the model's model\.lm_head\.weight not in the files"):
        load_pretrained(module, tmp_path)
    parallelized = Parallelized(structure=find_model_structure(module), gradient_sync=None)
    report = load_pretrained_weights(module, str(tmp_path), parallelized)
    from safetensors import safe_open

    with safe_open(str(weight_files(tmp_path)["model.embed_tokens.weight"]), framework="pt") as f:
        assert torch.equal(module.model.lm_head.weight, f.get_tensor("model.embed_tokens.weight"))
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    assert report.bytes_read == sum(p.numel() * 4 for p in module.parameters())  # the shared weight read once


def test_bf16_files_load_into_fp32_parameters(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weight = torch.randn(4, 3)
    save_file({"0.weight": weight.bfloat16()}, str(tmp_path / "model.safetensors"))
    net = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False))
    report = load_pretrained(net, tmp_path)
    assert net[0].weight.dtype == torch.float32 and torch.equal(net[0].weight, weight.bfloat16().float())
    assert report.bytes_read == 4 * 3 * 2


def test_another_configuration_is_refused_naming_shapes(hf_folder: Path) -> None:
    module = build_module("llama", intermediate_size=48)
    with pytest.raises(HybridConfigError, match=r"shapes differ: model\.model\.layers\.0\.mlp\.down_proj\.weight"):
        load_pretrained(module, hf_folder)


def test_missing_and_unexpected_keys_are_refused(hf_folder: Path, tmp_path: Path) -> None:
    module = build_module("llama", num_hidden_layers=3)  # the file has 2 layers
    with pytest.raises(HybridConfigError, match=r"the model's model\.model\.layers\.2\..* not in the files"):
        load_pretrained(module, hf_folder)
    module = build_module("llama", num_hidden_layers=1)
    with pytest.raises(HybridConfigError, match=r"the files' model\.layers\.1\..* not in the model"):
        load_pretrained(module, hf_folder)


def test_an_index_naming_absent_shards_is_refused(hf_folder: Path, tmp_path: Path) -> None:
    index = json.loads((hf_folder / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HybridConfigError, match=r"names files that are not there: \['model-00001-of-00007"):
        weight_files(tmp_path)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda root: root / "absent", r"`pretrained_weights='.*absent'` does not exist on this machine"),
        (lambda root: root, r"holds no safetensors weights \(a lightning-hybrid checkpoint resumes with"),
        (lambda root: 3, r"`pretrained_weights` must be a path \(str\), got int 3"),
    ],
)
def test_the_strategy_argument_is_checked_at_construction(tmp_path: Path, make: Any, match: str) -> None:
    with pytest.raises(HybridConfigError, match=match):
        HybridStrategy(pretrained_weights=make(tmp_path))


def test_the_strategy_argument_accepts_a_folder(hf_folder: Path) -> None:
    assert HybridStrategy(pretrained_weights=hf_folder)._options.checkpoint.pretrained_weights == str(hf_folder)
