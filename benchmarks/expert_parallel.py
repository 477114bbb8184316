"""Expert parallel, side by side at one world size: the same Mixtral trained with its experts replicated on every
data-parallel rank (``expert_parallel_size=1``) and split over 2 and 4 of them, ZeRO-1 in each; and the all-to-all
bytes of a step, counted by :class:`~lightning_hybrid.monitoring.CommunicationMeter`, against what the dispatch must
move for the tokens the router chose.

    python benchmarks/expert_parallel.py              # 4 CPU processes, ep 1 / 2 / 4, three rounds
    python benchmarks/expert_parallel.py --smoke --out-dir /tmp/x   # tiny sizes, one group (the test suite runs it)

Each contestant runs in its own ``torchrun`` group (so that each process's peak RSS is its own), the groups
alternating round by round (ep1, ep2, ep4, ep1, ...); ``--smoke`` runs every contestant in one group instead (the
peak RSS column then reads the group's). A step is timed from the end of one batch to the end of the next, after
``--warmup`` steps. Results go to ``benchmarks/results/expert_parallel.json`` and the "Expert parallel" section of
``docs/benchmarks.md`` (between its markers).

The bytes the meter counts are each all-to-all's whole buffer on this rank (its convention: nccl-tests' "size"), the
rows that stay on the rank included. Per MoE layer and micro-batch a rank that sends ``S`` (token, expert) pairs and
receives ``R`` moves, with hidden size ``H`` in ``b``-byte activations, ``E`` experts and 8-byte counts:

- forward: the pairs per expert (``8 E``: the one metadata exchange; each rank reads the rows it receives and their
  local expert from it), the rows (``S H b``), their routing weights (``S b``), and the outputs back (``R H b``);
- backward: the outputs' gradient (``S H b``), the rows' gradient (``R H b``) and the routing weights' (``R b``).

``S`` and ``R`` come from the router (the dispatch counts them); with uniform routing both are ``tokens x top_k``,
and ``(ep - 1) / ep`` of the rows leave the rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.page import write_section_between  # noqa: E402

SECTION_BEGIN = "<!-- expert_parallel: begin (written by benchmarks/expert_parallel.py) -->"
SECTION_END = "<!-- expert_parallel: end -->"
INDEX_BYTES = 8  # the counts are int64


def dispatch_bytes(sent: int, received: int, hidden: int, experts: int, activation_bytes: int = 4) -> int:
    """Bytes of one MoE layer's all-to-alls for one micro-batch, forward and backward, on a rank that sends ``sent``
    pairs and receives ``received`` (whole buffers, as the meter counts them), ``experts`` experts in the layer.

    Example:
        >>> dispatch_bytes(sent=64, received=64, hidden=32, experts=4)  # 8 E + 2 (S + R) H b + S b + R b
        33312
    """
    forward = INDEX_BYTES * experts + sent * hidden * activation_bytes + sent * activation_bytes
    forward += received * hidden * activation_bytes
    backward = sent * hidden * activation_bytes + received * hidden * activation_bytes + received * activation_bytes
    return forward + backward


class _Clock:
    """End-of-batch wall clock, and one measured step's communication and tokens per expert."""

    def __new__(cls, measured_step: int) -> Any:
        import lightning as L

        from lightning_hybrid.monitoring.comm import CommunicationMeter
        from lightning_hybrid.monitoring.experts import expert_shards_of

        class Clock(L.Callback):
            def __init__(self) -> None:
                self.ends: list[float] = []
                self.communication: dict[str, int] = {}
                self.tokens: dict[str, list[int]] = {}
                self._meter: Any = None

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                if idx == measured_step:
                    experts = expert_shards_of(trainer.strategy)
                    if experts is not None:
                        experts.load.counting = True
                    mesh = experts.mesh if experts is not None else None
                    self._meter = CommunicationMeter(trainer.strategy.device_mesh, expert_mesh=mesh).__enter__()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
                if self._meter is not None:
                    self._meter.__exit__(None, None, None)
                    self.communication = {f"{d}/{op}": s.bytes for (d, op), s in self._meter.totals().items()}
                    self._meter = None
                    experts = expert_shards_of(trainer.strategy)
                    if experts is not None:
                        experts.load.counting = False
                        self.tokens = experts.load.take()
                self.ends.append(time.perf_counter())

        return Clock()


def _fit(args: argparse.Namespace, ep: int) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from examples.hf_mixtral import HFMixtral
    from lightning_hybrid import HybridStrategy

    L.seed_everything(1234, verbose=False)
    module = HFMixtral(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    module.example_input_array = None
    clock = _Clock(measured_step=args.warmup)
    strategy = HybridStrategy(expert_parallel_size=ep, zero_stage=1, monitor=False, health_checks=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.warmup + args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    samples = (args.warmup + args.steps) * args.batch_size * args.devices
    tokens = torch.randint(0, args.vocab, (samples, args.seq + 1), generator=generator)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=args.batch_size))
    steps = [b - a for a, b in zip(clock.ends[args.warmup - 1 :], clock.ends[args.warmup :])] if args.warmup else []
    mine = {
        "ep": ep,
        "rank": trainer.global_rank,
        "median_step_s": statistics.median(steps[1:] or steps),  # the measured (metered) step left out when possible
        "model_state_bytes": dict(trainer.strategy.model_state_bytes),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "communication": clock.communication,
        "tokens": clock.tokens,
        "expert_group": _expert_group(trainer.strategy),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ep": ep, "ranks": everyone}


def _expert_group(strategy: Any) -> list[int]:
    import torch.distributed as dist

    from lightning_hybrid.monitoring.experts import expert_shards_of

    experts = expert_shards_of(strategy)
    if experts is None:
        return [dist.get_rank()]
    return dist.get_process_group_ranks(experts.mesh["expert"].get_group())


def theory(record: dict[str, Any], hidden: int, micro_batches: int = 1) -> list[int]:
    """Per rank: the all-to-all bytes the dispatch must move on the measured step, from the pairs each rank's router
    sent to each expert (``S`` its own pairs, ``R`` those of its expert-parallel peers for the experts it holds)."""
    ranks = record["ranks"]
    ep = record["ep"]
    out = []
    for me in ranks:
        group = me["expert_group"]
        position = group.index(me["rank"])
        total = 0
        for layer, counts in me["tokens"].items():
            per_rank = len(counts) // ep
            mine = slice(position * per_rank, (position + 1) * per_rank)
            sent = sum(counts)
            received = sum(sum(ranks[peer]["tokens"][layer][mine]) for peer in group)
            total += dispatch_bytes(sent, received, hidden, len(counts))
        out.append(total * micro_batches)
    return out


def _launch(args: argparse.Namespace, eps: list[int], argv: list[str] | None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "fit.json"
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--smoke"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.devices),
               __file__, *forwarded, *_sizes(args), "--worker-eps", ",".join(map(str, eps)),
               "--worker-output", str(output)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"the group for ep {eps} failed with exit code {proc.returncode}")
        return json.loads(output.read_text())


def _sizes(args: argparse.Namespace) -> list[str]:
    names = ("devices", "layers", "hidden", "ffn", "experts", "top_k", "vocab", "seq", "batch_size", "warmup", "steps")
    return [x for name in names for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per expert-parallel size: median step time over rounds (slowest rank), model state and peak RSS (largest
    rank), and the measured step's all-to-all bytes against theory (every rank)."""
    by_ep: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_ep.setdefault(record["ep"], []).append(record)
    rows = {}
    for ep, runs in sorted(by_ep.items()):
        step = statistics.median(max(r["median_step_s"] for r in run["ranks"]) for run in runs)
        first = runs[0]["ranks"]
        measured = [sum(v for k, v in r["communication"].items() if k == "expert/all_to_all_single") for r in first]
        expected = theory(runs[0], args.hidden) if ep > 1 else [0] * len(first)
        rows[ep] = {
            "step_s": step,
            "step_s_per_round": [max(r["median_step_s"] for r in run["ranks"]) for run in runs],
            "model_state_bytes": max(r["model_state_bytes"]["total"] for r in first),
            "parameters_bytes": max(r["model_state_bytes"]["parameters"] for r in first),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for run in runs for r in run["ranks"]),
            "a2a_bytes_measured": measured,
            "a2a_bytes_theory": expected,
            "a2a_bytes_uniform": _uniform(args, ep),
        }
    return {"config": {k: getattr(args, k) for k in ("devices", "layers", "hidden", "ffn", "experts", "top_k",
                                                      "vocab", "seq", "batch_size", "warmup", "steps", "rounds")},
            "smoke": args.smoke, "by_ep": rows}  # fmt: skip


def _uniform(args: argparse.Namespace, ep: int) -> int:
    """The bytes per rank if the router spread the pairs evenly: ``S = R = tokens x top_k``."""
    if ep == 1:
        return 0
    pairs = args.batch_size * args.seq * args.top_k
    return args.layers * dispatch_bytes(pairs, pairs, args.hidden, args.experts)


def section(results: dict[str, Any]) -> str:
    c, rows = results["config"], results["by_ep"]
    base = rows.get(1) or rows[min(rows)]
    lines = [
        SECTION_BEGIN,
        "## Expert parallel",
        "",
        f"`benchmarks/expert_parallel.py`: `examples.hf_mixtral.HFMixtral` ({c['layers']} layers, hidden {c['hidden']},"
        f" {c['experts']} experts of FFN {c['ffn']}, top-{c['top_k']}), {c['devices']} CPU processes (dp="
        f"{c['devices']}), ZeRO-1, fp32, micro-batch {c['batch_size']} x {c['seq']} tokens, AdamW; each"
        f" expert-parallel size in its own process group, {c['rounds']} rounds alternating; step time = the slowest"
        " rank's median step, median over rounds.",
        "",
        "| expert_parallel_size | step | vs replicated | model state per rank | parameters per rank | peak RSS |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ep, r in sorted(rows.items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"| {ep} | {r['step_s'] * 1e3:.0f} ms | {r['step_s'] / base['step_s']:.2f}x |"
            f" {_mib(r['model_state_bytes'])} ({r['model_state_bytes'] / base['model_state_bytes']:.2f}x) |"
            f" {_mib(r['parameters_bytes'])} | {_mib(r['peak_rss_bytes'])} |"
        )
    lines += [
        "",
        "All-to-all bytes of one step on each rank (the meter's whole buffers), against the dispatch's formula for the"
        " pairs the router chose that step, and for pairs spread evenly (module docstring of the script):",
        "",
        "| expert_parallel_size | measured per rank | formula (router's pairs) | measured / formula | even routing |",
        "| --- | --- | --- | --- | --- |",
    ]
    for ep, r in sorted(rows.items(), key=lambda kv: int(kv[0])):
        if int(ep) == 1:
            continue
        measured, expected = r["a2a_bytes_measured"], r["a2a_bytes_theory"]
        ratios = [m / e for m, e in zip(measured, expected)] if all(expected) else [float("nan")]
        lines.append(
            f"| {ep} | {', '.join(f'{m:,} B' for m in measured)} | {', '.join(f'{e:,} B' for e in expected)} |"
            f" {min(ratios):.4f}-{max(ratios):.4f} | {r['a2a_bytes_uniform']:,} B |"
        )
    rounds = "; ".join(f"ep{ep} " + ", ".join(f"{s:.3f}" for s in r["step_s_per_round"]) for ep, r in rows.items())
    lines += ["", f"Step time per round (s): {rounds}. Peak RSS: the largest rank's."]
    lines += [SECTION_END]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one group, into --out-dir")
    parser.add_argument("--out-dir", type=Path, default=None, help="results and the page go here")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--eps", default="1,2,4", help="expert-parallel sizes, comma separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--worker-eps", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_eps is not None:  # inside the torchrun group
        torch.set_num_threads(1)
        records = [_fit(args, int(ep)) for ep in args.worker_eps.split(",")]
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.worker_output).write_text(json.dumps(records))
        return 0
    if args.smoke:
        args.devices, args.layers, args.hidden, args.ffn, args.experts = 2, 2, 32, 64, 4
        args.vocab, args.seq, args.batch_size, args.warmup, args.steps, args.rounds = 128, 16, 2, 1, 2, 1
        args.eps = "1,2"
    eps = [int(e) for e in args.eps.split(",")]
    if args.smoke:
        records = _launch(args, eps, argv)
    else:
        records = [r for _ in range(args.rounds) for ep in eps for r in _launch(args, [ep], argv)]
    results = summarize(records, args)
    out_dir = args.out_dir or ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "expert_parallel.json").write_text(json.dumps(results, indent=1))
    page = (args.out_dir / "benchmarks.md") if args.out_dir else ROOT / "docs" / "benchmarks.md"
    write_section_between(page, SECTION_BEGIN, SECTION_END, section(results))
    print(section(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
