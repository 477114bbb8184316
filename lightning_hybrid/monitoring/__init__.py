"""Run monitoring: the communication meter, the monitoring callback, health checks, MFU parts, W&B defaults,
gradient norms."""

from lightning_hybrid.monitoring.callback import HybridMonitor, run_config
from lightning_hybrid.monitoring.comm import CommunicationMeter, Stat
from lightning_hybrid.monitoring.console import format_console_line
from lightning_hybrid.monitoring.flops import count_parameters, device_peak_flops, transformer_flops_per_token
from lightning_hybrid.monitoring.gradients import grad_norm
from lightning_hybrid.monitoring.health import HealthCheckError, HealthChecks
from lightning_hybrid.monitoring.loggers import use_offline_wandb_without_credentials

__all__ = [
    "CommunicationMeter",
    "HealthCheckError",
    "HealthChecks",
    "HybridMonitor",
    "Stat",
    "count_parameters",
    "device_peak_flops",
    "format_console_line",
    "grad_norm",
    "run_config",
    "transformer_flops_per_token",
    "use_offline_wandb_without_credentials",
]
