"""The ``lightning-hybrid`` command: Lightning's CLI with HybridStrategy registered.

Example:
    lightning-hybrid fit --config cli_configs/cpu_quickstart.yaml --trainer.strategy.init_args.pipeline_parallel_size=2
    lightning-hybrid plan --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --seq 2048 --micro-batch 4 --nodes 4
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import lightning_hybrid  # noqa: F401  (registers strategy="hybrid" in every launched process)

__all__ = ["main"]


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of ``lightning-hybrid`` and ``python -m lightning_hybrid``; returns the exit status (0 on success).

    The console script hands the return value to ``sys.exit``: anything but an int (the CLI object, a path) would be
    printed and turned into exit status 1, so a successful run must return 0. Failures raise or exit on their own.
    """
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["consolidate"]:  # `lightning-hybrid consolidate CKPT OUT`: no Trainer, no processes
        from lightning_hybrid.checkpoint.consolidate import main as consolidate_main

        consolidate_main(argv[1:])
        return 0
    if argv[:1] == ["convert"]:  # `lightning-hybrid convert deepspeed SRC DST`: another library's checkpoint, in ours
        if argv[1:2] != ["deepspeed"]:
            sys.stderr.write("usage: lightning-hybrid convert deepspeed SRC DST (the one source format so far)\n")
            return 2
        from lightning_hybrid.checkpoint.deepspeed import main as convert_main

        convert_main(argv[2:])
        return 0
    if argv[:1] == ["plan"]:  # `lightning-hybrid plan ...`: arithmetic only, no Trainer, no processes
        from lightning_hybrid.planning.command import main as plan_main

        return plan_main(argv[1:])
    # class paths in configs (e.g. examples.nanogpt.NanoGPT) resolve from the working directory, as with `python -m`
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # Lightning's own CLI, any LightningModule/LightningDataModule by class path: importing this package registered
    # strategy="hybrid", which is all the command adds
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
