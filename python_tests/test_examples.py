"""The user-style example rankers: exact through every engine path and backend; check_relay_exact's verdicts."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when it first decorates kernels (see kernel_problems.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import relaygr_engine as rg  # noqa: E402
from relaygr_engine.testing import RelayMismatch, check_relay_exact  # noqa: E402
from example_modules import load_example  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hstu():
    return load_example("hstu_ranker")


@pytest.fixture(scope="module")
def softmax():
    return load_example("softmax_ranker")


def test_examples_run_end_to_end(hstu, softmax):
    for module in (hstu, softmax, load_example("stu_checkpoint")):
        out = module.main()
        assert out["max_abs_diff"] <= 1e-4 and set(out["sources"]) == {"hbm"}


def test_stu_checkpoint_example_loads_every_layer_tensor_and_stays_exact():
    module = load_example("stu_checkpoint")
    sd = module.stu_checkpoint(seed=3)
    model = module.build_from_stu(sd)
    for name, value in sd.items():  # each STU tensor landed in the ranker (transposed where STU stores x W)
        layer, key = name[len(module.PREFIX) + 1:].split(".", 1)
        mapped = {"_uvqk_weight": ("uvqk.weight", True), "_uvqk_beta": ("uvqk.bias", False),
                  "_input_norm_weight": ("input_norm.weight", False), "_input_norm_bias": ("input_norm.bias", False),
                  "_output_weight": ("out_proj.weight", True), "_output_norm_weight": ("output_norm.weight", False),
                  "_output_norm_bias": ("output_norm.bias", False)}[key]
        got = model.state_dict()[f"layers.{layer}.{mapped[0]}"]
        assert torch.equal(got.t() if mapped[1] else got, value)
    hists = [module.synthetic_history(n, seed=i) for i, n in enumerate((23, 40))]
    cands = [torch.randint(0, 1000, (c,), generator=torch.Generator().manual_seed(c)) for c in (5, 3)]
    assert max(check_relay_exact(model, hists, cands).values()) <= 1e-4


def _cases(module, lengths, seed=0):
    hists = [module.synthetic_history(n, seed=seed + i) for i, n in enumerate(lengths)]
    cands = [torch.randint(0, 1000, (c,), generator=torch.Generator().manual_seed(i)) for i, c in enumerate((5, 1, 9))]
    return hists, cands[:len(hists)]


@pytest.mark.parametrize("name", ["hstu_ranker", "softmax_ranker"])
def test_examples_exact_on_every_engine_path(name):
    module = load_example(name)
    model = (module.MyHSTURanker if name == "hstu_ranker" else module.MySoftmaxRanker)().eval()
    hists, cands = _cases(module, (23, 40, 9))
    report = check_relay_exact(model, hists, cands)
    assert set(report) == {"miss", "hit", "batch", "extend", "dram"}
    assert max(report.values()) <= 1e-4
    times = [int(hists[0].timestamps[-1]) + 99] if hists[0].timestamps is not None else None
    assert max(check_relay_exact(model, hists[:1], cands[:1], request_times=times, page_size=16).values()) <= 1e-4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name", ["hstu_ranker", "softmax_ranker"])
def test_examples_exact_with_the_triton_backend(name):
    from relaygr_engine.kernels import _common
    if not _common.interpreter_active():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import)")
    module = load_example(name)
    small = dict(layers=2, dim=32) if name == "hstu_ranker" else dict(layers=2, dim=32, heads=2)
    model = (module.MyHSTURanker if name == "hstu_ranker" else module.MySoftmaxRanker)(**small).eval()
    hists, cands = _cases(module, (13, 20))
    report = check_relay_exact(model, hists, cands, attention_backend="triton", paths=("miss", "hit", "extend"))
    assert max(report.values()) <= 1e-4


class _BatchCentered(torch.nn.Module):
    """Subtracts the batch mean of its rows: a per-batch normaliser, so a row depends on rows computed with it."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


def _break_before_block(model, block: int):
    original = model.blocks[block].forward
    center = _BatchCentered()
    model.blocks[block].forward = lambda x: original(center(x))
    return model


@pytest.mark.parametrize("block", [0, 1])
def test_check_relay_exact_names_the_first_layer_that_is_not_prefix_stable(hstu, block):
    model = _break_before_block(hstu.MyHSTURanker(layers=3).eval(), block)
    hists, cands = _cases(hstu, (30, 25))
    with pytest.raises(RelayMismatch, match=rf"path 'hit' .* first differing layer: layer {block} "
                                            rf"\(blocks\.{block}\.attn"):
        check_relay_exact(model, hists, cands, paths=("hit",))
    # with nothing cached the relay forward computes every row, as the no-cache forward does: no difference
    assert check_relay_exact(model, hists, cands, paths=("miss",))["miss"] <= 1e-4


def test_positions_counted_from_the_end_are_caught(softmax):
    class FromTheEnd(softmax.MySoftmaxRanker):
        def forward(self, batch):
            with rg.batch_context(batch):
                last = batch.positions.max()
                x = self.item(batch.item_ids) + self.position(last - batch.positions)
                for blk in self.blocks:
                    x = blk(x)
                return self.head(x[batch.candidate_rows])

    hists, cands = _cases(softmax, (30,))
    with pytest.raises(RelayMismatch, match="first differing layer: layer 0"):
        check_relay_exact(FromTheEnd().eval(), hists, cands, paths=("hit",))


def test_check_relay_exact_argument_errors(softmax):
    model = softmax.MySoftmaxRanker().eval()
    h = softmax.synthetic_history(10, seed=0)
    with pytest.raises(ValueError, match="histories must be a non-empty sequence of Behaviors"):
        check_relay_exact(model, [], torch.tensor([1]))
    with pytest.raises(ValueError, match="candidates must be one tensor or one per history"):
        check_relay_exact(model, [h, h], [torch.tensor([1])])
    with pytest.raises(ValueError, match="at least 3 tokens"):
        check_relay_exact(model, [h.prefix(2)], torch.tensor([1]))
    with pytest.raises(ValueError, match="paths must be among"):
        check_relay_exact(model, [h], torch.tensor([1]), paths=("warp",))
