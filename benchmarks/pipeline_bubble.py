"""Measure the pipeline bubble of GPipe, 1F1B and interleaved 1F1B and compare it with theory.

Launches 4 CPU processes (``torch.distributed.run``, gloo, one thread each) that train the nanoGPT example with
``HybridStrategy(pipeline_parallel_size=4, num_microbatches=8)`` and balanced stages (8 blocks, uniform partition:
2 blocks per stage, 1 per virtual stage when interleaved). After a few warm-up steps, a callback reads
``trainer.strategy.pipeline_timeline`` at the end of every step. Per schedule and rank the median over the measured
steps of the timeline's ``bubble_fraction`` (``1 - time in forward/backward actions / the rank's step time``) is
compared with ``theoretical_bubble(p, m, v)``, together with what explains the difference (``_analysis``,
``_replay``, ``_hop_latencies``).

A control run with 2 processes (one per core on a 2-core machine) follows, at the same number of micro-batches.

Writes ``benchmarks/results/pipeline_bubble.json``, the Chrome trace and PNG timeline of one representative step per
schedule (``docs/figures/pipeline_<schedule>_p4_m8.{json,png}``) and the "Pipeline bubble" section of
``docs/benchmarks.md``.

Usage (from the repository root):
    python benchmarks/pipeline_bubble.py            # the real run: about 4 minutes on a 2-core machine
    python benchmarks/pipeline_bubble.py --smoke    # tiny model, 1 warm-up + 1 measured step, into a temp dir
    python benchmarks/pipeline_bubble.py --priority -15   # Linux, as root, on a machine shared with other jobs
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.page import write_section_between  # noqa: E402

PIPELINE = 4
CONTROL_PIPELINE = 2
MICROBATCHES = 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]  # (name, virtual_pipeline_size)
FIGURES = ("1f1b", "interleaved_1f1b")  # schedules whose picture the docs show (all are written)
# 8 blocks of width 256 on 64 tokens x 4 sequences: one stage's forward + backward of one micro-batch (2 blocks) takes
# ~45 ms on one core of the 2-core test machine, against ~1 ms of Python work per action in the schedule
REAL = {
    "model": {"vocab_size": 128, "block_size": 64, "n_layer": 8, "n_head": 4, "n_embd": 256, "bias": True},
    "microbatch_size": 4,
    "warmup_steps": 2,
    "measured_steps": 10,
}
SMOKE = {
    "model": {"vocab_size": 64, "block_size": 8, "n_layer": 8, "n_head": 2, "n_embd": 16, "bias": True},
    "microbatch_size": 1,
    "warmup_steps": 1,
    "measured_steps": 1,
}
SECTION_BEGIN = "<!-- pipeline_bubble: begin (written by benchmarks/pipeline_bubble.py) -->"
SECTION_END = "<!-- pipeline_bubble: end -->"


# -------------------------------------------------------------------------------------------------------------- worker
def _worker(config_path: Path) -> None:
    """One process of the launched group: train each schedule in turn and record every rank's step timelines."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from examples.nanogpt import NanoGPT
    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.pipeline.timeline import gather_timelines

    config = json.loads(config_path.read_text())
    if config.get("priority") is not None:
        _set_autogroup_nice(config["priority"])
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    model_kwargs = config["model"]
    seq, batch = model_kwargs["block_size"], config["microbatch_size"] * MICROBATCHES
    steps = config["warmup_steps"] + config["measured_steps"]

    class Probe(L.Callback):
        """Every step: this rank's wall and CPU time of the whole training step; every rank's pipeline timeline and
        schedule start (gathered on every rank: the gathers are collectives)."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            wall, cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu
            everyone = gather_timelines(trainer.strategy.pipeline_timeline)
            # the timeline's times are relative to the rank's own schedule start; perf_counter is one clock for all
            # processes of a machine, so the runner's start time puts the ranks on one time axis
            runner = getattr(trainer.strategy, "_pipeline", None)
            extra: list[Any] = [None] * world
            dist.all_gather_object(extra, (getattr(runner, "_clock", None), wall, cpu))
            self.steps.append(
                {
                    "timelines": everyone,
                    "starts": [e[0] for e in extra],
                    "batch_wall": [e[1] for e in extra],
                    "batch_cpu": [e[2] for e in extra],
                }
            )

    results: dict[str, Any] = {}
    for name, virtual in config["schedules"]:
        L.seed_everything(1234, verbose=False)
        module = NanoGPT(**model_kwargs)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model_kwargs["vocab_size"], (batch * steps, seq + 1), generator=generator)
        data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        strategy = HybridStrategy(
            pipeline_parallel_size=world,
            num_microbatches=MICROBATCHES,
            pipeline_schedule=name,
            virtual_pipeline_size=virtual,
            pipeline_partition="uniform",
            zero_stage=0,
        )
        probe = Probe()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            callbacks=[probe],
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        begin = time.perf_counter()
        trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch, drop_last=True))
        results[name] = {"virtual": virtual, "steps": probe.steps, "fit_seconds": time.perf_counter() - begin}
        dist.barrier()
    # the process group exists once the strategy has set up (it stays for the next fit)
    results["blocked_receive_cpu_per_second"] = _blocked_receive_cpu(dist)
    if dist.get_rank() == 0:
        Path(config["raw"]).write_bytes(pickle.dumps(results))


def _blocked_receive_cpu(dist: Any, seconds: float = 1.0) -> Optional[float]:
    """CPU seconds per second that rank 1 uses while blocked in a receive that rank 0 answers ``seconds`` later
    (all ranks call this; ranks other than 0 and 1 only wait at the barrier)."""
    import torch

    buffer, cpu = torch.zeros(1024), None
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(seconds)
        dist.send(buffer, 1)
    elif dist.get_rank() == 1:
        wall, start = time.perf_counter(), time.process_time()
        dist.recv(buffer, 0)
        cpu = (time.process_time() - start) / (time.perf_counter() - wall)
    values: list[Optional[float]] = [None] * dist.get_world_size()
    dist.all_gather_object(values, cpu)
    return values[1]


# -------------------------------------------------------------------------------------------------------------- launch
def _launch(world: int, base: dict[str, Any], timeout: float, priority: Optional[int]) -> Optional[dict[str, Any]]:
    """Run the worker in ``world`` processes; every schedule's raw per-step records, or None on failure."""
    with tempfile.TemporaryDirectory(prefix="pipeline_bubble_") as work:
        config = {**base, "schedules": SCHEDULES, "raw": str(Path(work) / "raw.pkl"), "priority": priority}
        config_path = Path(work) / "config.json"
        config_path.write_text(json.dumps(config))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               str(Path(__file__).resolve()), "--worker", str(config_path)]  # fmt: skip
        print(f"launching {world} processes: {', '.join(n for n, _ in SCHEDULES)} ...", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            print(f"TIMEOUT after {timeout:.0f}s (a hang?)\n{out[-4000:]}", file=sys.stderr)
            return None
        if proc.returncode != 0 or not Path(config["raw"]).exists():
            print((proc.stdout + proc.stderr)[-8000:], file=sys.stderr)
            return None
        return pickle.loads(Path(config["raw"]).read_bytes())


# ------------------------------------------------------------------------------------------------------------ analysis
def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _makespan(step: dict[str, Any]) -> Optional[float]:
    """Seconds from the first rank's schedule start to the last rank's schedule end, on the common clock."""
    starts = step["starts"]
    if any(s is None for s in starts):
        return None
    return max(s + t.step_time for s, t in zip(starts, step["timelines"], strict=True)) - min(starts)


def _replay(timelines: list[Any], cores: Optional[int] = None) -> dict[str, list[float]]:
    """Replay one step's schedule in a model: each rank runs the actions it really ran, in the same order, forward
    1 and backward ``median B / median F`` time units at full speed, messages free and instant. ``cores=None``: one
    core per rank; otherwise the computing ranks share ``cores`` equally (processor sharing). Returns per rank the
    idle share relative to its own step (what ``bubble_fraction`` measures) and to the whole pipeline step."""
    orders = [[(k, s, mb) for k, s, mb, _, _ in sorted(t.events, key=lambda e: e[3])] for t in timelines]
    forward = [e - b for t in timelines for k, _, _, b, e in t.events if k == "F"]
    backward = [e - b for t in timelines for k, _, _, b, e in t.events if k == "B"]
    if not forward or len(backward) != len(forward):
        return {}  # zero-bubble schedules (I/W actions) are not modelled
    cost = {"F": 1.0, "B": _median(backward) / _median(forward)}
    last = max(s for order in orders for _, s, _ in order)
    n = len(orders)
    pos, remaining = [0] * n, [None] * n  # type: list[int], list[Optional[float]]
    done: set[tuple[str, int, int]] = set()
    busy, end, now, dt = [0.0] * n, [0.0] * n, 0.0, 2e-3
    while any(pos[r] < len(orders[r]) for r in range(n)):
        active = []
        for r in range(n):
            if pos[r] >= len(orders[r]):
                continue
            kind, stage, mb = orders[r][pos[r]]
            if remaining[r] is None:
                if kind == "F":
                    dep = ("F", stage - 1, mb) if stage > 0 else None
                else:
                    dep = ("B", stage + 1, mb) if stage < last else ("F", stage, mb)
                if dep is None or dep in done:
                    remaining[r] = cost[kind]
            if remaining[r] is not None:
                active.append(r)
        if not active:
            return {}
        speed = 1.0 if cores is None else min(1.0, cores / len(active))
        for r in active:
            remaining[r] -= speed * dt  # type: ignore[operator]
            busy[r] += dt
            if remaining[r] <= 1e-9:  # type: ignore[operator]
                done.add(orders[r][pos[r]])
                pos[r], remaining[r] = pos[r] + 1, None
                end[r] = now + dt
        now += dt
    return {"own": [1 - b / e for b, e in zip(busy, end, strict=True)], "whole": [1 - b / now for b in busy]}


def _hop_latencies(timelines: list[Any], starts: list[Optional[float]]) -> list[float]:
    """Seconds from the end of the action producing a micro-batch's activation (or gradient) on one rank to the start
    of the action consuming it on the next, when the consumer was already waiting for it: send, receive and wake-up."""
    if any(s is None for s in starts):
        return []
    first = min(starts)  # type: ignore[type-var]
    at: dict[tuple[str, int, int], tuple[float, float]] = {}
    per_rank = []
    for t, s in zip(timelines, starts, strict=True):
        shift = s - first  # type: ignore[operator]
        actions = sorted((b + shift, e + shift, k, st, mb) for k, st, mb, b, e in t.events)
        per_rank.append(actions)
        for b, e, k, st, mb in actions:
            at[(k, st, mb)] = (b, e)
    last = max(st for _, st, _ in at)
    out = []
    for actions in per_rank:
        for i, (b, _, k, st, mb) in enumerate(actions):
            dep = ("F", st - 1, mb) if k == "F" and st > 0 else ("B", st + 1, mb) if k == "B" and st < last else None
            if dep is None or dep not in at:
                continue
            previous_end = actions[i - 1][1] if i else 0.0
            if at[dep][1] >= previous_end:  # the rank was idle, waiting for this message
                out.append(b - at[dep][1])
    return out


def _summarise(raw: dict[str, Any], base: dict[str, Any], world: int, cores: int) -> dict[str, Any]:
    from lightning_hybrid.pipeline.timeline import theoretical_bubble

    virtual = raw["virtual"]
    measured = raw["steps"][base["warmup_steps"] :]
    theory = theoretical_bubble(world, MICROBATCHES, virtual)
    per_rank = []
    for r in range(world):
        timelines = [s["timelines"][r] for s in measured]
        bubbles = [t.bubble_fraction for t in timelines]
        forward = [e - b for t in timelines for k, _, _, b, e in t.events if k == "F"]
        backward = [e - b for t in timelines for k, _, _, b, e in t.events if k in ("B", "I", "W")]
        spans = [_makespan(s) for s in measured]
        whole = [1 - t.compute_time / m for t, m in zip(timelines, spans, strict=True) if m]
        per_rank.append(
            {
                "rank": timelines[0].rank,
                "median_bubble": _median(bubbles),
                "min_bubble": min(bubbles),
                "max_bubble": max(bubbles),
                "bubbles": bubbles,
                "median_whole_step_bubble": _median(whole) if whole else None,
                "median_step_ms": _median([t.step_time for t in timelines]) * 1e3,
                "median_forward_ms": _median(forward) * 1e3 if forward else None,
                "median_backward_ms": _median(backward) * 1e3 if backward else None,
                "actions_per_step": len(timelines[0].events),
            }
        )
    step_means = [statistics.fmean(t.bubble_fraction for t in s["timelines"]) for s in measured]
    representative = min(range(len(measured)), key=lambda i: abs(step_means[i] - _median(step_means)))
    rep = measured[representative]
    ideal = _replay(rep["timelines"])
    shared = _replay(rep["timelines"], cores) if cores < world else {}
    hops = [h for s in measured for h in _hop_latencies(s["timelines"], s["starts"])]
    # CPU seconds the ranks used per wall second of the training step, per core: ~1 means the ranks saturate the cores
    saturation = [sum(s["batch_cpu"]) / (max(s["batch_wall"]) * cores) for s in measured]
    wholes = [r["median_whole_step_bubble"] for r in per_rank if r["median_whole_step_bubble"] is not None]
    overall = _median([r["median_bubble"] for r in per_rank])
    return {
        "virtual_pipeline_size": virtual,
        "theory": theory,
        "median_bubble": overall,
        "difference_pp": (overall - theory) * 100,
        "median_whole_step_bubble": _median(wholes) if wholes else None,
        "per_rank": per_rank,
        "representative_step": base["warmup_steps"] + representative,
        "model_one_core_per_rank": ideal,
        "model_shared_cores": shared,
        "median_hop_latency_ms": _median(hops) * 1e3 if hops else None,
        "p90_hop_latency_ms": sorted(hops)[int(0.9 * (len(hops) - 1))] * 1e3 if hops else None,
        "median_cpu_saturation": _median(saturation),
        "median_start_skew_ms": _median([(max(s["starts"]) - min(s["starts"])) * 1e3 for s in measured])
        if all(x is not None for s in measured for x in s["starts"])
        else None,
        "fit_seconds": raw["fit_seconds"],
    }


def _aligned(step: dict[str, Any]) -> list[Any]:
    """The step's timelines on one time axis, for the pictures: each rank's events shifted by how much later its
    schedule started than the earliest rank's. The bubble shown stays the rank's own."""
    from dataclasses import dataclass

    from lightning_hybrid.pipeline.runner import StepTimeline

    @dataclass
    class Shifted(StepTimeline):
        own_bubble: float = 0.0

        @property
        def bubble_fraction(self) -> float:
            return self.own_bubble

    starts = step["starts"]
    if any(s is None for s in starts):
        return step["timelines"]
    first = min(starts)
    out = []
    for t, s in zip(step["timelines"], starts, strict=True):
        shift = s - first
        events = [(k, st, mb, b + shift, e + shift) for k, st, mb, b, e in t.events]
        out.append(Shifted(rank=t.rank, step_time=t.step_time + shift, events=events, own_bubble=t.bubble_fraction))
    return out


# ------------------------------------------------------------------------------------------------------------- machine
def _machine() -> dict[str, Any]:
    import lightning
    import torch

    import lightning_hybrid

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "os": platform.system(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_hybrid": lightning_hybrid.__version__,
        "backend": "gloo",
        "threads_per_process": 1,
    }


def _set_autogroup_nice(value: int) -> None:
    """Give this process's scheduling group the nice ``value`` (Linux autogroup scheduling; negative needs root).

    torch.distributed.run starts every worker in a session of its own, and with autogroup scheduling (the default on
    many Linux systems) CPU time is shared between sessions first, so each rank competes with every other job's
    process as an equal and plain ``nice`` has no effect across sessions."""
    try:
        Path("/proc/self/autogroup").write_text(str(value))
    except OSError as error:
        print(f"could not set the scheduling priority ({error}); measuring without it", file=sys.stderr)


def _machine_busy_seconds() -> Optional[float]:
    """CPU seconds all processes of the machine have used since boot (Linux), to detect other load during a run."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _OtherLoad:
    """CPU time that processes other than ours used while a group ran (other jobs on the machine skew timings)."""

    def __enter__(self) -> _OtherLoad:
        self.busy, self.ours, self.wall = _machine_busy_seconds(), _children_cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        busy, ours, wall = _machine_busy_seconds(), _children_cpu_seconds(), time.perf_counter()
        self.share: Optional[float] = None
        if self.busy is not None and busy is not None:
            others = max(0.0, (busy - self.busy) - (ours - self.ours))
            self.share = others / ((wall - self.wall) * (os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------------------------- docs
def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _range(r: dict[str, Any]) -> str:
    return f"{_pct(r['median_bubble'])} ({_pct(r['min_bubble'])}-{_pct(r['max_bubble'])})"


def _section(results: dict[str, Any], figures: dict[str, str]) -> str:
    """The "Pipeline bubble" section of docs/benchmarks.md (self-contained: machine, layout, tables, pictures)."""
    m, model, lay = results["machine"], results["model"], results["layout"]
    main, control = results["schedules"], results.get("control") or {}
    p = lay["pipeline_parallel_size"]
    lines = [
        SECTION_BEGIN,
        "## Pipeline bubble",
        "",
        "The idle share of a training step on each pipeline rank, measured from the per-action timings of",
        "`HybridStrategy.pipeline_timeline`: `bubble_fraction = 1 - (time in forward/backward actions) / (the rank's",
        "step time)`, against the theory `(p-1)/(v·m+p-1)` (`lightning_hybrid.pipeline.timeline.theoretical_bubble`).",
        f"Produced by `{results['command']}` in {results['wall_seconds']:.0f} s; every number below is in"
        " `benchmarks/results/pipeline_bubble.json`.",
        "",
        f"- **Machine**: {m['cores']}-core CPU ({m['cpu']}), {m['os']}; Python {m['python']}, torch {m['torch']},"
        f" Lightning {m['lightning']}, lightning-hybrid {m['lightning_hybrid']}; gloo, 1 thread per process."
        + (
            " Other jobs shared the machine, so the ranks ran at raised scheduling priority (`--priority"
            f" {m['worker_autogroup_nice']}`: autogroup nice {m['worker_autogroup_nice']})."
            if (m.get("worker_autogroup_nice") or 0) < 0
            else ""
        )
        + f" Other processes used {_pct(results['other_load'].get(str(p)))} of the machine's CPU time during the"
        f" main run and {_pct(results['other_load'].get(str(CONTROL_PIPELINE)))} during the control run.",
        f"- **Model**: `examples.nanogpt.NanoGPT`, {model['n_layer']} blocks, width {model['n_embd']},"
        f" {model['n_head']} heads, sequence {model['block_size']}, vocabulary {model['vocab_size']}, fp32.",
        f"- **Layout**: {p} processes, pipeline {p} x data 1 x tensor 1, `num_microbatches={lay['num_microbatches']}`,"
        f" micro-batch {lay['microbatch_size']} sequences (batch {lay['batch_size']}), uniform partition"
        f" ({lay['blocks_per_rank']} blocks per rank; interleaved: 2 stages of {lay['blocks_per_rank'] // 2} per rank),"
        " ZeRO 0.",
        f"- **Steps**: {results['warmup_steps']} warm-up, then {results['measured_steps']} measured. A cell is the"
        " median over the measured steps, with the min-max in brackets.",
        "",
        f"| schedule | v | {' | '.join(f'rank {r}' for r in range(p))} | median of ranks | theory | difference |",
        f"| --- | --- | {' | '.join('---' for _ in range(p))} | --- | --- | --- |",
    ]
    for name, s in main.items():
        lines.append(
            f"| {name} | {s['virtual_pipeline_size']} | {' | '.join(_range(r) for r in s['per_rank'])} |"
            f" {_pct(s['median_bubble'])} | {_pct(s['theory'])} | {s['difference_pp']:+.1f} pp |"
        )
    if control:
        cp = CONTROL_PIPELINE
        lines += [
            "",
            f"**Control: {cp} processes, one per core** (same model, {model['n_layer'] // cp} blocks per rank, same"
            " `m`):",
            "",
            f"| schedule | v | {' | '.join(f'rank {r}' for r in range(cp))} | median of ranks | theory | difference |",
            f"| --- | --- | {' | '.join('---' for _ in range(cp))} | --- | --- | --- |",
        ]
        for name, s in control.items():
            lines.append(
                f"| {name} | {s['virtual_pipeline_size']} | {' | '.join(_range(r) for r in s['per_rank'])} |"
                f" {_pct(s['median_bubble'])} | {_pct(s['theory'])} | {s['difference_pp']:+.1f} pp |"
            )
    lines += [
        "",
        "**What explains the difference** (main run, medians over ranks and measured steps; the models replay the"
        " representative step's real action order with free communication):",
        "",
        "| schedule | forward / backward (ms) | idle share of the whole pipeline step | model, 1 core per rank:"
        " own step (whole step) | model, ranks sharing the cores | send-to-start latency median / p90 (ms) |"
        " ranks' share of the machine's CPU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in main.items():
        ranks = s["per_rank"]
        fwd = _median([r["median_forward_ms"] for r in ranks])
        bwd = _median([r["median_backward_ms"] for r in ranks])
        ideal, shared = s["model_one_core_per_rank"], s["model_shared_cores"]
        ideal_txt = f"{_pct(_median(ideal['own']))} ({_pct(_median(ideal['whole']))})" if ideal else "-"
        shared_txt = _pct(_median(shared["own"])) if shared else "-"
        hop = (
            f"{s['median_hop_latency_ms']:.1f} / {s['p90_hop_latency_ms']:.1f}"
            if s["median_hop_latency_ms"] is not None
            else "-"
        )
        lines.append(
            f"| {name} | {fwd:.1f} / {bwd:.1f} | {_pct(s['median_whole_step_bubble'])} | {ideal_txt} | {shared_txt} |"
            f" {hop} | {_pct(s['median_cpu_saturation'])} |"
        )
    lines += ["", results["analysis"], ""]
    for name, figure in figures.items():
        lines += [f"![{name} timeline, p={p}, m={MICROBATCHES}](figures/{figure})", ""]
    lines += [SECTION_END]
    return "\n".join(lines) + "\n"


def _analysis(results: dict[str, Any]) -> str:
    """How far the measurement is from theory and why, in words, from this run's numbers."""
    main, control = results["schedules"], results.get("control") or {}
    cores = results["machine"]["cores"] or 0
    p = results["layout"]["pipeline_parallel_size"]
    out = []
    one = main.get("1f1b")
    if one:
        d = one["difference_pp"]
        out.append(
            f"**Reading the numbers.** For 1F1B at p={p}, m={MICROBATCHES} the median over ranks is"
            f" {_pct(one['median_bubble'])} against {_pct(one['theory'])} in theory ({d:+.1f} percentage points,"
            f" {'within' if abs(d) <= 10 else 'outside'} the 10-point target)."
        )
    out.append(
        "Even on an ideal machine only the first rank's `bubble_fraction` equals the formula: it divides by the rank's"
        " own step, and the later stages finish their last backward earlier, so their idle time at the end of the"
        " step is not counted (the replay with one core per rank gives the own-step medians in the table; over the"
        " whole pipeline step it gives the formula). The formula also assumes free communication; here each"
        " hand-over between stages costs the send-to-start latency in the table."
    )
    blocked = results.get("blocked_receive_cpu_per_second")
    if cores and cores < p:
        others = results["other_load"].get(str(p))
        out.append(
            f"The main cause of the difference is the machine: the {p} ranks share {cores} cores."
            + (
                f" A waiting rank sleeps in gloo's receive (a rank blocked in a receive used {blocked * 1e3:.0f} ms of"
                " CPU per second)."
                if blocked is not None
                else ""
            )
            + " But when more ranks compute than there are cores, the operating system runs some of them later or in"
            " slices, and every rank waiting for one of those idles meanwhile; a forward or backward that loses its"
            " core for a time slice shows up in the pictures as an action several times its usual length. Fair"
            " sharing at a fine grain would lower the idle share (the replay with ranks sharing the cores), the"
            " operating system's coarser slices raise it."
            + (
                f" During the 1F1B steps the ranks kept the cores {_pct(one['median_cpu_saturation'])} busy: the step"
                " time is bound by the CPU time all ranks need, not by the schedule."
                if one
                else ""
            )
            + (
                f" Other jobs used {_pct(others)} of the machine's CPU time over the whole run (start-up included),"
                " mostly while the ranks did not need it."
                if others is not None
                else ""
            )
        )
    if control:
        c = control.get("1f1b")
        if c:
            out.append(
                f"With one core per rank (the control run, p={CONTROL_PIPELINE}) the same code measures 1F1B at"
                f" {_pct(c['median_bubble'])} against {_pct(c['theory'])} ({c['difference_pp']:+.1f} points): the"
                " schedule and the measurement behave as the formula says when each rank has its core."
            )
    inter = main.get("interleaved_1f1b")
    if inter:
        out.append(
            "The interleaved schedule is furthest from its formula: its actions are half as long (one block instead"
            f" of two) while each of its {p * inter['virtual_pipeline_size'] - 1} stage hand-overs (instead of"
            f" {p - 1}) costs the same latency and Python work, and with a smaller bubble more ranks compute at once,"
            " so it suffers most from the shared cores."
        )
    return " ".join(out)


def _write_section(path: Path, section: str) -> None:
    write_section_between(path, SECTION_BEGIN, SECTION_END, section)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


# ---------------------------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 warm-up + 1 measured step, temp dir")
    parser.add_argument("--out-dir", type=Path, default=None, help="where results and figures go (smoke: a temp dir)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a launched group is killed")
    parser.add_argument("--no-control", action="store_true", help="skip the 2-process control run")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="Linux: run the workers at this autogroup nice value (e.g. -15, needs root), so that other jobs on a"
        " shared machine disturb the timings less; recorded in the results",
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker)
        return 0
    begin = time.perf_counter()

    base = SMOKE if args.smoke else REAL
    if args.out_dir is not None:
        results_dir = figures_dir = args.out_dir
    elif args.smoke:
        results_dir = figures_dir = Path(tempfile.mkdtemp(prefix="pipeline_bubble_smoke_"))
    else:
        results_dir, figures_dir = ROOT / "benchmarks" / "results", ROOT / "docs" / "figures"
    results_dir.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (240.0 if args.smoke else 600.0)
    machine = {**_machine(), "worker_autogroup_nice": args.priority}
    cores = machine["cores"] or PIPELINE
    worlds = [PIPELINE] if args.smoke or args.no_control else [PIPELINE, CONTROL_PIPELINE]
    raw: dict[int, dict[str, Any]] = {}
    other_load: dict[str, Optional[float]] = {}
    for world in worlds:
        with _OtherLoad() as load:
            got = _launch(world, base, timeout, args.priority)
        if got is None:
            return 1
        raw[world], other_load[str(world)] = got, load.share

    from lightning_hybrid.pipeline.timeline import render_timeline, to_chrome_trace

    results: dict[str, Any] = {
        "benchmark": "pipeline_bubble",
        "smoke": args.smoke,
        "machine": machine,
        "other_load": other_load,
        "model": base["model"],
        "layout": {
            "pipeline_parallel_size": PIPELINE,
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "zero_stage": 0,
            "num_microbatches": MICROBATCHES,
            "microbatch_size": base["microbatch_size"],
            "batch_size": base["microbatch_size"] * MICROBATCHES,
            "blocks_per_rank": base["model"]["n_layer"] // PIPELINE,
            "partition": "uniform",
        },
        "warmup_steps": base["warmup_steps"],
        "measured_steps": base["measured_steps"],
        "schedules": {},
        "blocked_receive_cpu_per_second": raw[PIPELINE].pop("blocked_receive_cpu_per_second", None),
    }
    if CONTROL_PIPELINE in raw:
        raw[CONTROL_PIPELINE].pop("blocked_receive_cpu_per_second", None)
    figures: dict[str, str] = {}
    for name, virtual in SCHEDULES:
        summary = _summarise(raw[PIPELINE][name], base, PIPELINE, cores)
        step = raw[PIPELINE][name]["steps"][summary["representative_step"]]
        stem = f"pipeline_{name}_p{PIPELINE}_m{MICROBATCHES}"
        trace_path, png_path = figures_dir / f"{stem}.json", figures_dir / f"{stem}.png"
        timelines = _aligned(step)
        to_chrome_trace(timelines, trace_path)
        title = (
            f"{name} (p={PIPELINE}, m={MICROBATCHES}{f', v={virtual}' if virtual > 1 else ''}), step"
            f" {summary['representative_step']}: theory {_pct(summary['theory'])}, {cores}-core CPU"
        )
        render_timeline(timelines, png_path, title=title)
        summary["trace"], summary["figure"] = _relative(trace_path), _relative(png_path)
        if name in FIGURES:
            figures[name] = png_path.name
        results["schedules"][name] = summary
    if CONTROL_PIPELINE in raw:
        results["control"] = {
            name: _summarise(raw[CONTROL_PIPELINE][name], base, CONTROL_PIPELINE, cores) for name, _ in SCHEDULES
        }
        results["control_layout"] = {
            "pipeline_parallel_size": CONTROL_PIPELINE,
            "blocks_per_rank": base["model"]["n_layer"] // CONTROL_PIPELINE,
        }
    results["wall_seconds"] = time.perf_counter() - begin
    results["command"] = "python benchmarks/pipeline_bubble.py" + (
        f" --priority {args.priority}" if args.priority is not None else ""
    )
    results["analysis"] = _analysis(results)
    (results_dir / "pipeline_bubble.json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.smoke and args.out_dir is None:
        _write_section(ROOT / "docs" / "benchmarks.md", _section(results, figures))

    runs = (("", results["schedules"], PIPELINE), ("control ", results.get("control") or {}, CONTROL_PIPELINE))
    for label, table, world in runs:
        if not table:
            continue
        ranks = "  ".join(f"rank {r:<4}" for r in range(world))
        print(f"{label}p={world}: {'schedule':<17} {ranks}  theory   diff")
        for name, s in table.items():
            cells = "  ".join(f"{_pct(r['median_bubble']):>9}" for r in s["per_rank"])
            print(f"{'':>{len(label) + 5}}{name:<17} {cells}  {_pct(s['theory']):>6}  {s['difference_pp']:+.1f}pp")
    print(f"other processes' share of the CPU: {other_load}")
    print(f"results: {results_dir / 'pipeline_bubble.json'}  ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
