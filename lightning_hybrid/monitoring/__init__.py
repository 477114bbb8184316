"""Run monitoring: communication meter (and, later, the monitoring and health-check callbacks)."""

from lightning_hybrid.monitoring.comm import CommunicationMeter, Stat

__all__ = ["CommunicationMeter", "Stat"]
