"""Issue 28 (item 4): ``lightning-hybrid consolidate`` writes Hugging Face's sharded safetensors layout, streamed
tensor by tensor, or one Lightning ``.ckpt`` file that ``load_from_checkpoint`` reads.

Two checkpoints come from the shared 2-process launch: a Hugging Face Llama under pipeline parallel (each stage writes
its own blocks) and a nanoGPT with non-default hyper-parameters under ZeRO-3 over two data-parallel ranks (each tensor
in two pieces). Consolidation itself runs in this process, without any process group. The memory test writes a
larger checkpoint in one process and consolidates it in fresh subprocesses, reading their peak resident memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT, share

SAVE_AT_END = {"kind": "ModelCheckpoint", "every_n_train_steps": 2, "save_top_k": -1}
LLAMA_PP2 = {"name": "export-llama-pp2", "model": "llama", "model_kwargs": {},
             "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 2}, "steps": 2, "batch_size": 4,
             "data_parallel_size": 1, "callbacks": [SAVE_AT_END]}  # fmt: skip
# hyper-parameters that differ from NanoGPT's defaults, so that restoring them is visible
NANOGPT_HPARAMS = {"n_layer": 3, "n_embd": 48, "bias": False, "learning_rate": 3e-4, "weight_decay": 0.05}
NANOGPT_ZERO3 = {"name": "export-nanogpt-dp2-zero3", "model": "nanogpt", "model_kwargs": NANOGPT_HPARAMS,
                 "strategy": {"zero_stage": 3}, "steps": 2, "batch_size": 8, "data_parallel_size": 2,
                 "callbacks": [SAVE_AT_END]}  # fmt: skip

# tied input and output embeddings under tensor parallel: save_pretrained leaves the head out, and so must the export;
# fine-tuned from a Hugging Face folder whose generation config the export must carry on
GENERATION = {"max_new_tokens": 7, "do_sample": True, "temperature": 0.6}
FROM_FOLDER = {"write": "hf", "seed": 5, "generation": GENERATION}
LLAMA_TIED_TP2 = {"name": "export-llama-tied-tp2", "model": "llama", "model_kwargs": {"tie_word_embeddings": True},
                  "strategy": {"tensor_parallel_size": 2}, "steps": 2, "batch_size": 4, "data_parallel_size": 1,
                  "callbacks": [SAVE_AT_END], "pretrained": FROM_FOLDER}  # fmt: skip

share(2, [LLAMA_PP2, NANOGPT_ZERO3, LLAMA_TIED_TP2])


def _checkpoint(group: Any, name: str) -> Path:
    group.get(name)  # fails with the scenario's traceback if it did not run
    found = next(group.out_dir.glob(f"{name}/*step=2.ckpt"), None)
    assert found is not None, f"{name} saved no checkpoint at step 2:\n{group.log[-4000:]}"
    return found


# ---------------------------------------------------------------- Hugging Face's sharded layout
@pytest.mark.timeout(900)
def test_sharded_hugging_face_export_loads_with_from_pretrained(shared_groups, tmp_path: Path) -> None:
    """A pipeline-parallel Llama checkpoint, consolidated with ``--max-shard-size 10KB`` (several shards; the 16 KB
    embedding and head over the limit get one each): ``from_pretrained`` loads the folder and its logits equal the
    single-device module's with the gathered parameters; the index is well-formed, is what huggingface_hub's
    splitter (which ``save_pretrained`` uses) gives for the same tensors, and equals ``save_pretrained``'s byte for
    byte. A second export into the same folder with the default size writes one ``model.safetensors``, no index, and
    removes the shards of the first."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_clean_exit, console_script
    from tests.harness import build_module, make_dataset

    group = shared_groups(2)
    checkpoint = _checkpoint(group, "export-llama-pp2")
    out = tmp_path / "llama-export"
    proc = console_script("consolidate", str(checkpoint), str(out), "--max-shard-size", "10KB", timeout=300)
    assert_clean_exit(proc)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert proc.stdout.strip() == f"wrote {len(files)} safetensors files and {out / 'model.safetensors.index.json'}"
    assert not (out / "model.safetensors").exists()
    assert len(files) >= 4, files
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]

    # well-formed: every tensor in exactly one file, the one the index names; total_size is the sum of their bytes
    where: dict[str, str] = {}
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                assert key not in where, f"{key} is in {where.get(key)} and {name}"
                where[key] = name
                weights[key] = f.get_tensor(key)
    assert index["weight_map"] == where
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())

    # huggingface_hub's split (which save_pretrained uses) of the same tensors in the model's own order, and the
    # index save_pretrained writes for the single-device model with the gathered parameters, byte for byte
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    order = list(exported.state_dict())
    assert sorted(order) == sorted(weights)
    split = split_torch_state_dict_into_shards({k: weights[k] for k in order}, max_shard_size="10KB")
    assert split.tensor_to_filename == index["weight_map"]
    assert index["metadata"] == {**split.metadata, "total_parameters": exported.num_parameters()}
    module = build_module("llama").eval()
    module.load_state_dict(group.get("export-llama-pp2")["params"], strict=True)
    module.model.save_pretrained(tmp_path / "reference", max_shard_size="10KB")
    text = (out / "model.safetensors.index.json").read_text()
    assert text == (tmp_path / "reference" / "model.safetensors.index.json").read_text()
    inputs = torch.stack([make_dataset()[i][0] for i in range(4)])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=inputs).logits, module(inputs))

    # everything fits the default 5GB: one model.safetensors without index, and the earlier shards are gone
    from lightning_hybrid.checkpoint import consolidate

    consolidate(checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(weights)
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), weights[key]), key


@pytest.mark.timeout(900)
def test_tied_embeddings_export_equals_save_pretrained(shared_groups, tmp_path: Path) -> None:
    """A Llama with tied input and output embeddings, trained at tp=2: the sharded export holds the same files and
    the same index, byte for byte, as ``save_pretrained(max_shard_size="10KB")`` of the single-device model with the
    gathered parameters (no ``lm_head.weight``: a tied copy), and ``from_pretrained`` gives identical logits."""
    from transformers import AutoModelForCausalLM

    from lightning_hybrid.checkpoint import consolidate
    from tests.harness import build_module, make_dataset

    group = shared_groups(2)
    checkpoint = _checkpoint(group, "export-llama-tied-tp2")
    out = consolidate(checkpoint, tmp_path / "export", max_shard_size="10KB")
    module = build_module("llama", tie_word_embeddings=True).eval()
    module.load_state_dict(group.get("export-llama-tied-tp2")["params"], strict=False)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    module.model.save_pretrained(tmp_path / "reference", max_shard_size="10KB")
    ours = (out / "model.safetensors.index.json").read_text()
    theirs = (tmp_path / "reference" / "model.safetensors.index.json").read_text()
    assert "lm_head.weight" not in json.loads(theirs)["weight_map"]
    assert ours == theirs
    listing = sorted(p.name for p in out.glob("model*"))
    assert listing == sorted(p.name for p in (tmp_path / "reference").glob("model*"))
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    inputs = torch.stack([make_dataset()[i][0] for i in range(4)])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=inputs).logits, module(inputs))
    # the generation config of the folder the run started from (pretrained_weights), copied as it was
    from tests.pretrained_source import pretrained_folder

    source = pretrained_folder("export-llama-tied-tp2", group.out_dir) / "generation_config.json"
    assert (out / "generation_config.json").read_text() == source.read_text()
    assert exported.generation_config.max_new_tokens == GENERATION["max_new_tokens"]


# ---------------------------------------------------------------- one Lightning .ckpt file
@pytest.mark.timeout(900)
def test_lightning_checkpoint_file_loads_with_load_from_checkpoint(shared_groups, tmp_path: Path) -> None:
    """A ZeRO-3 (dp=2) nanoGPT checkpoint consolidated into ``full.ckpt``: ``NanoGPT.load_from_checkpoint`` builds
    the module with the saved (non-default) hyper-parameters, and its parameters equal the ones gathered from the
    ranks after the last step; the file has Lightning's keys and none of lightning-hybrid's own."""
    import lightning

    from examples.nanogpt import NanoGPT
    from lightning_hybrid.checkpoint import consolidate

    group = shared_groups(2)
    checkpoint = _checkpoint(group, "export-nanogpt-dp2-zero3")
    target = consolidate(checkpoint, tmp_path / "exports" / "full.ckpt")
    assert target.is_file() and not list(target.parent.glob(".*partial"))

    saved = torch.load(target, weights_only=True)
    assert {"epoch", "global_step", "pytorch-lightning_version", "loops", "hyper_parameters", "state_dict"} <= set(
        saved
    )
    assert saved["global_step"] == 2 and saved["pytorch-lightning_version"] == lightning.__version__
    assert "optimizer_states" not in saved and not [k for k in saved if k.startswith("hybrid_")]

    module = NanoGPT.load_from_checkpoint(target)
    for name, value in NANOGPT_HPARAMS.items():
        assert module.hparams[name] == value, f"hyper-parameter {name}: {module.hparams[name]}, saved {value}"
    assert len(module.model.h) == NANOGPT_HPARAMS["n_layer"]
    gathered = group.get("export-nanogpt-dp2-zero3")["params"]
    state = module.state_dict()
    assert gathered.keys() <= state.keys()
    for name, want in gathered.items():
        assert torch.equal(state[name], want), f"{name} differs from the gathered parameter"


@pytest.mark.timeout(900)
def test_a_checkpoint_directory_loads_into_a_plain_module_in_one_process(shared_groups, tmp_path: Path) -> None:
    """The same ZeRO-3 checkpoint directory, with no consolidate step: ``lightning_hybrid.load_from_checkpoint`` and a
    module with ``ShardedCheckpointMixin`` build the module with its saved hyper-parameters and the gathered
    parameters, through Lightning's own ``load_from_checkpoint`` (``strict`` and keyword arguments as Lightning takes
    them); a file goes to Lightning unchanged. Lightning's own on the directory still stops at the directory, which
    is why the two exist (docs/checkpoint.md)."""
    import lightning_hybrid
    from examples.nanogpt import NanoGPT
    from lightning_hybrid.checkpoint import consolidate

    class MixedNanoGPT(lightning_hybrid.ShardedCheckpointMixin, NanoGPT):
        pass

    group = shared_groups(2)
    checkpoint = _checkpoint(group, "export-nanogpt-dp2-zero3")
    gathered = group.get("export-nanogpt-dp2-zero3")["params"]
    full = consolidate(checkpoint, tmp_path / "full.ckpt")
    loaded = [
        lightning_hybrid.load_from_checkpoint(NanoGPT, checkpoint),
        lightning_hybrid.load_from_checkpoint(NanoGPT, str(checkpoint), map_location="cpu", strict=True),
        MixedNanoGPT.load_from_checkpoint(checkpoint),
        MixedNanoGPT.load_from_checkpoint(full),  # a file: Lightning's own path
        lightning_hybrid.load_from_checkpoint(NanoGPT, full, learning_rate=0.5),  # an override, as Lightning's
    ]
    for module in loaded:
        for name, value in NANOGPT_HPARAMS.items():
            want = 0.5 if module is loaded[-1] and name == "learning_rate" else value
            assert module.hparams[name] == want, (name, module.hparams[name])
        state = module.state_dict()
        for name, want in gathered.items():
            assert torch.equal(state[name], want), f"{type(module).__name__}: {name} differs"
    assert isinstance(loaded[2], MixedNanoGPT)
    with pytest.raises(IsADirectoryError):
        NanoGPT.load_from_checkpoint(checkpoint)


def test_bad_shard_size_and_output_are_refused(tmp_path: Path) -> None:
    from lightning_hybrid import HybridConfigError
    from lightning_hybrid.checkpoint import consolidate
    from lightning_hybrid.checkpoint.consolidate import parse_shard_size

    assert parse_shard_size("500MB") == 500 * 10**6 and parse_shard_size(" 5gb ") == 5 * 10**9
    assert parse_shard_size(1234) == 1234 and parse_shard_size("1234") == 1234
    assert parse_shard_size("1.5KB") == 1500
    for bad in ("5 GiB", "lots", 0, -3, "0MB", True, 2.5):
        message = f"`max_shard_size` must be a positive size in bytes, got {bad!r}"
        with pytest.raises(HybridConfigError, match=re.escape(message)):
            parse_shard_size(bad)
    (tmp_path / "taken.ckpt").mkdir()
    with pytest.raises(HybridConfigError, match=r"`output` .*taken\.ckpt.* ends in \.ckpt.*is a directory"):
        consolidate(tmp_path / "missing.ckpt", tmp_path / "taken.ckpt")


# ---------------------------------------------------------------- peak memory
MEMORY_TENSORS = 24  # of 4 MiB each, plus one of 8 MiB (the largest): 104 MiB in all, 13 times the largest
MEMORY_ALLOWANCE = 8 * 2**20  # the interpreter, DCP's planning and index, safetensors headers


def _write_memory_checkpoint(path: Path) -> None:
    """A checkpoint written by the strategy's own writer, in one process (a one-rank gloo group)."""
    import torch.distributed as dist

    from lightning_hybrid.checkpoint import ShardedCheckpointWriter

    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(1024, 1024) for i in range(MEMORY_TENSORS)}
    state["embedding.weight"] = torch.randn(2048, 1024)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ShardedCheckpointWriter().save(path, state, [], {"epoch": 0, "global_step": 1}, is_rank_zero=True)
    finally:
        dist.destroy_process_group()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _measure_consolidate(checkpoint: Path, output: Path, record: Path) -> None:
    """Run in a fresh process: the peak resident memory just before and after one consolidation.

    The peak is the kernel's high-water mark, first reset to the resident memory of that moment
    (``/proc/self/clear_refs``): without the reset the peak before is the imports' transient one, and a consolidation
    below it shows no growth at all. Read from ``VmHWM`` rather than ``ru_maxrss``, which also keeps the mark taken
    whenever a thread exits (an import's helper thread, after the import peak) and which the reset cannot clear:
    measured, ``ru_maxrss`` stayed 36 MiB above the resident memory in some runs and hid the whole consolidation."""
    import ctypes
    import gc
    import resource

    from lightning_hybrid.checkpoint import consolidate

    gc.collect()  # the imports' garbage, which the consolidation would otherwise free and reuse unseen
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # and give freed heap back: the baseline is then the live memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (Linux's documented "5") to the current one
    before = _peak_rss()
    # buffer_bytes=1: one tensor per read, so the bound is the largest tensor (the default reads up to 256 MiB at once)
    consolidate(checkpoint, output, max_shard_size="20MB", buffer_bytes=1)
    after = _peak_rss()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; for the record only
    record.write_text(json.dumps({"before": before, "after": after, "ru_maxrss_after": maxrss}))


def _run(*args: str) -> dict[str, Any]:
    import os

    # glibc serves a freed block's size from its heap afterwards (its mmap threshold rises up to 32 MiB) and keeps
    # freed heap pages resident: RSS then lags or leads the live tensors by tens of MiB, run to run. A fixed threshold
    # maps every tensor on its own and unmaps it when freed, so the peak RSS is the peak of live memory.
    # A clean environment: what earlier tests set in this process's (transformers' and Lightning's variables) changed
    # what the child imports, leaving up to 36 MiB of freed but resident memory that the consolidation then reused.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}  # fmt: skip
    proc = subprocess.run([sys.executable, __file__, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=500)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(Path(args[-1]).read_text()) if args[0] == "measure" else {}


@pytest.mark.timeout(900)
def test_consolidation_peak_memory_is_about_the_largest_tensor(tmp_path: Path) -> None:
    """104 MiB of weights (24 tensors of 4 MiB, the largest 8 MiB): consolidating into 20 MB shards raises the
    process's peak resident memory by at most twice the largest tensor (the tensor being filled, and the one DCP's
    reader builds from the file before copying it in) plus 8 MiB, far below the total. The same measure on a ``.ckpt``
    export, which holds every weight at once, grows by at least the total: it sees a whole-model hold."""
    checkpoint = tmp_path / "memory.ckpt"
    _run("write", str(checkpoint))
    total = sum(f.stat().st_size for f in checkpoint.glob("*.distcp"))
    largest = 2048 * 1024 * 4
    assert total >= 12 * largest, total
    streamed = _run("measure", str(checkpoint), str(tmp_path / "export"), str(tmp_path / "streamed.json"))
    growth = streamed["after"] - streamed["before"]
    written = sum(f.stat().st_size for f in (tmp_path / "export").glob("*.safetensors"))
    assert written >= total - 2**20 and len(list((tmp_path / "export").glob("*.safetensors"))) >= 5
    print(f"streamed export of {total / 2**20:.0f} MiB: peak RSS grew by {growth / 2**20:.1f} MiB ({streamed})")
    assert growth <= 2 * largest + MEMORY_ALLOWANCE, (
        f"peak memory grew by {growth / 2**20:.1f} MiB; the largest tensor is {largest / 2**20:.0f} MiB"
        f" (allowed 2x + {MEMORY_ALLOWANCE / 2**20:.0f} MiB), the checkpoint {total / 2**20:.0f} MiB"
    )
    whole = _run("measure", str(checkpoint), str(tmp_path / "whole.ckpt"), str(tmp_path / "whole.json"))
    whole_growth = whole["after"] - whole["before"]
    print(f".ckpt export: peak RSS grew by {whole_growth / 2**20:.1f} MiB ({whole})")
    assert whole_growth >= total * 0.95, f"a whole-model hold should show: grew by {whole_growth / 2**20:.1f} MiB"


if __name__ == "__main__":
    if sys.argv[1] == "write":
        _write_memory_checkpoint(Path(sys.argv[2]))
    else:
        _measure_consolidate(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
