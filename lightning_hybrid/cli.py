"""The ``lightning-hybrid`` command: Lightning's CLI with HybridStrategy registered.

Example:
    lightning-hybrid fit --config cli_configs/cpu_quickstart.yaml --trainer.strategy.init_args.pipeline_parallel_size=2
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI

import lightning_hybrid  # noqa: F401  (registers strategy="hybrid" in every launched process)

__all__ = ["HybridCLI", "main"]


class HybridCLI(LightningCLI):
    """``LightningCLI`` for any LightningModule/LightningDataModule given by class path, as Lightning users expect."""


def main(args: Optional[list[str]] = None) -> Any:
    """Entry point of ``lightning-hybrid`` and ``python -m lightning_hybrid``."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["consolidate"]:  # `lightning-hybrid consolidate CKPT OUT`: no Trainer, no processes
        from lightning_hybrid.checkpoint.consolidate import main as consolidate_main

        return consolidate_main(argv[1:])
    # class paths in configs (e.g. examples.nanogpt.NanoGPT) resolve from the working directory, as with `python -m`
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return HybridCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
