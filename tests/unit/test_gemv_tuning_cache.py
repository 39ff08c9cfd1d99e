"""The GEMV tuner's choices outlive the process (triton_gemv.choose): a later process on the
same kind of GPU takes the recorded configuration instead of timing again, so its kernels --
and their bf16 rounding -- are the first process's. Checked with fake timings on the CPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from tandem.engine.kernels import gemv_tuning as tg  # noqa: E402

KEY = (6144, 4096, "torch.bfloat16", True, False, False, "torch.bfloat16", 5)
CANDIDATES = (tg.RowsConfig(32, 256, 4, 4), tg.RowsConfig(64, 256, 4, 3, True), tg.UNFUSED)


def _timer(fastest, calls: list[int]):
    def time_all() -> dict:
        calls.append(1)
        return {c: (0.5 if c == fastest else 1.0) for c in CANDIDATES}
    return time_all


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch):
    monkeypatch.setattr(tg, "_tables", {})  # as a new process


def test_first_process_times_and_records_later_ones_take_it(tmp_path, monkeypatch):
    path = tmp_path / "gemv" / "H200.json"
    calls: list[int] = []
    assert tg.choose(KEY, CANDIDATES, _timer(CANDIDATES[1], calls), path) == CANDIDATES[1]
    assert calls == [1]
    assert json.loads(path.read_text()) == {repr(KEY): [64, 256, 4, 3, True]}
    # A restart whose timing would pick otherwise takes the recorded choice, untimed.
    monkeypatch.setattr(tg, "_tables", {})
    assert tg.choose(KEY, CANDIDATES, _timer(CANDIDATES[0], calls), path) == CANDIDATES[1]
    assert calls == [1]
    # UNFUSED records as its name; other keys add to the same file.
    other = (*KEY[:-1], 2)
    assert tg.choose(other, CANDIDATES, _timer(tg.UNFUSED, calls), path) == tg.UNFUSED
    assert json.loads(path.read_text())[repr(other)] == "unfused"
    assert repr(KEY) in json.loads(path.read_text())


def test_a_choice_no_longer_among_the_candidates_is_timed_again(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({repr(KEY): [128, 128, 4, 3, False]}))  # an older version's
    calls: list[int] = []
    assert tg.choose(KEY, CANDIDATES, _timer(CANDIDATES[0], calls), path) == CANDIDATES[0]
    assert calls == [1]
    assert json.loads(path.read_text())[repr(KEY)] == [32, 256, 4, 4, False]


def test_a_choice_another_process_recorded_meanwhile_stands(tmp_path):
    path = tmp_path / "t.json"
    calls: list[int] = []

    def racing() -> dict:  # another worker records its choice while this one times
        path.write_text(json.dumps({repr(KEY): "unfused"}))
        return _timer(CANDIDATES[0], calls)()

    assert tg.choose(KEY, CANDIDATES, racing, path) == tg.UNFUSED
    assert json.loads(path.read_text()) == {repr(KEY): "unfused"}


def test_without_a_file_every_process_times(tmp_path, monkeypatch):
    calls: list[int] = []
    assert tg.choose(KEY, CANDIDATES, _timer(CANDIDATES[2], calls), None) == tg.UNFUSED
    assert calls == [1]
    monkeypatch.setenv(tg.TUNING_ENV, "0")
    assert tg.tuning_file(None) is None  # the device is not looked at
    monkeypatch.setenv(tg.TUNING_ENV, str(tmp_path / "mine.json"))
    assert tg.tuning_file(None) == tmp_path / "mine.json"


def test_an_unwritable_file_still_gives_the_fastest(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    calls: list[int] = []
    got = tg.choose(KEY, CANDIDATES, _timer(CANDIDATES[1], calls), blocker / "t.json")
    assert got == CANDIDATES[1] and calls == [1]


def test_the_kernels_do_not_need_the_model_importer():
    """GPU machines may lack the importer's packages (gguf): the GEMV module, which finds the
    tuning record under the cache root, must not import it (once it did, and the kernels fell
    back to torch twins with only a warning)."""
    import subprocess
    import sys

    code = ("import sys; import tandem.engine.kernels.triton_gemv; "
            "print('tandem.engine.model_import' in sys.modules, 'gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]
