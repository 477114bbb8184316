"""Deferred construction, single process: a module recorded on the meta device and replayed gets exactly the values
(bit for bit) and leaves the random generator exactly where the same seed's construction on one device does, while
the replay holds about one layer at a time."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_hybrid.construction import record_construction
from lightning_hybrid.construction.materialize import construction_targets, materialize

SEED = 123


def _unusual() -> nn.Module:
    """Initializations that read values (rejection sampling, QR), out-of-place random expressions, a partial write,
    a dtype conversion and a buffer computed from constants."""

    class Unusual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.truncated = nn.Parameter(torch.empty(8, 8))
            nn.init.trunc_normal_(self.truncated, std=0.02)
            self.orthogonal = nn.Parameter(torch.empty(6, 6))
            nn.init.orthogonal_(self.orthogonal)
            self.expression = nn.Parameter(torch.randn(5) * 2 + 1)
            self.embedding = nn.Embedding(10, 4, padding_idx=0)
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
            self.double = nn.Linear(4, 4).to(torch.float64)

    return Unusual()


def _builders() -> dict[str, Callable[[], nn.Module]]:
    from examples.nanogpt import GPT, GPTConfig

    builders: dict[str, Callable[[], nn.Module]] = {
        "nanogpt": lambda: GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=4, n_embd=32)),
        "cnn": lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(288, 10)
        ),
        "unusual": _unusual,
    }
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

        builders["hf_llama"] = lambda: AutoModelForCausalLM.from_config(
            LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2)
        )  # fmt: skip
        builders["hf_mixtral"] = lambda: AutoModelForCausalLM.from_config(
            MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
        )  # fmt: skip
    except ImportError:
        pass
    try:
        from litgpt import GPT as LitGPT
        from litgpt import Config

        builders["litgpt"] = lambda: LitGPT(
            Config(block_size=32, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=4, n_embd=32)
        )
    except ImportError:
        pass
    return builders


@pytest.mark.parametrize("name", sorted(_builders()))
def test_replay_equals_construction_on_one_device(name: str) -> None:
    build = _builders()[name]
    torch.manual_seed(SEED)
    reference = build()
    draw_after_reference = torch.rand(4)

    torch.manual_seed(SEED)
    with record_construction(after_seed_reset=True) as record:
        module = build()
    assert all(p.is_meta for p in module.parameters())  # (torch.tensor constants stay real, as small as given)
    targets = construction_targets(module, record)
    assert targets.unknown == []
    report = materialize(module, targets, torch.device("cpu"))

    assert report.uninitialized == set()
    expected, got = reference.state_dict(), module.state_dict()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key
    # the generator is where one device's construction left it: dropout and data order continue alike
    assert torch.equal(torch.rand(4), draw_after_reference)


def test_the_replay_holds_about_one_layer_at_a_time() -> None:
    from examples.nanogpt import GPT, GPTConfig

    with record_construction() as record:
        module = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=64))
    total = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    report = materialize(module, construction_targets(module, record), torch.device("cpu"))
    largest = max(t.numel() * t.element_size() for t in module.state_dict().values())
    assert report.peak_bytes <= 2 * largest < total / 4, (report.peak_bytes, largest, total)


def test_a_weight_nothing_initializes_is_reported() -> None:
    class Forgetful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.initialized = nn.Parameter(torch.zeros(3))
            self.forgotten = nn.Parameter(torch.empty(3))

    with record_construction() as record:
        module = Forgetful()
    targets = construction_targets(module, record)
    report = materialize(module, targets, torch.device("cpu"))
    assert {targets.name_of(key) for key in report.uninitialized} == {"forgotten"}


def test_meta_tensors_made_outside_the_recording_are_named() -> None:
    with record_construction() as record:
        module = nn.Linear(2, 2)
    with torch.device("meta"):
        module.extra = nn.Linear(2, 2)
    assert sorted(construction_targets(module, record).unknown) == ["extra.bias", "extra.weight"]


def test_a_seed_set_inside_the_construction_is_replayed() -> None:
    """``seed_everything`` inside ``trainer.init_module()`` (as a module built under it may call): the draws after it
    start from that seed, on one device and in the replay."""

    def build() -> nn.Module:
        first = nn.Linear(3, 3)
        torch.manual_seed(7)
        return nn.Sequential(first, nn.Linear(3, 3))

    torch.manual_seed(SEED)
    reference = build()
    draw_after_reference = torch.rand(2)
    torch.manual_seed(SEED)
    with record_construction(after_seed_reset=True) as record:
        module = build()  # on meta nothing draws: without the reseed the second layer would continue from SEED
    materialize(module, construction_targets(module, record), torch.device("cpu"))
    for key, value in reference.state_dict().items():
        assert torch.equal(value, module.state_dict()[key]), key
    assert torch.equal(torch.rand(2), draw_after_reference)


def test_materialized_tensors_are_the_objects_taken_before() -> None:
    """What holds a tensor before materialization (a tied head, a table of shared parameters, an unsplit deep copy's
    own ties) holds the real one after: each meta tensor becomes real in place, tied ones stay one object, and the
    attributes set on a parameter stay on it. ``nn.Module._apply`` (``to_empty``) gave each module a new object."""
    import copy

    from lightning_hybrid.construction.materialize import allocate

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.table = nn.Parameter(torch.randn(6, 4))  # a bare parameter of the root
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("steps", torch.zeros(3))
            self.register_buffer("grid", torch.ones(4, 4).tril())
            self.register_buffer("grid_view", self.grid.view(1, 1, 4, 4))  # keeps the grid's record until it is swapped

    torch.manual_seed(SEED)
    with record_construction() as record:
        net = Tied()
    net.table.marked = True
    seen: list[str] = []
    net.table.register_hook(lambda grad: seen.append("hook") or grad)  # a hook set up around the meta tensor
    net.table.register_post_accumulate_grad_hook(lambda p: seen.append("post-accumulate hook"))
    taken = {"embed": net.embed.weight, "table": net.table, "steps": net.steps, "grid": net.grid}
    unsplit = copy.deepcopy(net)
    materialize(net, construction_targets(net, record), torch.device("cpu"))
    allocate(unsplit, torch.device("cpu"))
    assert net.embed.weight is taken["embed"] and net.head.weight is taken["embed"] and not taken["embed"].is_meta
    assert net.table is taken["table"] and net.table.marked and net.steps is taken["steps"]
    assert net.grid is taken["grid"] and torch.equal(net.grid_view[0, 0], net.grid) and net.grid.sum() == 10
    assert unsplit.head.weight is unsplit.embed.weight and not unsplit.head.weight.is_meta
    torch.manual_seed(SEED)
    assert torch.equal(net.embed.weight, Tied().embed.weight)
    net.table.sum().backward()
    assert seen == ["hook", "post-accumulate hook"]


def test_no_call_of_the_replay_outlives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that holds neither of two weights initialized twice in a row (Hugging Face's ``post_init``: the head's
    own ``reset_parameters``, then ``_init_weights``) draws both into scratch for the generator's sake; each scratch,
    and each real storage once released, is gone before the next call allocates: the replay holds one full tensor at
    a time, not two. Every tensor the replay hands out is watched (a weak reference), and none of an earlier call may
    be alive when the next one starts."""
    import sys
    import weakref

    replay_module = sys.modules["lightning_hybrid.construction.replay"]
    with record_construction() as record:
        held, other = nn.Linear(64, 64), nn.Linear(64, 64)
        for layer in (held, other):
            nn.init.normal_(layer.weight)  # overwrites reset_parameters' draw
    handed_out: list[weakref.ref] = []
    original_view, original_call = replay_module._Storages.view, replay_module._call

    def watched_view(self: object, v: object, scratch: object = None) -> torch.Tensor:
        t = original_view(self, v, scratch)
        handed_out.append(weakref.ref(t))
        return t

    def checked_call(*args: object) -> list[torch.Tensor]:
        assert all(ref() is None for ref in handed_out), "a tensor of an earlier call is still alive"
        return original_call(*args)

    monkeypatch.setattr(replay_module._Storages, "view", watched_view)
    monkeypatch.setattr(replay_module, "_call", checked_call)
    targets = construction_targets(held, record)
    report = replay_module.replay(record, torch.device("cpu"), targets.by_storage, lambda key, view: None)
    assert len(handed_out) > 4 and report.peak_bytes <= 64 * 64 * 4  # one weight at a time, scratch counted
