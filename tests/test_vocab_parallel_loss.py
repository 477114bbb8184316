"""Issue 44 item 1: every loss computed from the logits trains like one device under tensor parallel's default
``vocab_parallel_loss=True``, and the logits behave as a plain tensor in the user's code (issue 45 item 5).

The head's logits reach the step split over the vocabulary as ``VocabParallelLogits`` (``tensor_parallel/vocab.py``):
a cross-entropy (``F.cross_entropy``, ``nll_loss`` of ``log_softmax``) runs on the shares; anything else gathers the
logits once. Multi-process: each loss of ``tests/loss_models.py`` at tp2 (2 processes) and tp2 x pp2 x dp2 (8), the
Hugging Face ``labels=`` loss (``reduction="sum"``, ignored tokens) in both, all losses at once at tp2 x dp2 with
ZeRO-3 and sequence parallel (4) and under ``bf16-mixed`` (2), each against one device; the cross-entropy gathers
nothing, the predictions' argmax equals one device's. Single process: which calls run on the shares (by counting the
gathers), with a tensor-parallel group of one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.conftest import relative_error, share
from tests.harness import make_dataset, run_reference
from tests.loss_models import LOSSES, LossLab

STEPS = 3  # first-step gradients and three steps of weights: a wrong gradient moves them by far more than 1e-5
BATCH = 4
TP2 = {"tensor_parallel_size": 2}
THREE_D = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 2}


def _scenario(name: str, model: str, strategy: dict[str, Any], dp: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "model_kwargs": extra.pop("model_kwargs", {}), "strategy": strategy,
            "steps": STEPS, "batch_size": BATCH, "data_parallel_size": dp,
            "after_fit": "tests.test_vocab_parallel_loss:gathers_per_rank", **extra}  # fmt: skip


def gathers_per_rank(trainer: Any, directory: Any) -> list[list[int]]:
    """Every rank's count of logits gathers per training step of the module's loss (collective)."""
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, list(getattr(trainer.lightning_module, "gathers", [])))
    return counts


GROUPS = {
    2: [
        *[_scenario(f"loss-{name}-tp2", "losslab", TP2, 1, model_kwargs={"loss": name}, predict=True)
          for name in LOSSES],
        _scenario("loss-hf_labels-tp2", "hf_labels", TP2, 1),
        _scenario("loss-all-tp2-bf16", "losslab", TP2, 1, model_kwargs={"loss": "all"},
                  trainer={"precision": "bf16-mixed"}),
        # bf16 weights and logits (the strategy steps fp32 masters; one device steps the bf16 weights themselves)
        _scenario("loss-all-tp2-bf16-true", "losslab", TP2, 1, model_kwargs={"loss": "all"},
                  trainer={"precision": "bf16-true"}),
    ],
    4: [
        _scenario("loss-all-tp2-dp2-zero3-sp", "losslab", {**TP2, "zero_stage": 3, "sequence_parallel": True}, 2,
                  model_kwargs={"loss": "all"}),
    ],
    8: [
        *[_scenario(f"loss-{name}-2x2x2", "losslab", THREE_D, 2, model_kwargs={"loss": name}, predict=True)
          for name in LOSSES],
        _scenario("loss-hf_labels-2x2x2", "hf_labels", THREE_D, 2),
    ],
}  # fmt: skip
for _world, _scenarios in GROUPS.items():
    share(_world, _scenarios)
CASES = [s for group in GROUPS.values() for s in group]
# 16-bit autocast: another summation order rounds in bf16, so the two runs agree to bf16's precision only
TOLERANCE = {"loss-all-tp2-bf16": 2e-2, "loss-all-tp2-bf16-true": 2e-2}


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", CASES, ids=[s["name"] for s in CASES])
def test_loss_on_the_logits_trains_like_one_device(shared_groups, case: dict[str, Any]) -> None:
    world = next(w for w, group in GROUPS.items() if case in group)
    result = shared_groups(world).get(case["name"])
    reference = run_reference({k: v for k, v in case.items() if k != "strategy"})
    tolerance = TOLERANCE.get(case["name"], 1e-5)
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) <= tolerance * abs(want), f"step {step}: loss {got} vs one device {want}"
    for kind in ("grads", "params"):  # first-step gradients, final weights (gathered over every shard)
        assert result[kind].keys() == reference[kind].keys(), kind
        for name, want in reference[kind].items():
            error = relative_error(result[kind][name], want)
            assert error <= tolerance, f"{kind} {name}: relative error {error:.2e}"
    gathers = result["after_fit"]
    if case["model"] == "hf_labels" or case["model_kwargs"].get("loss") in (
        "cross_entropy",
        "nll_log_softmax",
        "label_smoothing",
    ):
        # the cross-entropy runs on the vocabulary shares: the logits are never made whole for it. transformers
        # computes its loss inside the network call, around which the first step's checks of the network run (their
        # projection of the whole output: once at the call without a pipeline, once a micro-batch before a pipeline's
        # schedule, while the steps wait at their calls): counted from the second step on there
        first = case["strategy"].get("num_microbatches", 1) if case["model"] == "hf_labels" else 0
        assert all(all(c == 0 for c in rank[first:]) for rank in gathers), gathers
        assert all(len(rank) > first for rank in gathers if rank), gathers
    if case.get("predict"):  # the step's argmax of the logits, as one device computes it with the same weights
        module = LossLab(**case["model_kwargs"])
        module.load_state_dict(result["params"], strict=False)
        # rank 0's share of the 8 samples predicted: Lightning's sampler deals them out over the data replicas
        x = torch.stack([make_dataset()[i][0] for i in range(0, 8, case["data_parallel_size"])])
        with torch.no_grad():
            assert torch.equal(result["predictions"], module(x).argmax(-1))


# ---------------------------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def group_of_one():
    """A tensor-parallel group of one process: every rank's share is the whole vocabulary, which makes the
    recognition (what runs on the shares, what gathers) visible in one process."""
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _split(mesh: Any, logits: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    from lightning_hybrid.tensor_parallel.vocab import VocabParallelLogits

    return VocabParallelLogits.of(DTensor.from_local(logits, mesh, [Shard(-1)], run_check=False))


ON_THE_SHARES = {
    "cross_entropy": lambda z, y: F.cross_entropy(z.view(-1, z.size(-1)), y.view(-1)),
    "cross_entropy on [B, V, T]": lambda z, y: F.cross_entropy(z.permute(0, 2, 1), y, reduction="sum"),
    "nll_loss(log_softmax)": lambda z, y: F.nll_loss(z.float().log_softmax(-1).reshape(-1, 8), y.flatten()),
    "nn.CrossEntropyLoss, ignore_index, smoothing": lambda z, y: torch.nn.CrossEntropyLoss(
        ignore_index=2, label_smoothing=0.2, reduction="none"
    )(z.flatten(0, 1), y.flatten()),
    "shifted and masked": lambda z, y: F.cross_entropy(z[:, :-1][y[:, 1:] > 3], y[:, 1:][y[:, 1:] > 3]),
    "Hugging Face's ForCausalLMLoss": lambda z, y: _hf_loss(z, y),
}
WHOLE = {
    "argmax": lambda z, y: z.argmax(-1),
    "log_softmax read by a KL": lambda z, y: F.kl_div(
        z.log_softmax(-1), torch.zeros(2, 3, 8), log_target=True, reduction="batchmean"
    ),
    "gathered token log-probabilities": lambda z, y: z.log_softmax(-1).gather(-1, y.unsqueeze(-1)),
    "logsumexp": lambda z, y: torch.logsumexp(z, -1),
    "mse": lambda z, y: F.mse_loss(z, torch.ones(2, 3, 8)),
    "class weights": lambda z, y: F.cross_entropy(z.view(-1, 8), y.view(-1), weight=torch.rand(8)),
    "probabilities as targets": lambda z, y: F.cross_entropy(z.view(-1, 8), torch.rand(6, 8)),
    "cross_entropy over the sequence": lambda z, y: F.cross_entropy(z, torch.zeros(2, 8, dtype=torch.long)),
    "vocabulary indexed": lambda z, y: z[..., 3],
    ".tolist()": lambda z, y: torch.tensor(z.tolist()),
}


def _hf_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels.masked_fill(labels == 0, -100), 8, num_items_in_batch=torch.tensor(3))


@pytest.mark.parametrize("name", ON_THE_SHARES)
def test_cross_entropies_run_on_the_shares(group_of_one: Any, name: str) -> None:
    from lightning_hybrid.tensor_parallel.vocab import VocabParallelLogits

    torch.manual_seed(0)
    logits, y = torch.randn(2, 3, 8, requires_grad=True), torch.randint(0, 8, (2, 3))
    plain = logits.detach().clone().requires_grad_()
    before = VocabParallelLogits.gathers
    got, want = ON_THE_SHARES[name](_split(group_of_one, logits), y), ON_THE_SHARES[name](plain, y)
    assert VocabParallelLogits.gathers == before, "gathered the logits"
    assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.allclose(got, want, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    assert torch.allclose(logits.grad, plain.grad, atol=1e-6)


@pytest.mark.parametrize("name", WHOLE)
def test_everything_else_gathers_once_and_computes_as_a_plain_tensor(group_of_one: Any, name: str) -> None:
    from lightning_hybrid.tensor_parallel.vocab import VocabParallelLogits

    torch.manual_seed(0)
    logits, y = torch.randn(2, 3, 8, requires_grad=True), torch.randint(0, 8, (2, 3))
    plain = logits.detach().clone().requires_grad_()
    split = _split(group_of_one, logits)
    before = VocabParallelLogits.gathers
    torch.manual_seed(1)
    got = WHOLE[name](split, y)
    torch.manual_seed(1)
    want = WHOLE[name](plain, y)
    assert VocabParallelLogits.gathers == before + 1
    assert type(got) is torch.Tensor and torch.equal(got, want)
    if want.requires_grad:
        got.float().sum().backward()
        want.float().sum().backward()
        assert torch.equal(logits.grad, plain.grad)
    WHOLE[name](split, y)  # the whole logits are kept while the tensor lives
    assert VocabParallelLogits.gathers == before + 1


def test_split_logits_report_the_whole_shape_and_stay_split_through_reshapes(group_of_one: Any) -> None:
    from lightning_hybrid.tensor_parallel.vocab import VocabParallelLogits

    logits = torch.randn(2, 3, 8, requires_grad=True)
    split = _split(group_of_one, logits)
    assert (split.shape, split.dtype, split.device, split.dim(), len(split)) == (
        (2, 3, 8),
        torch.float32,
        torch.device("cpu"),
        3,
        2,
    )
    assert split.requires_grad and split.size(-1) == 8 and split.is_floating_point()
    before = VocabParallelLogits.gathers
    for view in (
        split.view(-1, 8),
        split.reshape(6, 8),
        split.flatten(0, 1),
        split[:, 1:],
        split[..., :2, :],
        split.float(),
        split.to(torch.float64),
        split.contiguous(),
        split.detach(),
        split.transpose(0, 1),
        split.log_softmax(-1),
        split[torch.tensor([[True, False, True], [False, True, True]])],
    ):
        assert isinstance(view, VocabParallelLogits), view
    assert "VocabParallelLogits" in repr(split)  # no values: a repr never gathers (it may run on one rank only)
    assert VocabParallelLogits.gathers == before


def test_an_in_place_write_makes_the_logits_whole(group_of_one: Any) -> None:
    logits = torch.randn(2, 3, 8)
    split = _split(group_of_one, logits).clone()
    split[..., 0] = -1e4
    expected = logits.clone()
    expected[..., 0] = -1e4
    y = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(
        F.cross_entropy(split.view(-1, 8), y.view(-1)), F.cross_entropy(expected.view(-1, 8), y.view(-1))
    )
    view = _split(group_of_one, logits).view(-1, 8)
    with pytest.raises(RuntimeError, match="share their values with another view"):
        view.masked_fill_(view > 0, 0.0)
    reduced = _split(group_of_one, logits)
    dist.all_reduce(reduced)  # a collective writes into its first tensor: made whole first, then written
    assert torch.equal(reduced.argmax(-1), logits.argmax(-1)) and reduced._whole is not None


def test_an_index_gathers_only_what_it_keeps_and_same_size_views_share_one_gather(
    group_of_one: Any, monkeypatch
) -> None:
    from lightning_hybrid.tensor_parallel import vocab

    shapes: list[tuple[int, ...]] = []
    gather = vocab._Shards.gather

    def recorded(self: Any, local: torch.Tensor, dim: int) -> torch.Tensor:
        shapes.append(tuple(local.shape))
        return gather(self, local, dim)

    monkeypatch.setattr(vocab._Shards, "gather", recorded)
    logits = torch.randn(2, 3, 8)
    split = _split(group_of_one, logits)
    assert torch.equal(split[:, -1].softmax(-1), logits[:, -1].softmax(-1))  # the last position only
    assert shapes == [(2, 8)]
    assert torch.equal(split.view(-1, 8).argmax(-1), logits.view(-1, 8).argmax(-1))
    assert torch.equal(split.float().argmax(-1), logits.argmax(-1))
    assert shapes == [(2, 8), (2, 3, 8)]  # the view and the cast replay the root's one gather


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(6, 8), (8,), (2, 8, 3)], ids=["rows", "one row", "classes on dim 1"])
def test_the_vocabulary_parallel_cross_entropy_is_torchs(reduction: str, smoothing: float, shape: tuple) -> None:
    """The formula and its backward, on one rank holding every class (fp64: agreement to rounding), with an ignored
    target where there are several."""
    from lightning_hybrid.tensor_parallel.vocab_loss import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 8, shape[:1] + shape[2:] if len(shape) > 1 else ())
    if target.dim():
        target.view(-1)[0] = 3
    kwargs = {"ignore_index": 3, "reduction": reduction, "label_smoothing": smoothing}
    got, want = vocab_parallel_cross_entropy(x, target, None, 0, 8, **kwargs), F.cross_entropy(x, target, **kwargs)
    assert torch.allclose(got, want, atol=1e-12, equal_nan=True)
    weights = torch.randn_like(want)
    (got_grad,), (want_grad,) = (torch.autograd.grad((v * weights).sum(), x) for v in (got, want))
    assert torch.allclose(got_grad, want_grad, atol=1e-12, equal_nan=True)
