"""A shipped YAML trained through ``lightning_hybrid.cli.main`` inside a shared launch (tests/worker.py): the same
LightningCLI, strategy and module as ``lightning-hybrid fit --config``, without starting processes of its own.
The installed command itself, with the ranks Lightning launches, is run by tests/test_monitoring.py (a user's YAML
with a W&B logger at pp=2) and tests/test_teardown.py."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]


# two steps with a CSV logger ("{root}": the scenario's own directory)
TWO_STEPS_CSV = [
    "--trainer.max_steps=2", "--trainer.log_every_n_steps=1", "--trainer.num_sanity_val_steps=0",
    "--trainer.limit_val_batches=0", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
    "--trainer.logger.init_args.save_dir={root}",
]  # fmt: skip


def cli_scenario(config: str, world: int, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """``cli_configs/<config>`` with these command-line ``overrides`` (default: two steps with a CSV logger), its
    ``default_root_dir`` the scenario's directory."""
    return {"name": f"cli-{Path(config).stem}", "runner": "cli", "config": config, "world": world,
            "overrides": TWO_STEPS_CSV if overrides is None else overrides}  # fmt: skip


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """The process's stdout and stderr into ``path``, at the file-descriptor level: Lightning's logging handlers
    hold the streams they found at import, so replacing ``sys.stdout`` would miss them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run(scenario: dict[str, Any], out_dir: Path) -> None:
    from lightning_hybrid.cli import main

    root = out_dir / scenario["name"]
    rank = int(os.environ["RANK"])
    log = out_dir / f"{scenario['name']}.rank{rank}.log"
    overrides = [f"--trainer.default_root_dir={root}", *(o.format(root=root) for o in scenario["overrides"])]
    cwd, nodes = os.getcwd(), {}
    if scenario.get("nodes"):  # the environment torchrun gives the same ranks on that many nodes
        per_node = int(os.environ["WORLD_SIZE"]) // scenario["nodes"]
        nodes = {"LOCAL_RANK": str(rank % per_node), "GROUP_RANK": str(rank // per_node),
                 "LOCAL_WORLD_SIZE": str(per_node), "GROUP_WORLD_SIZE": str(scenario["nodes"])}  # fmt: skip
    environ = {k: os.environ.get(k) for k in nodes}  # one node's, put back for the next scenario
    os.environ.update(nodes)
    os.chdir(ROOT)  # class paths in the configs (examples.*) resolve from the repository root, as for a user there
    try:
        with _output_to(log):
            try:
                status = main(["fit", "--config", str(ROOT / "cli_configs" / scenario["config"]), *overrides])
            finally:
                wandb = sys.modules.get("wandb")
                if wandb is not None and wandb.run is not None:
                    wandb.finish()  # what a user's process does at exit: the next scenario's logger starts its own
    except SystemExit as exit_:  # the CLI's parser exits on a bad config: a failed scenario, not a dead rank
        status = exit_.code
    finally:
        os.chdir(cwd)
        for key, value in environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if status:
        raise RuntimeError(f"lightning_hybrid.cli.main returned {status}:\n{log.read_text()[-3000:]}")
    if rank == 0:
        torch.save({"log": log.read_text(), "root": str(root)}, out_dir / f"{scenario['name']}.pt")
