"""Weights & Biases without credentials: an offline run on disk, never a login prompt or a crash."""

from __future__ import annotations

import netrc
import os
from typing import Any, Optional
from urllib.parse import urlparse

__all__ = ["has_wandb_credentials", "use_offline_wandb_without_credentials"]


def has_wandb_credentials() -> bool:
    """An API key in ``WANDB_API_KEY`` or a ``~/.netrc`` entry for the W&B host (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def use_offline_wandb_without_credentials(loggers: Optional[list[Any]] = None) -> bool:
    """Set ``WANDB_MODE=offline`` when no mode is chosen and no credentials exist, so a ``WandbLogger`` writes its run
    to its directory (``wandb sync`` uploads it later) instead of prompting for a login or failing without a
    terminal. Returns True when it did. With ``loggers`` given, only acts if one of them is a ``WandbLogger``.

    Example:
        >>> import os
        >>> os.environ["WANDB_MODE"] = "online"
        >>> use_offline_wandb_without_credentials()  # an explicit choice is kept
        False
        >>> del os.environ["WANDB_MODE"]
    """
    if os.environ.get("WANDB_MODE") or has_wandb_credentials():
        return False
    if loggers is not None:
        from lightning.pytorch.loggers import WandbLogger

        if not any(isinstance(logger, WandbLogger) for logger in loggers):
            return False
    os.environ["WANDB_MODE"] = "offline"
    return True
