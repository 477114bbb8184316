"""``lightning-hybrid plan``: the planner from the command line.

Example:
    lightning-hybrid plan --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 \\
        --micro-batch 4 --precision bf16 --optimizer adam --device-memory 80 --devices-per-node 8 --nodes 1
    lightning-hybrid plan --family llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \\
        --experts 8 --top-k 2 --seq 4096 --gpu H200 --expert-parallel-size 8
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-hybrid plan",
        description="Rank the layouts of a cluster for a model: per-device memory ledger, estimated step time, and"
        " why each layout that does not fit fails. Sizes in GB (1e9 bytes).",
    )
    model = p.add_argument_group("model (one of: --model, --hf-config, raw sizes)")
    model.add_argument("--model", help="class path of a LightningModule/nn.Module, built on the meta device")
    model.add_argument("--init-args", default=None, help="JSON dict of the class's constructor arguments")
    model.add_argument("--hf-config", help="a Hugging Face config.json or a local model folder")
    model.add_argument("--params", type=float, help="total parameters (e.g. 6.7e9); overrides the derived count")
    model.add_argument("--layers", type=int)
    model.add_argument("--hidden", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--kv-heads", type=int)
    model.add_argument("--ffn", type=int, help="MLP size (default 4 x hidden)")
    model.add_argument("--vocab", type=int)
    model.add_argument("--seq", type=int, help="sequence length")
    model.add_argument("--family", choices=["gpt", "llama"], help="block layout for raw sizes (default gpt)")
    moe = p.add_argument_group("mixture of experts (raw sizes; read from --hf-config / --model otherwise)")
    moe.add_argument("--experts", type=int, help="routed experts per MoE layer")
    moe.add_argument("--top-k", type=int, help="experts each token is routed to")
    moe.add_argument("--expert-ffn", type=int, help="one expert's MLP size (default --ffn)")
    moe.add_argument("--shared-experts", type=int, help="shared experts per MoE layer")
    moe.add_argument("--shared-ffn", type=int, help="one shared expert's MLP size (default --expert-ffn)")
    moe.add_argument("--dense-layers", type=int, help="the first k layers have a dense MLP")
    train = p.add_argument_group("training")
    train.add_argument("--micro-batch", type=int, default=1)
    train.add_argument(
        "--precision",
        default="bf16-mixed",
        help="32-true, bf16-mixed, 16-mixed, bf16-true, 16-true (what HybridStrategy holds), or"
        " bf16 / fp16 (2-byte parameters and gradients, fp32 master: the ZeRO paper's count)",
    )
    train.add_argument("--optimizer", default="adamw", help="adam, adamw or sgd (with momentum)")
    train.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default=None,
        help="activation recompute per block (default: try all three)",
    )
    train.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="plan tensor parallel without sequence parallel (expert parallel with tensor parallel needs it)",
    )
    train.add_argument(
        "--attention",
        choices=["eager", "flash"],
        default=None,
        help="eager keeps the attention scores (default for raw sizes), flash does not",
    )
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpu", default="H100", help="preset: H100, H200, A100 (80GB), A100-40GB")
    hw.add_argument("--device-memory", type=float, help="GB per device (default: the preset's)")
    hw.add_argument("--devices-per-node", type=int, default=8)
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--intra-node-bandwidth", type=float, help="GB/s per device inside a node")
    hw.add_argument("--inter-node-bandwidth", type=float, help="GB/s per device between nodes")
    fix = p.add_argument_group("fix a dimension")
    fix.add_argument("--tensor-parallel-size", type=int)
    fix.add_argument("--pipeline-parallel-size", type=int)
    fix.add_argument("--data-parallel-size", type=int)
    fix.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    fix.add_argument("--num-microbatches", type=int)
    fix.add_argument(
        "--expert-parallel-size", type=int, help="MoE: ranks of the data-parallel dimension splitting the experts"
    )
    fix.add_argument("--context-parallel-size", type=int, default=1, help="ranks splitting each sample's sequence")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help='print JSON: {"layouts": [...]}, best first')
    out.add_argument("--png", help="also write stacked bars per layout to this PNG file")
    out.add_argument("--limit", type=int, default=12, help="rows of the table (feasible and infeasible each)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from lightning_hybrid.config import HybridConfigError
    from lightning_hybrid.planning import plan

    args = parser().parse_args(argv)
    try:
        result = plan(
            args.model,
            init_args=json.loads(args.init_args) if args.init_args else None,
            hf_config=args.hf_config,
            params=args.params,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            ffn=args.ffn,
            vocab=args.vocab,
            seq=args.seq,
            family=args.family,
            experts=args.experts,
            top_k=args.top_k,
            expert_ffn=args.expert_ffn,
            shared_experts=args.shared_experts,
            shared_ffn=args.shared_ffn,
            dense_layers=args.dense_layers,
            micro_batch=args.micro_batch,
            precision=args.precision,
            optimizer=args.optimizer,
            recompute=args.recompute,
            device_memory=args.device_memory,
            devices_per_node=args.devices_per_node,
            nodes=args.nodes,
            gpu=args.gpu,
            intra_node_bandwidth=args.intra_node_bandwidth,
            inter_node_bandwidth=args.inter_node_bandwidth,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.data_parallel_size,
            zero_stage=args.zero_stage,
            num_microbatches=args.num_microbatches,
            attention=args.attention,
            sequence_parallel=not args.no_sequence_parallel,
            expert_parallel_size=args.expert_parallel_size,
            context_parallel_size=args.context_parallel_size,
        )
    except HybridConfigError as error:
        raise SystemExit(f"lightning-hybrid plan: {error}") from None
    print(result.to_json() if args.json else result.table(args.limit))
    if args.png:
        result.save_png(args.png)
    return 0
