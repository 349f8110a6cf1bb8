"""The prefix kernel's autotune choices on disk (relaygr_engine/kernels/_autotune_store.py): saved and loaded per GPU,
Triton and kernel source, only configs the pruning keeps, bad files refused by name, and RELAYGR_AUTOTUNE_FILE's
load-then- rewrite. (No GPU: a stand-in fingerprint and stand-ins for the autotuner's tuning; the CUDA round trip is in
test_kernels_cuda.py.)"""
from __future__ import annotations

import json
import logging
import os

import pytest

pytest.importorskip("triton")

from relaygr_engine import _warn  # noqa: E402
from relaygr_engine.kernels import _autotune_store as S  # noqa: E402
from relaygr_engine.kernels import _prefix_config as K  # noqa: E402
from relaygr_engine.kernels import prefix_attention as pa  # noqa: E402

HERE = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "triton": "3.6.0", "kernel": "abc"}
VALUES = dict(HEAD_DIM=256, PAGE_SIZE=64, BLOCK_M=128, CAND_TILES=True, HSTU=True, HAS_POS=True, HAS_TS=True,
              HIST_TABLE=False, PERSISTENT=False, SPLIT=True, KV8=False, FAST_SILU=True, TMA_READS=1,
              V_SPLITS_PICK=0, SKIP_FULL=0)


def key_of(**over) -> tuple:
    values = {**VALUES, **over}
    return tuple(values[k] for k in K.AUTOTUNE_KEYS) + ("torch.bfloat16", "torch.int32", "torch.float32")


@pytest.fixture
def tuner(monkeypatch):
    """The real autotuner, emptied, with a stand-in fingerprint (no GPU) and fresh warn-once memory."""
    monkeypatch.setattr(K, "autotune_fingerprint", lambda device=None: dict(HERE))
    _warn.forget()
    t = K.autotuned_kernel()
    K.reset_autotuning()
    yield t
    K.reset_autotuning()


def kept(key: tuple) -> list:
    return K.prune_configs(K.CUDA_CONFIGS, {}, **dict(zip(K.AUTOTUNE_KEYS, key)))


def test_saved_choices_load_as_the_same_configs_untimed(tuner, tmp_path):
    path = str(tmp_path / "tuned.json")
    cand, hist = key_of(), key_of(CAND_TILES=False, HIST_TABLE=True, BLOCK_M=128)
    picks = {cand: kept(cand)[-1], hist: kept(hist)[1]}  # not the first kept: the file says which
    tuner.cache.update(picks)
    assert pa.save_autotune(path) == 2
    doc = json.loads(open(path).read())
    assert doc["fingerprint"] == HERE and doc["key_names"] == K.AUTOTUNE_KEYS and len(doc["entries"]) == 2
    assert [n for n in os.listdir(tmp_path)] == ["tuned.json"]  # written through a renamed temporary file
    K.reset_autotuning()
    assert pa.load_autotune(path) == 2
    assert tuner.cache == picks and all(tuner.cache[k] is c for k, c in picks.items())  # the objects, hooks and all


def test_a_file_measured_elsewhere_loads_nothing_and_says_what_differs(tuner, tmp_path, caplog):
    path = str(tmp_path / "h200.json")
    S.write(path, S.document({key_of(): kept(key_of())[0]}, dict(HERE, gpu="NVIDIA H200"), K.AUTOTUNE_KEYS))
    with caplog.at_level(logging.WARNING):
        assert pa.load_autotune(path) == 0
    assert tuner.cache == {}
    assert "measured elsewhere" in caplog.text and "gpu" in caplog.text and "NVIDIA H200" in caplog.text
    S.write(path, S.document({key_of(): kept(key_of())[0]}, HERE, K.AUTOTUNE_KEYS[:-1]))
    assert pa.load_autotune(path) == 0  # keyed by other names: another kernel's file


def test_choices_the_pruning_drops_or_the_kernel_lacks_are_skipped(tuner, tmp_path, caplog):
    small = key_of(HEAD_DIM=64)
    split_values = next(c for c in K.CUDA_CONFIGS if c.kwargs["V_SPLITS"] == 2)  # offered above head dim 128 only
    assert split_values not in kept(small)
    good = kept(key_of())[0]
    doc = S.document({small: split_values, key_of(): good}, HERE, K.AUTOTUNE_KEYS)
    doc["entries"].append({"key": list(key_of(BLOCK_M=64)),
                           "config": {"kwargs": dict(good.kwargs, BLOCK_N=48), "num_warps": 8, "num_stages": 2,
                                      "maxnreg": None}})
    path = str(tmp_path / "t.json")
    S.write(path, doc)
    with caplog.at_level(logging.WARNING):
        assert pa.load_autotune(path) == 1
    assert tuner.cache == {key_of(): good}
    assert "2 of its 3 choices" in caplog.text


@pytest.mark.parametrize("text, why", [
    ("not json", "cannot be read"),
    ("[]", "expected a JSON object"),
    ('{"format": 7}', "expected format 1"),
    ('{"format": 1, "fingerprint": {}, "key_names": [], "entries": [3]}', "entry 0"),
    ('{"format": 1, "fingerprint": {}, "key_names": [], "entries": [{"key": [[1]], "config": {"kwargs": {}}}]}',
     "entry 0"),
])
def test_a_file_that_is_not_a_choices_file_is_refused_naming_it(tuner, tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=why) as err:
        pa.load_autotune(str(path))
    assert str(path) in str(err.value) and tuner.cache == {}
    with pytest.raises(ValueError, match="cannot be read"):
        pa.load_autotune(str(tmp_path / "missing.json"))


class StandInTuner:
    """What install() touches of Triton's autotuner: its cache and run (here tuning = adding a choice)."""

    def __init__(self, tunes: dict):
        self.cache, self.tunes, self.calls = {}, dict(tunes), 0

    def run(self, *args, **kwargs):
        self.calls += 1
        if self.tunes:
            key, config = self.tunes.popitem()
            self.cache[key] = config
        return "launched"


def test_the_environment_file_is_loaded_then_rewritten_after_each_tuning(tmp_path, monkeypatch):
    _warn.forget()
    path = str(tmp_path / "choices.json")
    monkeypatch.setenv(S.ENV_FILE, path)
    a, b = key_of(), key_of(HEAD_DIM=128)
    first = StandInTuner({a: kept(a)[0]})
    assert S.install(first, K.CUDA_CONFIGS, K.prune_configs, lambda: dict(HERE), K.AUTOTUNE_KEYS) == path
    assert not os.path.exists(path)  # nothing tuned yet
    assert first.run() == "launched" and first.run() == "launched"
    assert [e["key"] for e in json.loads(open(path).read())["entries"]] == [list(a)]
    mtime = os.stat(path).st_mtime_ns
    first.run()  # tuned nothing new: not rewritten
    assert os.stat(path).st_mtime_ns == mtime
    # a second process: loads the first's choice, then adds its own to the file
    second = StandInTuner({b: kept(b)[0]})
    S.install(second, K.CUDA_CONFIGS, K.prune_configs, lambda: dict(HERE), K.AUTOTUNE_KEYS)
    assert second.cache == {a: kept(a)[0]}
    second.run()
    assert {tuple(e["key"]) for e in json.loads(open(path).read())["entries"]} == {a, b}
    monkeypatch.delenv(S.ENV_FILE)
    assert S.install(StandInTuner({}), K.CUDA_CONFIGS, K.prune_configs, lambda: dict(HERE), K.AUTOTUNE_KEYS) is None


def test_an_unreadable_environment_file_is_logged_and_replaced(tmp_path, monkeypatch, caplog):
    _warn.forget()
    path = tmp_path / "choices.json"
    path.write_text("{truncated")
    a = key_of()
    t = StandInTuner({a: kept(a)[0]})
    with caplog.at_level(logging.WARNING):
        S.install(t, K.CUDA_CONFIGS, K.prune_configs, lambda: dict(HERE), K.AUTOTUNE_KEYS, path=str(path))
    assert "cannot be read" in caplog.text and t.cache == {}
    t.run()
    assert [tuple(e["key"]) for e in S.read(str(path))["entries"]] == [a]


def test_an_unwritable_environment_file_leaves_the_launches_alone(tmp_path, monkeypatch, caplog):
    _warn.forget()
    a = key_of()
    t = StandInTuner({a: kept(a)[0]})
    S.install(t, K.CUDA_CONFIGS, K.prune_configs, lambda: dict(HERE), K.AUTOTUNE_KEYS,
              path=str(tmp_path / "no-such-folder" / "choices.json"))
    with caplog.at_level(logging.WARNING):
        assert t.run() == "launched"
    assert "not saved" in caplog.text and t.cache == {a: kept(a)[0]}


def test_a_failing_fingerprint_never_fails_a_launch(tmp_path, monkeypatch, caplog):
    """Reading the GPU for the fingerprint can fail (a driver error): the file is neither loaded nor saved, the
    launches go on (logged)."""
    _warn.forget()
    path = str(tmp_path / "choices.json")
    a = key_of()
    S.write(path, S.document({a: kept(a)[0]}, HERE, K.AUTOTUNE_KEYS))

    def broken():
        raise RuntimeError("CUDA driver error")

    t = StandInTuner({key_of(HEAD_DIM=128): kept(key_of(HEAD_DIM=128))[0]})
    with caplog.at_level(logging.WARNING):
        S.install(t, K.CUDA_CONFIGS, K.prune_configs, broken, K.AUTOTUNE_KEYS, path=path)
        assert t.cache == {} and t.run() == "launched"
    assert caplog.text.count("CUDA driver error") == 2
    assert [tuple(e["key"]) for e in S.read(path)["entries"]] == [a]  # left as it was
