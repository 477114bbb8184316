"""torchmetrics in a 3D run: metric states are reduced over the data-parallel replicas only, and fed plain tensors."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MetricMirror", "sync_metrics_over"]


def sync_metrics_over(module: nn.Module, process_group: Any) -> int:
    """Make every ``torchmetrics.Metric`` inside ``module`` synchronize over ``process_group`` (the data-parallel
    group): tensor and pipeline peers see the same samples, so reducing over them too would count each sample
    several times. Metrics given an explicit ``process_group`` by the user keep it. Also lets ``update`` take the
    DTensors and vocabulary-split logits a tensor-parallel model produces: they arrive as plain tensors, as on one
    device. Returns how many metrics were set.

    Example:
        >>> import torchmetrics
        >>> module = nn.Module()
        >>> module.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        >>> sync_metrics_over(module, process_group=None)  # no group: nothing to change
        0
    """
    if process_group is None:
        return 0
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional for users who log plain tensors
        return 0
    count = 0
    for child in module.modules():
        if isinstance(child, Metric) and not getattr(child, "_lightning_hybrid_synced", False):
            if getattr(child, "process_group", None) is None:
                child.process_group = process_group
            child.update = _plain_inputs(child.update)  # type: ignore[method-assign]
            child._lightning_hybrid_synced = True
            count += 1
    return count


def _plain_inputs(update: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.dtensor import to_plain
    from lightning_hybrid.tensor_parallel.vocab import whole_logits

    @functools.wraps(update)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # a metric may keep what it is given (a list state): never a DTensor, nor logits split over the vocabulary
        args = whole_logits(apply_to_collection(args, DTensor, to_plain))
        kwargs = whole_logits(apply_to_collection(kwargs, DTensor, to_plain))
        return update(*args, **kwargs)

    return wrapped


class MetricMirror:
    """torchmetrics objects under pipeline parallel: the user's step runs on the last stage only, so only there do
    the module's metrics see data. Each step, the last stage collects what the step added to every metric
    (:meth:`begin`, :meth:`end`) and the runner sends it with the step's results to the other stages, which add it to
    their own copy (:meth:`apply`). Every rank then holds the same metric state: Lightning's epoch-end ``compute``
    reduces it over each rank's data-parallel group once (``sync_metrics_over``), and any stage's logged value, the
    step's (``_forward_cache``) and the epoch's, is the last stage's. A metric is never pickled: it holds its process
    group, which cannot travel; its state tensors do.

    What a step adds is kept apart from the state before it, as torchmetrics' own ``forward`` does for a batch: that
    gives the step's value over the whole batch (all its micro-batches), as a data-parallel step on that batch gives.
    A metric whose update reads its running state (``full_state_update``, or ``dist_sync_on_step``) is updated in
    place instead, and its whole state is sent; its step value is then the last micro-batch's.

    Example:
        >>> import torch, torchmetrics
        >>> last, other = nn.Module(), nn.Module()
        >>> last.total, other.total = torchmetrics.SumMetric(), torchmetrics.SumMetric()
        >>> sender, receiver = MetricMirror(last), MetricMirror(other)
        >>> sender.begin()
        >>> _ = last.total(torch.tensor(2.0)), last.total(torch.tensor(3.0))  # two micro-batches
        >>> step = sender.end()
        >>> receiver.apply(step)
        >>> float(other.total.compute()), float(other.total._forward_cache)
        (5.0, 5.0)
    """

    def __init__(self, module: nn.Module) -> None:
        try:
            from torchmetrics import Metric
        except ImportError:  # torchmetrics is optional
            Metric = ()  # noqa: N806
        self.metrics = {name: m for name, m in module.named_modules() if isinstance(m, Metric)}
        self._before: dict[str, tuple[dict[str, Any], int, Any]] = {}

    def begin(self) -> None:
        """Before the step on the last stage: each mergeable metric's state is set aside, the metric starts empty."""
        self._before = {}
        for name, metric in self.metrics.items():
            if _mergeable(metric):
                state = {attr: getattr(metric, attr) for attr in metric._defaults}
                self._before[name] = (state, metric._update_count, metric._forward_cache)
                for attr, default in metric._defaults.items():
                    # a new list, not reset()'s clear(): the set-aside list must keep its items
                    fresh = default.detach().clone().to(state[attr].device) if isinstance(default, Tensor) else []
                    setattr(metric, attr, fresh)
                metric._update_count, metric._forward_cache, metric._computed = 0, None, None
        self._counts = {name: m._update_count for name, m in self.metrics.items() if name not in self._before}

    def end(self) -> dict[str, dict[str, Any]]:
        """After the step on the last stage: what it added to each metric it updated (on CPU, for the other stages),
        now also merged into the state set aside by :meth:`begin`."""
        step: dict[str, dict[str, Any]] = {}
        for name, metric in self.metrics.items():
            if name in self._before:
                state, count, cache = self._before[name]
                updates = metric._update_count
                if updates == 0:  # not used by this step: the state before it, untouched
                    _set_state(metric, state, count, cache)
                    continue
                if metric._forward_cache is not None:  # the step's value over all its micro-batches
                    cache = _value_of_step(metric)
                added = {attr: getattr(metric, attr) for attr in metric._defaults}
                step[name] = {"added": _to_cpu(added), "updates": updates, "value": _to_cpu(cache)}
                _set_state(metric, _merged(metric, state, count, added, updates), count + updates, cache)
            elif metric._update_count != self._counts[name]:
                full = {attr: getattr(metric, attr) for attr in metric._defaults}
                step[name] = {"state": _to_cpu(full), "updates": metric._update_count,
                              "value": _to_cpu(metric._forward_cache)}  # fmt: skip
        self._before = {}
        return step

    @contextmanager
    def unchanged(self) -> Iterator[None]:
        """Metrics as they were before, after the block: for runs of the user's step whose updates must not count (on
        stand-ins for the network's output, on the stages that do not compute it; a check's run). Every attribute is
        put back, the states as copies: an update interrupted midway (a stand-in's value read inside ``forward``)
        leaves torchmetrics' own flags (``_to_sync``, ``_should_unsync``) as they were mid-call."""
        saved = {name: (m._copy_state_dict(), dict(m.__dict__)) for name, m in self.metrics.items()}
        try:
            yield
        finally:
            for name, (state, attributes) in saved.items():
                metric = self.metrics[name]
                metric.__dict__.clear()
                metric.__dict__.update(attributes)
                for attr, value in state.items():
                    setattr(metric, attr, value)

    def referenced(self, records: list[tuple[str, Any, tuple, dict]]) -> list[tuple[str, Any, tuple, dict]]:
        """``records`` (logged name, value, args, kwargs) with each metric object named instead (:meth:`resolved`
        finds it again on the receiving rank), so that the records can be pickled."""
        names = {id(m): name for name, m in self.metrics.items()}
        return [(n, _MetricName(names[id(v)]) if id(v) in names else v, a, k) for n, v, a, k in records]

    def resolved(self, records: list[tuple[str, Any, tuple, dict]]) -> list[tuple[str, Any, tuple, dict]]:
        """``records`` from :meth:`referenced` with each named metric this rank's own object."""
        return [(n, self.metrics[v.name] if isinstance(v, _MetricName) else v, a, k) for n, v, a, k in records]

    def apply(self, step: dict[str, dict[str, Any]]) -> None:
        """On the other stages: add the last stage's step (from :meth:`end`) to this rank's copies of the metrics."""
        for name, sent in step.items():
            metric = self.metrics[name]
            device = _device_of(metric)
            value = _to_device(sent["value"], device)
            if "state" in sent:
                _set_state(metric, _to_device(sent["state"], device), sent["updates"], value)
                continue
            state = {attr: getattr(metric, attr) for attr in metric._defaults}
            count = metric._update_count
            merged = _merged(metric, state, count, _to_device(sent["added"], device), sent["updates"])
            _set_state(metric, merged, count + sent["updates"], value)


@dataclass(frozen=True)
class _MetricName:
    """A logged metric object as it travels between ranks: its name in the module."""

    name: str


def _mergeable(metric: Any) -> bool:
    """Whether the metric's state after a step is its state before, reduced with the step's alone (torchmetrics'
    own condition for ``merge_state``)."""
    return metric.full_state_update is False and not metric.dist_sync_on_step


def _value_of_step(metric: Any) -> Any:
    """``compute`` on the step's state alone, synchronized only where the metric asks for it per step, as
    torchmetrics' ``forward`` computes a batch's value."""
    saved = metric._to_sync, metric._should_unsync, metric.compute_on_cpu
    metric._to_sync, metric._should_unsync, metric.compute_on_cpu = metric.dist_sync_on_step, False, False
    metric._computed = None
    try:
        return metric.compute()
    finally:
        metric._to_sync, metric._should_unsync, metric.compute_on_cpu = saved
        metric._computed = None
        metric._is_synced = False


def _merged(metric: Any, state: dict[str, Any], count: int, added: dict[str, Any], updates: int) -> dict[str, Any]:
    """``state`` (after ``count`` updates) and ``added`` (``updates`` more) reduced as torchmetrics' own
    ``_reduce_states`` does, with the mean weighted by the updates on each side (a step holds several)."""
    from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

    out = {}
    for attr in metric._defaults:
        old, new, reduce_fn = state[attr], added[attr], metric._reductions[attr]
        if count == 0:
            out[attr] = new
        elif reduce_fn == dim_zero_sum:
            out[attr] = old + new
        elif reduce_fn == dim_zero_mean:
            out[attr] = (count * old + updates * new).float() / (count + updates)
        elif reduce_fn == dim_zero_max:
            out[attr] = torch.max(old, new)
        elif reduce_fn == dim_zero_min:
            out[attr] = torch.min(old, new)
        elif reduce_fn == dim_zero_cat or reduce_fn is None and isinstance(old, list):
            out[attr] = torch.cat([old, new]) if isinstance(old, Tensor) else list(old) + list(new)
        elif reduce_fn is None:
            out[attr] = torch.stack([old, new])
        else:
            out[attr] = reduce_fn(torch.stack([old, new]))
    return out


def _set_state(metric: Any, state: dict[str, Any], count: int, cache: Any) -> None:
    for attr, value in state.items():
        setattr(metric, attr, value)
    metric._update_count, metric._forward_cache, metric._computed = count, cache, None


def _device_of(metric: Any) -> torch.device:
    return getattr(metric, "device", torch.device("cpu"))


def _to_cpu(value: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(value, Tensor, lambda t: t.detach().cpu())


def _to_device(value: Any, device: torch.device) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(value, Tensor, lambda t: t.to(device))
