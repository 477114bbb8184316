"""On 2 real gloo processes: ``topology.reduce`` (what ``self.log(..., sync_dist=True)`` runs through the strategy)
against torch's own all-reduce (every op Lightning accepts, in place, integer means as Lightning's, a group of one left
untouched), and ``build_device_mesh`` reusing a layout's mesh in a later fit of the same process instead of making a
process group per dimension again (with their threads, which slowed the whole process fit after fit), and building a
new one once those groups were destroyed; ``subgroup`` reusing a group of the same ranks; and the point-to-point
observer (the hang watchdog's) told of each transfer a pipeline stage posts exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, store: str, results: dict) -> None:
    from lightning_hybrid.topology import reduce

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        value = float(rank + 1)  # 1 and 2
        out = {}
        for op in ("mean", "avg", "sum", "max", "min", None, dist.ReduceOp.SUM):
            t = torch.tensor([value])
            got = reduce(t, None, op)
            out[str(op)] = (got.item(), got.data_ptr() == t.data_ptr())
        t = torch.tensor([rank * 3 + 1])  # integers 1 and 4: Lightning's mean keeps the dtype, 5 // 2
        got = reduce(t, None, "mean")
        out["int-mean"] = (got.item(), got.dtype == torch.int64)
        singles = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group, in the same order
        t = torch.tensor([value])
        out["single"] = reduce(t, singles[rank], "sum").item()
        from lightning_hybrid.layout import ParallelLayout
        from lightning_hybrid.topology import build_device_mesh

        layout = ParallelLayout.resolve(world_size=2, tensor_parallel_size=2)
        first = build_device_mesh(layout, "cpu")
        out["reused"] = build_device_mesh(layout, "cpu") is first
        other = build_device_mesh(ParallelLayout.resolve(world_size=2), "cpu")  # data parallel: another layout
        out["other layout"] = other is not first and other.size(1) == 2
        for name in ("pipeline", "data", "tensor"):  # what a script (or the test launcher) may do between fits
            dist.destroy_process_group(first.get_group(name))
        rebuilt = build_device_mesh(layout, "cpu")
        t = torch.ones(1)
        dist.all_reduce(t, group=rebuilt.get_group("tensor"))
        out["rebuilt"] = (rebuilt is not first, t.item())
        out["observed"] = _observed_transfers(rank)
        from lightning_hybrid.process_groups import subgroup

        pair = subgroup([0, 1])  # what a later fit asks for again (tied-weight holders): the same group, no new one
        t = torch.ones(1)
        dist.all_reduce(t, group=subgroup([0, 1]))
        out["subgroup"] = (subgroup([0, 1]) is pair, subgroup([0]) is not pair, t.item())
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _observed_transfers(rank: int) -> list[tuple[str, str, int]]:
    """What a point-to-point observer (the hang watchdog's) is told of the transfers a pipeline stage posts, as
    torch's schedules ask a stage for them: each once, with its direction and peer, over when the action reading it
    starts (a receive) or the step ends (a send), or failed when the step raised."""
    from lightning_hybrid.transfers import P2PObserver, PendingTransfers, observe_p2p_waits

    seen: list[tuple[str, str, int]] = []

    class Counting(P2PObserver):
        def p2p_wait_begin(self, op: str, group: object, peer: int) -> int:
            seen.append(("begin", op, peer))
            return len(seen)

        def p2p_wait_end(self, token: object, failed: bool) -> None:
            seen.append(("end", "failed" if failed else "ok", -1))

    observer = Counting()
    observe_p2p_waits(observer)
    pending = PendingTransfers()
    try:
        t = torch.full((4,), float(rank))
        first = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)
        pending.posted(None if rank == 0 else ("F", 1, 0), [first])
        for work in dist.batch_isend_irecv([first]):
            work.wait()
        pending.action_starts(("F", 1, 0))  # stage 1's forward of micro-batch 0 reads what came
        pending.clear()  # the step's end: its sends were waited for
        then = dist.P2POp(dist.irecv if rank == 0 else dist.isend, t, 1 - rank)
        pending.posted(("B", 0, 0) if rank == 0 else None, [then])
        for work in dist.batch_isend_irecv([then]):
            work.wait()
        pending.clear(failed=True)  # the step raised before stage 0's backward read it
    finally:
        observe_p2p_waits(observer, active=False)
    return seen


@pytest.mark.timeout(120)
def test_reduce_and_mesh_reuse_on_two_processes(tmp_path: Path) -> None:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    for rank in (0, 1):
        out = results[rank]
        assert out["subgroup"] == (True, True, 2.0), out["subgroup"]
        first, then = ("send", "recv") if rank == 0 else ("recv", "send")
        peer = 1 - rank
        assert out["observed"] == [
            ("begin", first, peer), ("end", "ok", -1), ("begin", then, peer), ("end", "failed", -1)
        ], out["observed"]  # fmt: skip
        assert out["mean"] == (1.5, True) and out["avg"] == (1.5, True), out
        assert out["sum"] == (3.0, True) and out["None"] == (3.0, True) and out[str(dist.ReduceOp.SUM)] == (3.0, True)
        assert out["max"] == (2.0, True) and out["min"] == (1.0, True), out
        assert out["int-mean"] == (2, True), out
        assert out["single"] == float(rank + 1), out  # a group of one: the value itself, no collective
        assert out["reused"] and out["other layout"] and out["rebuilt"] == (True, 2.0), out
