"""The lightning-hybrid command (LightningCLI): config, overrides, and a real 3D run of the quick-start config."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from tests.cli_runs import cli_scenario
from tests.conftest import console_script, share

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return console_script(*args, timeout=timeout, cwd=cwd)  # the installed command, as a user runs it


@pytest.mark.timeout(120)
def test_print_config_applies_command_line_overrides() -> None:
    proc = _cli("fit", "--config", "cli_configs/cpu_quickstart.yaml", "--trainer.strategy.init_args.zero_stage=3",
                "--trainer.strategy.init_args.pipeline_schedule=gpipe", "--print_config", timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load(proc.stdout)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hybrid.HybridStrategy"
    assert strategy["init_args"]["zero_stage"] == 3 and strategy["init_args"]["pipeline_schedule"] == "gpipe"


# the quick start with a layout override, through the command's LightningCLI in the shared 8-process launch (the
# installed command's own multi-process start is tests/test_monitoring.py's user YAML, at pp=2)
QUICKSTART = cli_scenario(
    "cpu_quickstart.yaml", 8, ["--trainer.max_steps=3", "--trainer.strategy.init_args.zero_stage=2"]
)
share(8, [QUICKSTART])


@pytest.mark.timeout(2400)
def test_quickstart_config_trains_in_3d_on_8_processes(shared_groups) -> None:
    result = shared_groups(8).get(QUICKSTART["name"])
    log, root = result["log"], Path(result["root"])
    assert "tp=2  pp=2  dp=2  zero_stage=2" in log, log[-3000:]
    saved = yaml.safe_load(next(root.rglob("config.yaml")).read_text())
    assert saved["trainer"]["strategy"]["init_args"]["zero_stage"] == 2  # the override reached the run's config
    assert saved["trainer"]["max_steps"] == 3


CONFIGS = sorted(p.name for p in (ROOT / "cli_configs").glob("*.yaml"))
# the configs that run on CPU, each trained for a few steps below (the quick start above, on 8 processes)
CPU_CONFIGS = {"hf_llama.yaml": 4, "fp16_loss_scaling.yaml": 4, "zero3.yaml": 4, "moe_expert_parallel.yaml": 4}
# each as a scenario of the shared launch of its size, named after the config (`--scenarios cli-zero3`)
CLI_RUNS = {cli_scenario(n, d)["name"]: (n, d) for n, d in CPU_CONFIGS.items()}
for _name, _devices in CPU_CONFIGS.items():
    share(_devices, [cli_scenario(_name, _devices)])

_PRINT_ALL = """
import contextlib, io, json, sys
from lightning_hybrid.cli import main
out = {}
for name in sys.argv[1:]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            main(["fit", "--config", "cli_configs/" + name, "--print_config"])
        except SystemExit as e:
            assert not e.code, (name, e.code)
    out[name] = buffer.getvalue()
print(json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_every_shipped_config_parses_and_its_layout_fits_its_devices() -> None:
    from lightning_hybrid import ParallelLayout

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PRINT_ALL, *CONFIGS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=220)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"cpu_quickstart.yaml", "gpu_8_3d.yaml", "multi_node.yaml", "hf_llama.yaml", "fp16_loss_scaling.yaml",
            "zero3.yaml"} <= set(printed)  # fmt: skip
    for name, text in printed.items():
        config = yaml.safe_load(text)
        trainer = config["trainer"]
        strategy = trainer["strategy"]
        assert strategy["class_path"] == "lightning_hybrid.HybridStrategy", name
        sizes = {k: v for k, v in strategy["init_args"].items() if k.endswith("_size") or k in ("zero_stage",)}
        sizes = {k: v for k, v in sizes.items() if k != "virtual_pipeline_size"}
        world = int(trainer["devices"]) * int(trainer.get("num_nodes") or 1)
        ParallelLayout.resolve(world_size=world, **sizes)  # a config whose sizes do not fit its devices fails here
        assert any("HybridMonitor" in c["class_path"] for c in trainer.get("callbacks") or []), name


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", sorted(CLI_RUNS))
def test_cpu_configs_train_a_few_steps_with_their_layout(shared_groups, scenario: str) -> None:
    """Each CPU config, two steps through the command's LightningCLI in the shared launch of its size
    (tests/cli_runs.py): the start-up table, the monitor's console line at each step, the saved config and the
    CSV metrics."""
    name, devices = CLI_RUNS[scenario]
    config = yaml.safe_load((ROOT / "cli_configs" / name).read_text())
    assert config["trainer"]["accelerator"] == "cpu" and config["trainer"]["devices"] == devices
    result = shared_groups(devices).get(scenario)
    log, root = result["log"], Path(result["root"])
    strategy = config["trainer"]["strategy"]["init_args"]
    tp, pp = strategy.get("tensor_parallel_size", 1), strategy.get("pipeline_parallel_size", 1)
    assert f"tp={tp}  pp={pp}  dp={devices // (tp * pp)}  zero_stage={strategy['zero_stage']}" in log, log[-3000:]
    steps = [line for line in log.splitlines() if line.startswith("step ") and " | loss " in line]
    assert len(steps) == 2, (name, log[-3000:])  # the monitor's console line, at steps 1 and 2 (rank 0 only)
    saved = yaml.safe_load(next(root.rglob("config.yaml")).read_text())
    assert saved["trainer"]["max_steps"] == 2
    metrics = next(root.rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics and "throughput/tokens_per_s" in metrics, metrics[:500]
    if name == "fp16_loss_scaling.yaml":  # the scaler is on: its scale (2^16 at the start, 1 without one)
        rows = [r for r in csv.DictReader(io.StringIO(metrics)) if r.get("train/loss_scale")]
        assert len(rows) == 2 and all(2.0**14 <= float(r["train/loss_scale"]) <= 2.0**16 for r in rows), rows


# The GPU configs, CPU-sized: every strategy option as shipped except the sizes the CPU cannot hold (tensor 8 needs
# 16 processes, the largest shared launch has 8), the model, sequence and batch scaled down, the accelerator the CPU;
# the precision (bf16-mixed: Lightning's CPU autocast), clipping, micro-batching, W&B logger (offline without
# credentials, written under the scenario's directory instead of the working directory) and checkpointing as shipped.
SMALL_GPT = ["--model.init_args.block_size=64", "--model.init_args.n_head=4", "--model.init_args.n_embd=64",
             "--data.init_args.block_size=64", "--data.init_args.batch_size=8"]  # fmt: skip
GPU_RUN = ["--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.log_every_n_steps=1",
           "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0",
           "--trainer.logger.init_args.save_dir={root}", *SMALL_GPT]  # fmt: skip
GPU_CONFIGS = {
    # one node of 8: the layout as shipped (tp 2 x pp 2 x dp 2, ZeRO-1, 1F1B over 8 micro-batches, of one sample
    # each here), 2 blocks (one per stage)
    "gpu_8_3d.yaml": cli_scenario("gpu_8_3d.yaml", 8, [*GPU_RUN, "--model.init_args.n_layer=2"]),
    # two nodes: 2 x 4 processes (the launch's ranks given the environment torchrun gives on two nodes, tests/
    # cli_runs.py) instead of 2 x 8; tensor 8 -> 2 so that pp 2 x dp 'auto' (2) fit, num_microbatches 16 -> 2, 4
    # blocks (one per virtual stage)
    "multi_node.yaml": {
        **cli_scenario("multi_node.yaml", 8, [*GPU_RUN, "--model.init_args.n_layer=4", "--trainer.devices=4",
                                              "--trainer.strategy.init_args.tensor_parallel_size=2",
                                              "--trainer.strategy.init_args.num_microbatches=2"]),
        "nodes": 2,
    },
}  # fmt: skip
share(8, list(GPU_CONFIGS.values()))


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", sorted(s["name"] for s in GPU_CONFIGS.values()))
def test_gpu_configs_train_two_steps_cpu_sized(shared_groups, scenario: str) -> None:
    """The two GPU configs, CPU-sized as above, trained two steps through the command's LightningCLI in the shared
    8-process launch: the layout as shipped (multi_node.yaml: sequence parallel under interleaved 1F1B with virtual
    stages, on 2 nodes), bf16-mixed autocast, a finite loss at both steps, an offline W&B run and the checkpoint
    Lightning's default ModelCheckpoint writes at the end."""
    import math

    name = next(n for n, s in GPU_CONFIGS.items() if s["name"] == scenario)
    config = yaml.safe_load((ROOT / "cli_configs" / name).read_text())
    assert config["trainer"]["accelerator"] == "gpu" and config["trainer"]["precision"] == "bf16-mixed"
    shipped = config["trainer"]["strategy"]["init_args"]
    result = shared_groups(8).get(scenario)
    log, root = result["log"], Path(result["root"])
    tp = 2 if name == "multi_node.yaml" else shipped["tensor_parallel_size"]
    layout = (f"world=8  tp={tp}  pp={shipped['pipeline_parallel_size']}  dp=2  zero_stage={shipped['zero_stage']}"
              f"  sequence_parallel={shipped.get('sequence_parallel', False)}")  # fmt: skip
    assert layout in log, log[-3000:]
    saved = yaml.safe_load(next(root.rglob("config.yaml")).read_text())["trainer"]
    assert saved["precision"] == "bf16-mixed" and saved["num_nodes"] == config["trainer"].get("num_nodes", 1)
    kept = {k: v for k, v in shipped.items() if k not in ("tensor_parallel_size", "num_microbatches")}
    assert kept.items() <= saved["strategy"]["init_args"].items(), saved["strategy"]["init_args"]
    losses = [float(line.split(" | loss ")[1].split(" ")[0]) for line in log.splitlines()
              if line.startswith("step ") and " | loss " in line]  # fmt: skip
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses), log[-3000:]
    runs = [p for p in (root / "wandb").glob("offline-run-*") if any(p.glob("*.wandb"))]
    assert len(runs) == 1, (runs, log[-3000:])
    assert [p.name for p in root.rglob("*.ckpt")] == ["epoch=0-step=2.ckpt"], log[-3000:]


# ---------------------------------------------------------------- the strategy's typed sections in YAML, parsed only
def _strategy_from_yaml(tmp_path: Path, init_args: dict, *overrides: str) -> Any:
    """The LightningCLI of a config with these strategy ``init_args``: parsed and instantiated in this process, not
    run (``.trainer.strategy`` is the HybridStrategy)."""
    from lightning.pytorch.cli import LightningCLI

    config = {
        "seed_everything": False,  # leaves this process's random state alone
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                    "strategy": {"class_path": "lightning_hybrid.HybridStrategy", "init_args": init_args}},
        "model": {"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"},
    }  # fmt: skip
    path = tmp_path / "config.yaml"  # read at once: each call may overwrite it
    path.write_text(yaml.safe_dump(config))
    with mock.patch.object(sys, "argv", ["lightning-hybrid"]):  # pytest's own arguments are not the CLI's
        return LightningCLI(subclass_mode_model=True, run=False, save_config_callback=None,
                            args=["--config", str(path), *overrides])  # fmt: skip


FLAT = {"tensor_parallel_size": 2, "tensor_parallel_plan": {"*.mlp.c_fc": "colwise", "*.mlp.c_proj": "rowwise"},
        "pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_size": 2,
        "num_microbatches": 4, "bucket_cap_mb": 50, "checkpoint_verify": False}  # fmt: skip
NESTED = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
          "tensor_parallel": {"plan": {"*.mlp.c_fc": "colwise", "*.mlp.c_proj": "rowwise"}},
          "pipeline": {"schedule": "interleaved_1f1b", "virtual_pipeline_size": 2, "num_microbatches": 4},
          "zero": {"bucket_cap_mb": 50}, "checkpoint": {"verify": False}}  # fmt: skip


@pytest.mark.timeout(120)
def test_yaml_takes_the_strategy_options_flat_or_in_their_sections(tmp_path: Path) -> None:
    flat = _strategy_from_yaml(tmp_path, FLAT).trainer.strategy._options
    assert flat.request.pipeline.virtual_pipeline_size == 2 and flat.checkpoint.verify is False
    assert _strategy_from_yaml(tmp_path, NESTED).trainer.strategy._options == flat  # plain mappings
    with_class_paths = {
        **NESTED,
        "pipeline": {"class_path": "lightning_hybrid.PipelineOptions", "init_args": NESTED["pipeline"]},
    }
    assert _strategy_from_yaml(tmp_path, with_class_paths).trainer.strategy._options == flat
    # a section's field from the command line, and the resolved configuration read back as it was saved
    cli = _strategy_from_yaml(tmp_path, NESTED, "--trainer.strategy.init_args.pipeline.schedule=zbv_zero_bubble")
    assert cli.trainer.strategy._options.request.pipeline.schedule == "zbv_zero_bubble"
    saved = yaml.safe_load(cli.parser.dump(cli.config, skip_none=False))["trainer"]["strategy"]["init_args"]
    assert saved["pipeline"]["schedule"] == "zbv_zero_bubble" and saved["pipeline_schedule"] == "1f1b"
    again = _strategy_from_yaml(tmp_path, saved).trainer.strategy._options
    assert again == cli.trainer.strategy._options


@pytest.mark.timeout(120)
def test_yaml_giving_an_option_both_ways_differently_is_refused(tmp_path: Path) -> None:
    # jsonargparse reports the strategy's HybridConfigError (a ValueError) inside its own, with the text
    with pytest.raises(ValueError, match=r"`bucket_cap_mb=10\.0` and `zero=ZeroOptions\(bucket_cap_mb=50\.0\)` give"):
        _strategy_from_yaml(tmp_path, {**NESTED, "bucket_cap_mb": 10})


@pytest.mark.timeout(120)
def test_the_cli_reads_each_strategy_option_from_its_one_definition() -> None:
    """What jsonargparse (LightningCLI's parser) makes of ``HybridStrategy``'s signature, which is read from the option
    tree (lightning_hybrid/options.py): every option under its flat name with the tree's default, its type checked,
    its help the field's docstring; a ``HybridMonitor`` given by class path is made one."""
    import inspect

    from jsonargparse import ArgumentParser

    from lightning_hybrid import HybridMonitor, HybridStrategy
    from lightning_hybrid.options import flat_options

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(HybridStrategy, "strategy")
    defaults = parser.get_defaults().strategy
    assert list(defaults.keys()) == list(inspect.signature(HybridStrategy).parameters)
    assert {o.name: defaults[o.name] for o in flat_options()} == {o.name: o.default for o in flat_options()}
    with pytest.raises(Exception, match=r'"strategy.zero_stage".*\n.*Expected a <class .int.>'):
        parser.parse_args(["--strategy.zero_stage=three"])
    helped = " ".join(parser.format_help().split())
    for option in flat_options():
        assert f"--strategy.{option.name} " in helped and " ".join(option.doc.split()[:6]) in helped, option.name
    monitor = {"class_path": "lightning_hybrid.HybridMonitor", "init_args": {"log_every_n_steps": 3}}
    config = parser.parse_args([f"--strategy.monitor={json.dumps(monitor)}", "--strategy.num_microbatches=8"])
    options = parser.instantiate(config).strategy._options
    assert isinstance(options.monitor, HybridMonitor) and options.request.pipeline.num_microbatches == 8
