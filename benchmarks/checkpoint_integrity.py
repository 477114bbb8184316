"""What the integrity hashes cost: one rank's shard saved with and without hashing, and a load's check of it.

    python benchmarks/checkpoint_integrity.py               # 26 MB: one rank's part of a 3.2M-parameter nanoGPT
    python benchmarks/checkpoint_integrity.py --megabytes 512

One process, no process group: the writer HybridStrategy uses, saving 24 float32 tensors; the saves with and
without hashing alternate (median of ``--repeats`` each). Reported: both save times, their difference, the full check
a load runs (sizes and SHA-256) and the check with ``verify=False`` (sizes only).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import lightning_hybrid.checkpoint.io as checkpoint_io  # noqa: E402
from lightning_hybrid.checkpoint import ShardedCheckpointWriter, checked_files  # noqa: E402
from lightning_hybrid.checkpoint.integrity import HashedWriteResults  # noqa: E402


def _unhashed(results: list, directory: Path) -> HashedWriteResults:
    out = HashedWriteResults(results)
    out.digests = {r.storage_data.relative_path: [0, ""] for r in results}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=26.0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    torch.manual_seed(0)
    numel = int(args.megabytes * 2**20 / 4) // 24
    state = {f"block{i}.weight": torch.randn(numel) for i in range(24)}
    hashed, digest = checkpoint_io.hashed, checkpoint_io.file_digest
    root = Path(tempfile.mkdtemp())
    try:

        def save(with_hashes: bool) -> float:
            checkpoint_io.hashed = hashed if with_hashes else _unhashed
            checkpoint_io.file_digest = digest if with_hashes else (lambda path: (0, ""))
            start = time.perf_counter()
            ShardedCheckpointWriter().save(root / "last.ckpt", state, [], {"global_step": 1}, is_rank_zero=True)
            return time.perf_counter() - start

        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for with_hashes in (False, True):
                times[with_hashes].append(save(with_hashes))
        checkpoint_io.hashed, checkpoint_io.file_digest = hashed, digest
        save(True)
        start = time.perf_counter()
        assert checked_files(root / "last.ckpt") == []
        verify = time.perf_counter() - start
        start = time.perf_counter()
        checked_files(root / "last.ckpt", verify=False)
        sizes_only = time.perf_counter() - start
        written = sum(p.stat().st_size for p in (root / "last.ckpt").iterdir())
    finally:
        checkpoint_io.hashed, checkpoint_io.file_digest = hashed, digest
        shutil.rmtree(root, ignore_errors=True)
    plain, with_hashes = statistics.median(times[False]), statistics.median(times[True])
    print(json.dumps({
        "bytes_written": written,
        "save_s_without_hashes": round(plain, 4),
        "save_s_with_hashes": round(with_hashes, 4),
        "hashing_s": round(with_hashes - plain, 4),
        "hashing_percent": round(100 * (with_hashes - plain) / plain, 1),
        "load_check_s": round(verify, 4),
        "load_check_s_verify_false": round(sizes_only, 4),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
