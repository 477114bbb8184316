"""Shared by the multi-process worker and the single-process reference: the same modules, data, seed and recording.

A scenario is a plain dict: ``{"name", "model", "model_kwargs", "strategy", "steps", "batch_size", "world"}``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.any_module_models import build_any_module, image_dataset

SEED = 1234
SEQ_LEN = 16
NUM_SAMPLES = 256

# learning_rate 1e-4: fp32 Adam turns the last-bit differences of a different summation order (micro-batches,
# shards) into up to ~1% of one step on a few elements; at 1e-3 a 5-layer model reaches 2e-5 relative parameter
# error after 10 steps while every loss still agrees to 1e-7. A real bug still moves parameters by >1e-3 relative.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "nanogpt": {"vocab_size": 128, "block_size": SEQ_LEN, "n_layer": 2, "n_head": 4, "n_embd": 32,
                "learning_rate": 1e-4},
    "llama": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64, "learning_rate": 1e-4},
}  # fmt: skip


def build_module(model: str, **kwargs: Any) -> L.LightningModule:
    L.seed_everything(SEED, verbose=False)
    if model == "nanogpt":
        from examples.nanogpt import NanoGPT

        return NanoGPT(**{**MODEL_DEFAULTS["nanogpt"], **kwargs})
    if model == "nanogpt_no_example":  # a module that gives no example_input_array (profiling needs one)
        from examples.nanogpt import NanoGPT

        module = NanoGPT(**{**MODEL_DEFAULTS["nanogpt"], **kwargs})
        module.example_input_array = None
        return module
    if model == "nanogpt_user_tp":
        return _user_tensor_parallel_nanogpt(**{**MODEL_DEFAULTS["nanogpt"], **kwargs})
    if model == "llama":
        from examples.hf_llama import HFLlama

        return HFLlama(**{**MODEL_DEFAULTS["llama"], **kwargs})
    from tests.precision_probe import build_precision_module

    module = build_precision_module(model, **{**MODEL_DEFAULTS["nanogpt"], **kwargs})
    if module is None:
        from tests.bucket_models import build_bucket_module

        module = build_bucket_module(model, **{**MODEL_DEFAULTS["nanogpt"], **kwargs})
    module = build_any_module(model, **kwargs) if module is None else module
    if module is None:
        from tests.zoo_models import build_zoo_module

        module = build_zoo_module(model, **kwargs)
    if module is None:
        from tests.pipeline_models import build_pipeline_module

        module = build_pipeline_module(model, **{**MODEL_DEFAULTS["nanogpt"], **kwargs})
    if module is None:
        from tests.big_models import build_deferred_module

        defaults = MODEL_DEFAULTS.get(model.removeprefix("deferred_"), {})
        module = build_deferred_module(model, **{**defaults, **kwargs})
    if module is None:
        from tests.vision_models import build_vision_module

        module = build_vision_module(model, **kwargs)
    if module is None:
        from tests.foreign_models import build_foreign_module

        module = build_foreign_module(model, **kwargs)
    if module is None:
        from tests.context_models import build_context_module

        module = build_context_module(model, **kwargs)
    if module is None:
        from tests.boundary_models import build_boundary_module

        module = build_boundary_module(model, **kwargs)
        if module is None:
            from tests.loss_models import build_loss_module

            module = build_loss_module(model, **kwargs)
    if module is None:
        raise ValueError(model)
    return module


def _user_tensor_parallel_nanogpt(**kwargs: Any) -> L.LightningModule:
    """The nanoGPT example with the third way of giving a plan: the user's own ``configure_model`` calls
    ``parallelize_module`` with ``self.device_mesh["tensor"]`` (a plain module on one device)."""
    from examples.nanogpt import NanoGPT

    class UserParallelNanoGPT(NanoGPT):
        def configure_model(self) -> None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            if self.device_mesh is None or self.device_mesh["tensor"].size() == 1:
                return
            mesh = self.device_mesh["tensor"]
            for block in self.model.h:
                # separate-projection attention is not in this model, so only the MLP is split here
                parallelize_module(block.mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})

    return UserParallelNanoGPT(**kwargs)


def make_dataset(kind: str = "tokens") -> TensorDataset:
    """Real characters of the example corpus, cut into fixed windows (same on every process, no randomness);
    ``"images"``: synthetic images and labels for the modules of tests/any_module_models.py; ``"repeated"``: the first
    window, repeated (a scenario's ``"dataset"``)."""
    if kind == "images":
        return image_dataset(NUM_SAMPLES, SEED)
    if kind == "odd_tokens":  # windows of SEQ_LEN - 1 tokens: a sequence no even tensor-parallel size divides
        x, y = make_dataset().tensors
        return TensorDataset(x[:, 1:].contiguous(), y[:, 1:].contiguous())
    if kind == "repeated":  # one window NUM_SAMPLES times: every batch of every step is the same
        x, y = make_dataset()[0]
        return TensorDataset(x.repeat(NUM_SAMPLES, 1), y.repeat(NUM_SAMPLES, 1))
    from examples.data import load_corpus

    text = load_corpus(NUM_SAMPLES * (SEQ_LEN + 1) + 1)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)[: NUM_SAMPLES * (SEQ_LEN + 1)]
    windows = ids.view(NUM_SAMPLES, SEQ_LEN + 1)
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def reference_loader(dataset: TensorDataset, data_parallel_size: int, batch_size: int, epochs: int = 1) -> DataLoader:
    """The global batches a data-parallel run sees: step s concatenates every replica's s-th batch, in rank order, as
    Lightning's DistributedSampler (shuffled, seeded by the global seed, reshuffled per epoch) hands them out."""
    batches = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(data_parallel_size):
            sampler = DistributedSampler(dataset, num_replicas=data_parallel_size, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        steps = -(-len(per_rank[0]) // batch_size)  # the DataLoader keeps a last, smaller batch
        batches += [sum((idx[s * batch_size : (s + 1) * batch_size] for idx in per_rank), []) for s in range(steps)]
    return DataLoader(dataset, batch_sampler=batches)


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from lightning_hybrid.checkpoint import full_tensor

    return {n: full_tensor(p).detach().clone().cpu() for n, p in module.named_parameters()}


class Recorder(L.Callback):
    """Per-step loss (averaged over data-parallel replicas), first-step gradients, and the model-state report."""

    def __init__(self, data_group: Any = None, data_size: int = 1) -> None:
        self.data_group, self.data_size = data_group, data_size
        self.losses: list[float] = []
        self.logged: list[float] = []
        """Per batch, the ``train_loss`` the module logged (``trainer.callback_metrics``), where it logs one."""
        self.norms: list[float] = []
        self.batch_fingerprints: list[int] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.model_state: list[dict[str, int]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not hasattr(trainer.strategy, "last_gradient_norm"):
            # single device: the norm Lightning's clipping is about to use (gradients are not clipped yet here)
            grads = [p.grad.double() for p in {id(p): p for p in pl_module.parameters()}.values() if p.grad is not None]
            self.norms.append(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))))
        if trainer.global_step == 0 and not getattr(self, "grads_locked", False):
            strategy = trainer.strategy
            if hasattr(strategy, "full_gradients"):
                self.grads = {k: v.detach().clone().cpu() for k, v in strategy.full_gradients().items()}
            else:
                self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batch_fingerprints.append(int(batch[0].sum()) if isinstance(batch, (list, tuple)) else -1)
        loss = outputs["loss"].detach().clone().float()
        if self.data_group is not None and self.data_size > 1:
            torch.distributed.all_reduce(loss, group=self.data_group)
            loss /= self.data_size
        self.losses.append(loss.item())
        if "train_loss" in trainer.callback_metrics:
            self.logged.append(float(trainer.callback_metrics["train_loss"]))
        if getattr(trainer.strategy, "last_gradient_norm", None) is not None:
            self.norms.append(trainer.strategy.last_gradient_norm)
        if hasattr(trainer.strategy, "model_state_bytes"):
            self.model_state.append(dict(trainer.strategy.model_state_bytes))


def trainer_kwargs(steps: int) -> dict[str, Any]:
    return {
        "max_steps": steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }


def run_reference(
    scenario: dict[str, Any], module: L.LightningModule | None = None, plugins: list[Any] | None = None
) -> dict[str, Any]:
    """Single process, single device: the ground truth for a scenario (of ``module`` if given, e.g. one that loaded
    pretrained weights its own way; ``plugins``: the Trainer's, e.g. fp16 autocast on CPU, which
    ``precision="16-mixed"`` turns into bf16 there)."""
    torch.set_num_threads(max(1, int(os.environ.get("REFERENCE_THREADS", "1"))))
    # modules that parallelize themselves in configure_model: the same module without it
    model = {"nanogpt_user_tp": "nanogpt", "lightning_mp": "lightning_mp_single"}.get(
        scenario["model"], scenario["model"]
    )
    if module is None:
        module = build_module(model, **scenario.get("model_kwargs", {}))
    dp = scenario["data_parallel_size"]
    per_epoch = -(-NUM_SAMPLES // (dp * scenario["batch_size"]))
    dataset = make_dataset(scenario.get("dataset", "tokens"))
    loader = reference_loader(dataset, dp, scenario["batch_size"], epochs=-(-scenario["steps"] // per_epoch))
    recorder = Recorder()
    kwargs = {**trainer_kwargs(scenario["steps"]), **scenario.get("trainer", {})}
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[recorder], plugins=plugins, **kwargs)
    trainer.fit(module, train_dataloaders=loader)
    return {
        "losses": recorder.losses,
        "logged": recorder.logged,
        "grads": recorder.grads,
        "params": full_parameters(module),
        "norms": recorder.norms,
    }


def check_trained_or_refused(group: Any, case: dict[str, Any], world: int, tolerance: float = 1e-5) -> list[str]:
    """A shared-launch scenario with a ``refusal`` pattern: every rank raised the same error matching it (returned);
    without one: its per-step losses, final parameters and first-step gradients match one device within
    ``tolerance`` (relative), and an empty list is returned."""
    import re

    from tests.conftest import relative_error

    if case["refusal"]:
        messages = group.expected_errors(case["name"])
        assert len(messages) == world and len(set(messages)) == 1, messages
        assert re.match(case["refusal"], messages[0]), messages[0]
        return messages
    result = group.get(case["name"])
    reference = run_reference({k: v for k, v in case.items() if k not in ("strategy", "refusal")})
    assert len(result["losses"]) == len(reference["losses"]) == case["steps"]
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) / abs(want) <= tolerance, f"step {step}: loss {got} vs one device {want}"
    for kind in ("params", "grads"):  # final parameters, first-step gradients (gathered over the shards)
        assert result[kind].keys() == reference[kind].keys(), kind
        for name, want in reference[kind].items():
            err = relative_error(result[kind][name], want)
            assert err <= tolerance, f"{kind} {name}: relative error {err:.2e}"
    return []
