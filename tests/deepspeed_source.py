"""A raw DeepSpeed engine training the test nanoGPT in the worker's processes (gloo, CPU): the source of the DeepSpeed
checkpoint-import tests (tests/test_deepspeed.py).

Every process is one DeepSpeed data-parallel rank with micro-batch 1. Rank ``q`` plays sample ``q % per_replica`` of
the batch that data-parallel replica ``q // per_replica`` of the target layout sees (Lightning's DistributedSampler
over ``target_dp`` replicas), so the global batch of a DeepSpeed step is the target layout's global batch. The engine
trains ``steps`` steps on the target's batches ``steps..2*steps-1``, saves, then continues ``steps`` more steps on
batches ``0..steps-1``: what a fresh ``Trainer.fit`` from the checkpoint (a raw engine's checkpoint has no loop state)
sees. Recorded: the weights at the save, the continuation's losses and the final weights.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from tests.harness import SEED, build_module, make_dataset


def _full_weights(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone().float() for n, p in params.items()}
    return {n: p.detach().clone().float() for n, p in params.items()}


def run_deepspeed_source(scenario: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    import deepspeed

    spec = scenario["deepspeed_source"]
    stage, steps, target_dp = spec["stage"], spec["steps"], spec["target_dp"]
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
        atexit.register(dist.destroy_process_group)  # while the interpreter is whole (see the strategy's teardown)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_replica = world // target_dp
    module = build_module(scenario["model"], **scenario.get("model_kwargs", {}))
    optimizer = module.configure_optimizers()  # torch AdamW with the module's groups, as Lightning would build it
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=target_dp, rank=rank // per_replica, shuffle=True, seed=SEED)
    indices = list(sampler)
    batch = scenario["batch_size"]  # the target's per-replica batch size: per_replica samples of it per step
    assert batch == per_replica, (batch, per_replica)

    def step(s: int) -> float:
        x, y = dataset[indices[s * batch + rank % per_replica]]
        logits = engine(x.unsqueeze(0))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world

    for s in range(steps, 2 * steps):
        step(s)
    save_dir = out_dir / scenario["name"] / spec.get("folder", "ckpt")
    if spec.get("lightning_layout"):
        # what Lightning's DeepSpeedStrategy.save_checkpoint writes: tag "checkpoint", Lightning's entries as the
        # client state (its state_dict and optimizer_states left to DeepSpeed)
        import lightning

        client = {"epoch": 0, "global_step": steps, "pytorch-lightning_version": lightning.__version__}
        engine.save_checkpoint(str(save_dir), tag="checkpoint", client_state={**client, "lr_schedulers": []})
    else:
        engine.save_checkpoint(str(save_dir), tag=f"global_step{steps}")
    handover = _full_weights(engine, stage)
    losses = [step(s) for s in range(steps)]
    final = _full_weights(engine, stage)
    dist.barrier()
    engine.destroy() if hasattr(engine, "destroy") else None
    return {"handover": handover, "losses": losses, "params": final, "path": str(save_dir)}


def record(scenario: dict[str, Any], out_dir: Path) -> None:
    """Run the DeepSpeed source scenario and save its record (rank 0) as the worker saves any scenario's."""
    result = run_deepspeed_source(scenario, out_dir)
    if int(os.environ["RANK"]) == 0:
        torch.save(result, out_dir / f"{scenario['name']}.pt")
