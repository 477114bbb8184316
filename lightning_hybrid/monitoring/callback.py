"""HybridMonitor: what a 3D run needs watched, logged to every Lightning logger, the console and the progress bar."""

from __future__ import annotations

import math
import platform
import resource
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hybrid._version import __version__
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.monitoring.comm import CommunicationMeter
from lightning_hybrid.monitoring.console import format_console_line
from lightning_hybrid.monitoring.experts import expert_load_metrics, expert_shards_of, take_expert_tokens
from lightning_hybrid.monitoring.flops import (
    count_parameters,
    device_peak_flops,
    measure_training_flops,
    transformer_flops_per_token,
    transformer_sizes,
    unsplit_meta_copy,
)
from lightning_hybrid.monitoring.loggers import use_offline_wandb_without_credentials

__all__ = ["HybridMonitor"]

DIMENSIONS = ("tensor", "pipeline", "data", "expert")
class HybridMonitor(L.Callback):
    """Logs a 3D run's health every ``log_every_n_steps`` optimizer steps, to every logger of the Trainer (W&B, CSV,
    TensorBoard, ...), as one console line, and in the progress bar; raises alerts.

    Values are gathered to where they are logged: the loss comes from the last pipeline stage (the strategy shares
    it) and is averaged over the data-parallel replicas only; memory and communication are gathered from every rank
    (max/min/mean), the bubble from every pipeline rank. Lightning's loggers write on global rank 0, which then holds
    every value. Logged names:

    - ``trainer/global_step``, ``trainer/global_batch_index``, ``train/loss``, ``train/lr``, ``train/grad_norm``,
      ``train/loss_scale`` (1 without a scaler), ``train/skipped_steps``;
    - ``throughput/tokens_per_s``, ``throughput/samples_per_s`` (global), ``throughput/step_time_s`` (mean since the
      last log), ``throughput/flops_per_s`` and ``throughput/flops_per_s_per_device`` (achieved model FLOP/s, also
      on CPU), ``throughput/mfu`` (when the device peak is known or given);
    - ``memory/peak_bytes_max``, ``memory/peak_bytes_min`` (over ranks; CUDA allocator peak, or the process's peak
      RSS on CPU), ``memory/model_state_bytes_max``, ``memory/model_state_bytes_min``;
    - ``comm/share`` and ``comm/share_tensor|pipeline|data|expert`` (seconds in collectives / step time, mean over
      ranks, measured on the logging step with :class:`CommunicationMeter`; ``expert`` is expert parallel's
      all-to-all), ``pipeline/bubble_fraction`` (mean over ranks of the measured idle share; 0 without pipeline
      parallel);
    - under expert parallel, each MoE layer's tokens per expert on the logging step (``experts/<layer>/tokens_<i>``,
      ``tokens_min``, ``tokens_max``) and its ``load_imbalance`` (the most loaded expert over the mean), with
      ``experts/load_imbalance_max`` over the layers (:func:`~lightning_hybrid.monitoring.experts.expert_load_metrics`).

    Arguments:
        log_every_n_steps: logging interval in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        flops_per_token: training FLOPs per token, or per sample where a batch holds no token ids (default: the
            module's ``flops_per_token`` attribute or method; else, for a transformer, whose hyperparameters name its
            layer count, ``6 N + 12 L H T`` from the parameter count and those hyperparameters; else one training
            step measured once on meta tensors by Lightning's ``measure_flops``, per sample: docs/monitoring.md).
        peak_flops: peak FLOP/s of one device (default: Lightning's device table, ``get_available_flops``, for the
            precision's compute dtype; unknown on CPU, so no MFU there).
        console: print one line per logging step on global rank 0.
        progress_bar: show the loss and tokens/s in the progress bar.
        measure_communication: time collectives on logging steps (the meter's dispatch mode slows that one step;
            the share divides by the same step's time).
        communication_alert: alert when the communication share of a step exceeds this fraction.
        loss_spike_factor: alert when the loss exceeds this multiple of its running mean (``loss_spike_window`` steps).
        skipped_steps_alert: alert when this many optimizer steps were skipped (fp16 overflow) within
            ``loss_spike_window`` steps (0: never).
        alert_fn: called as ``alert_fn(title, text)`` for every alert (in addition to W&B or the warning).
        tokens_per_expert: also log each expert's token count under expert parallel (one metric per expert and
            layer); False keeps the per-layer imbalance, minimum and maximum only.

    :class:`~lightning_hybrid.HybridStrategy` adds ``HybridMonitor()`` whenever the Trainer has a logger
    (``monitor=False`` turns that off; ``monitor=HybridMonitor(...)`` chooses the settings; one listed in the
    callbacks is used instead, never a second one).

    Example:
        >>> from lightning_hybrid import HybridStrategy
        >>> from lightning_hybrid.monitoring import HybridMonitor
        >>> monitor = HybridMonitor(log_every_n_steps=10, peak_flops=1e12)
        >>> strategy = HybridStrategy(tensor_parallel_size=2, monitor=monitor)
        >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=100)
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        *,
        flops_per_token: Optional[float] = None,
        peak_flops: Optional[float] = None,
        console: bool = True,
        progress_bar: bool = True,
        measure_communication: bool = True,
        communication_alert: float = 0.30,
        loss_spike_factor: float = 3.0,
        loss_spike_window: int = 20,
        skipped_steps_alert: int = 3,
        alert_fn: Optional[Callable[[str, str], None]] = None,
        tokens_per_expert: bool = True,
    ) -> None:
        _check_arguments(
            log_every_n_steps=log_every_n_steps,
            flops_per_token=flops_per_token,
            peak_flops=peak_flops,
            communication_alert=communication_alert,
            loss_spike_factor=loss_spike_factor,
            loss_spike_window=loss_spike_window,
            skipped_steps_alert=skipped_steps_alert,
        )
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.console, self.progress_bar = console, progress_bar
        self.measure_communication = measure_communication
        self.communication_alert = communication_alert
        self.loss_spike_factor, self.loss_spike_window = loss_spike_factor, loss_spike_window
        self.skipped_steps_alert = skipped_steps_alert
        self.alert_fn = alert_fn
        self.tokens_per_expert = tokens_per_expert
        self.alerts: list[tuple[int, str, str]] = []
        """Every alert raised: (global step, title, text)."""
        self.last_metrics: dict[str, float] = {}
        """The metrics of the last logging step (on every rank)."""
        self._meter: Optional[CommunicationMeter] = None
        self._reset_window()
        self._losses: deque[float] = deque(maxlen=loss_spike_window)
        self._skipped: deque[int] = deque(maxlen=loss_spike_window + 1)
        self._last_batch_end: Optional[float] = None
        self._last_step = 0
        self.wants_gradient_norm = False
        """Whether the current batch is a logging step, whose global gradient norm ``HybridStrategy`` then takes
        (a pass over the gradients and an all-reduce: on logging steps only)."""
        self._tokens_per_sample = 1.0
        self._num_parameters = 0
        self._unsplit: Optional[L.LightningModule] = None
        self.measured_flops_per_sample: Optional[float] = None
        """Training FLOPs per sample measured on the first batch (a module that is not a transformer), else None."""
        self._config_logged = False
        self._throughput: Optional[Throughput] = None
        self._totals: dict[str, float] = {}
        use_offline_wandb_without_credentials()

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        use_offline_wandb_without_credentials(trainer.loggers)
        self.measured_flops_per_sample = None
        if stage == "fit" and self.flops_per_token is None and not _counts_flops(pl_module):
            # before the strategy splits the module (its set-up follows this hook): measured at the first batch
            self._unsplit = unsplit_meta_copy(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the whole model's parameter count: a collective over the pipeline dimension, so here, on every rank
        self._num_parameters = count_parameters(pl_module, _mesh(trainer))
        self._last_batch_end = None
        self._last_step = trainer.global_step
        self._reset_window()
        self._start_throughput(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._unsplit is not None:  # once, on every rank alike (meta tensors: no memory, no collective)
            samples = _count(batch)[0]
            flops = measure_training_flops(self._unsplit, batch) if samples else None
            self.measured_flops_per_sample = flops / samples if flops is not None else None
            self._unsplit = None
        if self._last_batch_end is None:
            self._last_batch_end = time.perf_counter()
        logging_step = (trainer.global_step + 1) % self._every(trainer) == 0
        self.wants_gradient_norm = logging_step
        experts = expert_shards_of(trainer.strategy)
        if experts is not None and logging_step:
            experts.load.counting = True  # the logging step's tokens per expert, all its micro-batches
        if self.measure_communication and self._meter is None and logging_step:
            expert_mesh = experts.mesh if experts is not None else None
            self._meter = CommunicationMeter(_mesh(trainer), expert_mesh=expert_mesh)
            self._meter.__enter__()
            self._meter_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        samples, tokens = _count(batch)
        self._window["samples"] += samples
        self._window["tokens"] += tokens
        self._tokens_per_sample = tokens / samples if samples else 1
        loss = _loss_of(outputs)
        if loss is not None:
            self._window_loss.append(loss * trainer.accumulate_grad_batches)
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: the optimizer has not stepped yet
        self._last_step = trainer.global_step
        now = time.perf_counter()
        self._window["steps"] += 1
        self._window["seconds"] += now - (self._last_batch_end or now)
        self._last_batch_end = now
        step_loss = self._reduce_loss(trainer)
        self._check_step(trainer, step_loss)
        if trainer.global_step % self._every(trainer) == 0:
            self._log(trainer, pl_module, step_loss)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_meter()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close_meter()

    # ------------------------------------------------------------------ per step
    def _every(self, trainer: L.Trainer) -> int:
        return self.log_every_n_steps or max(1, int(trainer.log_every_n_steps))

    def _reset_window(self) -> None:
        self._window: dict[str, Any] = {"samples": 0, "tokens": 0, "steps": 0, "seconds": 0.0}
        self._window_loss: list[float] = []
        self._meter_start = 0.0

    def _reduce_loss(self, trainer: L.Trainer) -> float:
        """This step's loss, averaged over data-parallel replicas (tensor and pipeline peers hold the same value)."""
        local = sum(self._window_loss) / len(self._window_loss) if self._window_loss else float("nan")
        self._window_loss = []
        mesh = _mesh(trainer)
        if mesh is None or mesh["data"].size() == 1:
            return local
        value = torch.tensor([local], dtype=torch.float64, device=trainer.strategy.root_device)
        dist.all_reduce(value, group=mesh["data"].get_group())
        return float(value.item()) / mesh["data"].size()

    def _check_step(self, trainer: L.Trainer, loss: float) -> None:
        step = trainer.global_step
        if not math.isfinite(loss):
            self._alert(trainer, "Non-finite loss", f"The training loss is {loss} at step {step}.")
        else:
            if len(self._losses) >= min(5, self.loss_spike_window):
                mean = sum(self._losses) / len(self._losses)
                if mean > 0 and loss > self.loss_spike_factor * mean:
                    self._alert(
                        trainer,
                        "Loss spike",
                        f"The training loss {loss:.4g} at step {step} is {loss / mean:.1f}x its running mean {mean:.4g}"
                        f" over the last {len(self._losses)} steps (alert above {self.loss_spike_factor}x).",
                    )
            self._losses.append(loss)
        skipped = int(getattr(trainer.strategy.precision_plugin, "skipped_steps", 0) or 0)
        self._skipped.append(skipped)
        burst = skipped - self._skipped[0]
        if self.skipped_steps_alert and burst >= self.skipped_steps_alert:
            self._alert(
                trainer,
                "Skipped steps",
                f"{burst} of the last {len(self._skipped) - 1} optimizer steps were skipped for gradient overflow"
                f" (step {step}, {skipped} in total): the loss scale keeps falling; check the loss and the data.",
            )
            self._skipped.clear()
            self._skipped.append(skipped)

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: float) -> None:
        strategy = trainer.strategy
        window = self._window
        comm_seconds: dict[str, float] = {}
        measured_time = 0.0
        if self._meter is not None:
            measured_time = time.perf_counter() - self._meter_start
            comm_seconds = self._meter.seconds_by_dimension()
            self._close_meter()
        timeline = getattr(strategy, "pipeline_timeline", None)
        mine = {
            "peak_memory": _peak_memory(strategy.root_device),
            "model_state": int(getattr(strategy, "model_state_bytes", {}).get("total", 0)),
            "comm": {d: comm_seconds.get(d, 0.0) / measured_time if measured_time else 0.0 for d in DIMENSIONS},
            "comm_total": sum(comm_seconds.values()) / measured_time if measured_time else 0.0,
            "bubble": float(timeline.bubble_fraction) if timeline is not None else 0.0,
            "seconds": window["seconds"],
            "expert_tokens": take_expert_tokens(strategy),
        }
        everyone = _gather(mine)
        steps = max(1, window["steps"])
        slowest = max(r["seconds"] for r in everyone)  # the slowest rank sets the pace
        step_time = slowest / steps
        rates = self._update_throughput(pl_module, window, slowest)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        scale = getattr(strategy.precision_plugin, "loss_scale", None)
        norm = getattr(strategy, "last_gradient_norm", None)
        metrics: dict[str, float] = {
            "trainer/global_step": float(trainer.global_step),
            "trainer/global_batch_index": float(trainer.fit_loop.total_batch_idx + 1),
            "train/loss": loss,
            "train/lr": float(optimizer.param_groups[0]["lr"]) if optimizer is not None else float("nan"),
            "train/grad_norm": float(norm) if norm is not None else float("nan"),
            "train/loss_scale": float(scale) if scale is not None else 1.0,
            "train/skipped_steps": float(getattr(strategy.precision_plugin, "skipped_steps", 0) or 0),
            "throughput/tokens_per_s": rates.get("items_per_sec", 0.0),
            "throughput/samples_per_s": rates.get("samples_per_sec", 0.0),
            "throughput/step_time_s": step_time,
            "memory/peak_bytes_max": float(max(r["peak_memory"] for r in everyone)),
            "memory/peak_bytes_min": float(min(r["peak_memory"] for r in everyone)),
            "memory/model_state_bytes_max": float(max(r["model_state"] for r in everyone)),
            "memory/model_state_bytes_min": float(min(r["model_state"] for r in everyone)),
            "comm/share": sum(r["comm_total"] for r in everyone) / len(everyone),
            "pipeline/bubble_fraction": sum(r["bubble"] for r in everyone) / len(everyone),
        }
        for d in DIMENSIONS:
            metrics[f"comm/share_{d}"] = sum(r["comm"][d] for r in everyone) / len(everyone)
        if "flops_per_sec" in rates:  # achieved model FLOP/s of the whole run, and per device (rank)
            metrics["throughput/flops_per_s"] = rates["flops_per_sec"]
            metrics["throughput/flops_per_s_per_device"] = rates["flops_per_sec"] / trainer.world_size
        if "mfu" in rates:
            metrics["throughput/mfu"] = rates["mfu"]
        metrics.update(expert_load_metrics([r["expert_tokens"] for r in everyone], self.tokens_per_expert))
        self.last_metrics = metrics
        self._log_config(trainer, window)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.console:
            rank_zero_info(format_console_line(metrics))
        if self.progress_bar:
            pl_module.log("loss", loss, prog_bar=True, logger=False, on_step=True, on_epoch=False)
            pl_module.log(
                "tok/s", metrics["throughput/tokens_per_s"], prog_bar=True, logger=False, on_step=True, on_epoch=False
            )
        if metrics["comm/share"] > self.communication_alert:
            parts = ", ".join(f"{d} {metrics[f'comm/share_{d}']:.0%}" for d in DIMENSIONS)
            self._alert(
                trainer,
                "Communication share",
                f"{metrics['comm/share']:.0%} of step {trainer.global_step} was spent in collectives ({parts}); above"
                f" {self.communication_alert:.0%} the layout is likely wrong (tensor parallel across nodes, too many"
                " pipeline stages for the micro-batches, or too small a batch per replica).",
            )
        self._reset_window()

    def _start_throughput(self, trainer: L.Trainer) -> None:
        """Lightning's ``Throughput`` with one data-parallel replica as its "device": a replica (tp x pp devices)
        processes each sample once, so samples and tokens per replica times the replicas are the global rates, and
        the replica's FLOP/s over its devices' peak is the MFU. (Lightning's ``ThroughputMonitor`` callback counts
        every rank as a data-parallel device: under tensor or pipeline parallel it would count each sample tp x pp
        times.)"""
        mesh = _mesh(trainer)
        replicas = mesh["data"].size() if mesh is not None else trainer.world_size
        dtype = getattr(trainer.precision_plugin, "compute_dtype", torch.float32)
        peak = self.peak_flops or device_peak_flops(trainer.strategy.root_device, dtype)
        if peak is None:
            rank_zero_warn(
                "HybridMonitor: the device's peak FLOP/s is not known (not in Lightning's device table), so MFU is"
                " not logged: pass `HybridMonitor(peak_flops=...)` (FLOP/s of one device), or"
                " `HybridStrategy(monitor=HybridMonitor(peak_flops=...))`."
            )
        per_replica = peak * (trainer.world_size // replicas) if peak else None
        # a window of 2 updates, one per logging step: the rates are over the last logging interval
        self._throughput = Throughput(available_flops=per_replica, world_size=replicas, window_size=2)
        self._totals = {"time": 0.0, "batches": 0, "samples": 0, "lengths": 0}
        self._throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0)

    def _update_throughput(
        self, pl_module: L.LightningModule, window: dict[str, Any], seconds: float
    ) -> dict[str, float]:
        """Feed the logging interval (this replica's samples and tokens, the slowest rank's seconds) to the
        ``Throughput`` and return its global rates: ``samples_per_sec``, ``items_per_sec`` (tokens),
        ``flops_per_sec`` and ``mfu`` (with a known peak)."""
        throughput = self._throughput
        if throughput is None or window["samples"] == 0 or seconds <= 0:
            return {}  # a batch without a tensor to count, or no time passed: nothing to rate
        totals = self._totals
        totals["time"] += seconds
        totals["batches"] += window["steps"]
        totals["samples"] += window["samples"]
        totals["lengths"] += window["tokens"]
        # FLOPs whenever the step's count is known, also without a peak (CPUs): FLOP/s is logged there, MFU is not
        if self.measured_flops_per_sample is not None:
            flops = self.measured_flops_per_sample * window["samples"]
        else:
            flops = self._flops_per_token(pl_module) * window["tokens"]
        throughput.update(
            time=totals["time"], batches=totals["batches"], samples=totals["samples"], lengths=totals["lengths"],
            flops=flops,
        )  # fmt: skip
        computed = throughput.compute()
        # the global rates are left out by Throughput at one replica, where they equal the per-replica ones
        rates = {
            k: float(computed.get(k, computed.get(f"device/{k}", 0.0))) for k in ("samples_per_sec", "items_per_sec")
        }
        if "device/flops_per_sec" in computed:  # one replica's; all replicas' is that times the replicas
            rates["flops_per_sec"] = float(computed.get("flops_per_sec", computed["device/flops_per_sec"]))
        if "device/mfu" in computed:
            rates["mfu"] = float(computed["device/mfu"])
        return rates

    def _flops_per_token(self, pl_module: L.LightningModule) -> float:
        if self.flops_per_token is not None:
            return float(self.flops_per_token)
        own: Union[None, float, Callable[[], float]] = getattr(pl_module, "flops_per_token", None)
        if own is not None:
            return float(own() if callable(own) else own)
        layers, hidden = transformer_sizes(pl_module)
        return transformer_flops_per_token(self._num_parameters, layers, hidden, int(self._tokens_per_sample))

    def _log_config(self, trainer: L.Trainer, window: dict[str, Any]) -> None:
        """The run's configuration: the full layout, precision, global batch, world size and versions (once)."""
        if self._config_logged:
            return
        self._config_logged = True
        config = run_config(trainer)
        mesh = _mesh(trainer)
        dp = mesh["data"].size() if mesh is not None else trainer.world_size
        per_replica = window["samples"] / max(1, window["steps"])
        config["global_batch_size"] = int(round(per_replica * dp))
        config["tokens_per_sample"] = int(self._tokens_per_sample)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams({"lightning_hybrid": config})

    # ------------------------------------------------------------------ alerts
    def _alert(self, trainer: L.Trainer, title: str, text: str) -> None:
        self.alerts.append((trainer.global_step, title, text))
        if self.alert_fn is not None:
            self.alert_fn(title, text)
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import WandbLogger

        wandb_loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        for logger in wandb_loggers:
            import wandb

            logger.experiment.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
        if not wandb_loggers:
            rank_zero_warn(f"HybridMonitor alert: {title}: {text}")

    def _close_meter(self) -> None:
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_arguments(
    *,
    log_every_n_steps: Any,
    flops_per_token: Any,
    peak_flops: Any,
    communication_alert: Any,
    loss_spike_factor: Any,
    loss_spike_window: Any,
    skipped_steps_alert: Any,
) -> None:
    """Refuse settings the monitor cannot act on, each naming the parameter, the value and the fix (in the
    constructor: every rank builds the callback alike, before any collective)."""

    def refuse(name: str, value: Any, fix: str) -> None:
        raise HybridConfigError(f"`HybridMonitor({name}={value!r})`: {fix}")

    if log_every_n_steps is not None and (not _is_int(log_every_n_steps) or log_every_n_steps < 1):
        refuse(
            "log_every_n_steps", log_every_n_steps, "pass a positive integer (optimizer steps between logs), or None"
            " for the Trainer's `log_every_n_steps`."
        )  # fmt: skip
    for name, value, what in (("flops_per_token", flops_per_token, "training FLOPs per token"),
                              ("peak_flops", peak_flops, "peak FLOP/s of one device, e.g. 989e12")):  # fmt: skip
        if value is not None and (not _is_number(value) or not value > 0):
            refuse(name, value, f"pass a positive number ({what}), or None for the default.")
    if not _is_number(communication_alert) or not 0 < communication_alert:
        refuse(
            "communication_alert", communication_alert, "pass the share of a step spent in collectives above which"
            " to alert, e.g. 0.3 (a value of 1 or more never alerts)."
        )  # fmt: skip
    if not _is_number(loss_spike_factor) or not loss_spike_factor > 1:
        refuse(
            "loss_spike_factor", loss_spike_factor, "pass a number above 1, the multiple of the running mean loss"
            " that counts as a spike, e.g. 3.0."
        )  # fmt: skip
    if not _is_int(loss_spike_window) or loss_spike_window < 1:
        refuse(
            "loss_spike_window", loss_spike_window, "pass a positive integer, the steps of the running mean loss and"
            " of the skipped-steps count, e.g. 20."
        )  # fmt: skip
    if not _is_int(skipped_steps_alert) or skipped_steps_alert < 0:
        refuse(
            "skipped_steps_alert", skipped_steps_alert, "pass a non-negative integer, the skipped steps within"
            " `loss_spike_window` steps that raise the alert (0: never), e.g. 3."
        )  # fmt: skip
    if skipped_steps_alert > loss_spike_window:
        refuse(
            "skipped_steps_alert", skipped_steps_alert, f"it can never fire: at most `loss_spike_window`"
            f" ({loss_spike_window}) steps are counted; lower it or raise `loss_spike_window`."
        )  # fmt: skip


def run_config(trainer: L.Trainer) -> dict[str, Any]:
    """The layout and environment of a run, as logged to the loggers' run config."""
    import lightning

    strategy = trainer.strategy
    layout = getattr(strategy, "layout", None)
    config: dict[str, Any] = dict(layout.as_dict()) if layout is not None else {}
    config.update(
        precision=str(trainer.precision),
        world_size=trainer.world_size,
        num_nodes=trainer.num_nodes,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        versions={
            "lightning_hybrid": __version__,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda or "none",
        },
        process_group_backend=str(getattr(strategy, "process_group_backend", None)),
        command=" ".join(sys.argv),
    )
    return config


def _mesh(trainer: L.Trainer) -> Any:
    try:
        return trainer.strategy.device_mesh
    except (AttributeError, RuntimeError):
        return None


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _counts_flops(pl_module: L.LightningModule) -> bool:
    """Whether the module gives its FLOPs (``flops_per_token``) or is a transformer (its hyperparameters or its
    model's configuration name its layer count), whose FLOPs per token the formula gives: otherwise a training step
    is measured."""
    return getattr(pl_module, "flops_per_token", None) is not None or transformer_sizes(pl_module)[0] > 0


def _count(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of a batch: its first tensor's leading size, and its element count if it holds token ids."""
    first = _first_tensor(batch)
    if first is None or first.dim() == 0:
        return 0, 0
    samples = int(first.shape[0])
    tokens = int(first.numel()) if not first.is_floating_point() and first.dim() >= 2 else samples
    return samples, tokens


def _first_tensor(obj: Any) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        for key in ("input_ids", "idx", "x"):
            if isinstance(obj.get(key), torch.Tensor):
                return obj[key]
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _loss_of(outputs: Any) -> Optional[float]:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().float().item())
    return None


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # peak resident set size of this process (Linux reports KiB, macOS bytes)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
