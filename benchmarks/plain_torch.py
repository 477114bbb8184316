"""The references written without Lightning: a plain ``torch.distributed.pipelining`` loop, a plain-torch 3D script
(DeviceMesh + DTensor tensor parallel + FSDP2 + pipelining) and the DeepSpeed engine's own loop.

Each trains the nanoGPT example (``examples.nanogpt.GPT``) on the same token batches as the Lightning runs and returns
the wall time of every step (forward, backward and optimizer step). Nothing here imports ``lightning_hybrid``: these
are the floors our overhead is measured against.

Example (inside an initialised process group of 2 CPU processes):
    >>> # times = plain_pipeline({"n_layer": 4, ...}, global_batch=8, steps=3, schedule="1f1b", microbatches=4)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SEED = 1234
MULTI_STAGE = {"interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv_zero_bubble": 2}
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}


def bench_device() -> torch.device:
    """The device of this rank: the GPU of its local rank when the launcher asked for CUDA (``LH_BENCH_DEVICE``),
    else the CPU."""
    if os.environ.get("LH_BENCH_DEVICE") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@contextlib.contextmanager
def bench_autocast() -> Iterator[None]:
    """bf16 autocast on GPU (what ``precision="bf16-mixed"`` does for the Lightning runs); nothing on CPU (fp32)."""
    device = bench_device()
    with torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext():
        yield


def token_batches(vocab_size: int, block_size: int, global_batch: int, steps: int) -> torch.Tensor:
    """``steps * global_batch`` random sequences of ``block_size + 1`` tokens (inputs and shifted targets); every run
    and every rank draws the same ones."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (steps * global_batch, block_size + 1), generator=generator)


def build_gpt(model: dict[str, Any]) -> nn.Module:
    """The example's network with the example's initialisation (same seed as the Lightning runs)."""
    from examples.nanogpt import GPT, GPTConfig

    torch.manual_seed(SEED)
    fields = {k: v for k, v in model.items() if k in GPTConfig.__dataclass_fields__}
    return GPT(GPTConfig(**fields)).to(bench_device())


def adamw(params: list[nn.Parameter], learning_rate: float = 1e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """The example's optimizer (``NanoGPT.configure_optimizers``): AdamW, decay on matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


class StagePart(nn.Module):
    """Blocks ``first..last`` of the network, with the embeddings on stage 0 and the head on the last stage."""

    def __init__(self, gpt: nn.Module, blocks: range, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.h = nn.ModuleList(gpt.h[i] for i in blocks)
        if is_last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


def local_stage_indices(schedule: str, pipeline_rank: int, pipeline_size: int) -> list[int]:
    """Stages this rank runs: one; two in a loop (interleaved: r and r+p) or in a V (zbv: r and 2p-1-r)."""
    if schedule == "zbv_zero_bubble":
        return [pipeline_rank, 2 * pipeline_size - 1 - pipeline_rank]
    virtual = MULTI_STAGE.get(schedule, 1)
    return [pipeline_rank + k * pipeline_size for k in range(virtual)]


def _stage_parts(gpt: nn.Module, schedule: str, pipeline_rank: int, pipeline_size: int) -> tuple[list[int], int, Any]:
    stages = local_stage_indices(schedule, pipeline_rank, pipeline_size)
    num_stages = pipeline_size * MULTI_STAGE.get(schedule, 1)
    per_stage = len(gpt.h) // num_stages
    parts = [StagePart(gpt, range(s * per_stage, (s + 1) * per_stage), s == 0, s == num_stages - 1) for s in stages]
    return stages, num_stages, parts


def _schedule(
    parts: list[nn.Module], stages: list[int], num_stages: int, schedule: str, microbatches: int, group: Any
) -> Any:
    from torch.distributed import pipelining

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # the micro-batch mean over m micro-batches: the batch mean's gradient, as Lightning's runs compute it
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1)) / microbatches

    device = bench_device()
    built = [pipelining.PipelineStage(p, s, num_stages, device, group=group) for p, s in zip(parts, stages)]
    cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    if schedule in MULTI_STAGE:
        return cls(built, microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(built[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def _timed_steps(steps: int, one_step: Callable[[int], None]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step: CPU time is what this process computed, which other jobs on a shared
    machine disturb far less than wall time."""
    cuda = bench_device().type == "cuda"
    times = []
    for s in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        one_step(s)
        if cuda:
            torch.cuda.synchronize()  # kernels run asynchronously: the step ends when the GPU is done
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def plain_pipeline(
    model: dict[str, Any], *, global_batch: int, steps: int, schedule: str, microbatches: int
) -> list[tuple[float, float]]:
    """A plain ``torch.distributed.pipelining`` training loop over all ranks (pipeline only): (wall, CPU) seconds of
    each step."""
    pipeline = PlainPipeline(model, schedule=schedule, microbatches=microbatches)
    tokens = token_batches(model["vocab_size"], model["block_size"], global_batch, steps)

    def one_step(s: int) -> None:
        batch = tokens[s * global_batch : (s + 1) * global_batch].to(bench_device())
        pipeline.step(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        pipeline.optimizer.step()
        pipeline.optimizer.zero_grad(set_to_none=True)

    return _timed_steps(steps, one_step)


class PlainPipeline:
    """This rank's stages of the example network under a plain ``torch.distributed.pipelining`` schedule over all
    ranks, and their optimizer: what :func:`plain_pipeline` loops over, and what the Lightning-loop floor of the
    host-overhead row runs inside ``training_step`` (``benchmarks/lightning_runs.py``)."""

    def __init__(self, model: dict[str, Any], *, schedule: str, microbatches: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        gpt = build_gpt(model)
        stages, num_stages, self.parts = _stage_parts(gpt, schedule, rank, world)
        del gpt
        self.params = [p for part in self.parts for p in part.parameters()]
        self.optimizer = adamw(self.params, model.get("learning_rate", 1e-3))
        self.schedule = _schedule(self.parts, stages, num_stages, schedule, microbatches, None)
        self.first, self.last = 0 in stages, num_stages - 1 in stages

    def step(self, x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        """One forward and backward of the batch over the pipeline (gradients accumulate in the stages); the batch's
        mean loss on the rank of the last stage, None elsewhere."""
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        with bench_autocast():
            self.schedule.step(*((x,) if self.first else ()), **kwargs)
        return torch.stack(losses).sum().detach() if self.last else None


def permute_fused_qkv(linear: nn.Linear, tensor_parallel_size: int) -> None:
    """Reorder a fused q|k|v projection's output rows to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] so that torch's plain
    ``ColwiseParallel`` hands rank r its own heads of q, k and v (what a hand-written plan does; the model's math is
    unchanged because the rows are only stored in another order)."""
    with torch.no_grad():
        for name in ("weight", "bias"):
            t = getattr(linear, name)
            if t is None:
                continue
            q, k, v = t.chunk(3, dim=0)
            parts = [chunk for r in range(tensor_parallel_size) for chunk in
                     (q.chunk(tensor_parallel_size)[r], k.chunk(tensor_parallel_size)[r],
                      v.chunk(tensor_parallel_size)[r])]  # fmt: skip
            t.copy_(torch.cat(parts, dim=0))


def hand_tensor_parallel(gpt: nn.Module, tp_mesh: Any, *, blocks: Optional[list[nn.Module]] = None) -> None:
    """The tensor-parallel plan written by hand (Megatron's layout, as Lightning's ModelParallelStrategy docs show):
    q|k|v and the first MLP layer column-wise, the projections after them row-wise, a vocabulary-parallel embedding
    and head (logits stay sharded over the vocabulary; the loss runs under ``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in blocks if blocks is not None else list(gpt.h):
        permute_fused_qkv(block.attn.c_attn, tp)
        block.attn.n_head //= tp
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}  # fmt: skip
        parallelize_module(block, tp_mesh, plan)
    outer = {}
    if getattr(gpt, "wte", None) is not None:
        outer["wte"] = RowwiseParallel(input_layouts=Replicate())
    if getattr(gpt, "lm_head", None) is not None:
        outer["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if outer:
        parallelize_module(gpt, tp_mesh, outer)


def plain_3d(
    model: dict[str, Any],
    *,
    global_batch: int,
    steps: int,
    pipeline_parallel_size: int,
    tensor_parallel_size: int,
    microbatches: int,
    schedule: str = "1f1b",
) -> list[tuple[float, float]]:
    """The same 3D layout as ``HybridStrategy(tensor_parallel_size, pipeline_parallel_size, zero_stage=3)`` written
    with torch alone: mesh (pipeline, data, tensor), hand TP plan, FSDP2 per block and per stage, pipelining."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    world = dist.get_world_size()
    pp, tp = pipeline_parallel_size, tensor_parallel_size
    dp = world // (pp * tp)
    mesh = init_device_mesh(bench_device().type, (pp, dp, tp), mesh_dim_names=("pipeline", "data", "tensor"))
    pp_rank, dp_rank = mesh["pipeline"].get_local_rank(), mesh["data"].get_local_rank()
    gpt = build_gpt(model)
    stages, num_stages, parts = _stage_parts(gpt, schedule, pp_rank, pp)
    del gpt
    for part in parts:
        hand_tensor_parallel(part, mesh["tensor"], blocks=list(part.h))
        for block in part.h:
            fully_shard(block, mesh=mesh["data"])
        # the stage is the FSDP2 root: PipelineStage accumulates over micro-batches and reduce-scatters once per step
        fully_shard(part, mesh=mesh["data"])
    params = [p for part in parts for p in part.parameters()]
    optimizer = adamw(params, model.get("learning_rate", 1e-3))
    pipe = _schedule(parts, stages, num_stages, schedule, microbatches, mesh["pipeline"].get_group())
    tokens = token_batches(model["vocab_size"], model["block_size"], global_batch, steps)
    first, last = 0 in stages, num_stages - 1 in stages
    per_replica = global_batch // dp

    def one_step(s: int) -> None:
        begin = s * global_batch + dp_rank * per_replica
        batch = tokens[begin : begin + per_replica].to(bench_device())
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        with loss_parallel(), bench_autocast():
            pipe.step(*((x,) if first else ()), **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed_steps(steps, one_step)


def deepspeed_engine(
    model: dict[str, Any], *, global_batch: int, steps: int, zero_stage: int
) -> list[tuple[float, float]]:
    """DeepSpeed's engine (``deepspeed.initialize``, ZeRO-1/2, fp32) on the example's LightningModule and optimizer
    (torch's AdamW as a client optimizer: DeepSpeed's CPU Adam would be another optimizer and needs a C++ build)."""
    import deepspeed

    from examples.nanogpt import NanoGPT

    torch.manual_seed(SEED)
    module = NanoGPT(**model)
    optimizer = module.configure_optimizers()
    world = dist.get_world_size()
    per_rank = global_batch // world
    config = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    tokens = token_batches(model["vocab_size"], model["block_size"], global_batch, steps)
    rank = dist.get_rank()

    def one_step(s: int) -> None:
        begin = s * global_batch + rank * per_rank
        batch = tokens[begin : begin + per_rank]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        logits = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        engine.backward(loss)
        engine.step()

    return _timed_steps(steps, one_step)
