"""A colocated server over TP ranks (colocated_node/lockstep.py): rank 0's `LockstepEngine`
mirrors every call that changes its engine to the other ranks, which `follow` it step for step.
Two gloo processes on the CPU, float32:

- greedy output, plain and speculative, equals one rank's, with requests added while others
  run and one aborted mid-way; every page is back on both ranks afterwards (an abort that
  did not reach rank 1 would leave its pages held, or hang the ranks);
- an idle rank 0 keeps the others alive past the process group's timeout (the heartbeat);
- unseeded sampling draws the same tokens on every TP rank even when one rank's process
  consumed torch's global RNG (the engine's own generator, engine/sampling.py).
"""

from __future__ import annotations

import time

import pytest
import torch
from disagg_helpers import tiny_model_and_head
from rank_helpers import run_ranks

from tandem.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 2, 8], [100, 3], [11, 12, 13]]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _cfg(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", num_pages=128, page_size=4)


def _build(rank: int, port: int, dirs, speculative: bool, timeout_s: float = 60.0):
    from tandem.worker.ranks import RankInfo, join_group

    torch.set_num_threads(1)
    par, sync = join_group(RankInfo(rank=rank, tp=2, ep=1), "127.0.0.1", port, "cpu",
                           timeout_s=timeout_s)
    model_dir, head_dir = dirs
    if speculative:
        from tandem.spec import SpecConfig, SpecEngine

        eng = SpecEngine.from_config(_cfg(model_dir), SpecConfig(draft_model=str(head_dir),
                                                                 num_steps=3), par)
    else:
        eng = LLMEngine.from_config(_cfg(model_dir), par)
    return eng, sync


def _leave(sync) -> None:
    """Both ranks meet, then tear the group down: a rank whose peer exits first with the group
    still up can be aborted by gloo at its own exit (SIGABRT)."""
    from tandem.worker.ranks import leave_group

    sync.all_gather(None)
    leave_group()


def _drive(front, steps_before_abort: int = 2) -> dict[str, list[int]]:
    """Rank 0: requests 0-1 first, 2-3 after a step, request 3 aborted; tokens per request."""
    got: dict[str, list[int]] = {}

    def collect(outs):
        for o in outs:
            got.setdefault(o.req_id, []).extend(o.new_token_ids)

    for i in (0, 1):
        front.add_request(PROMPTS[i], GREEDY, f"r{i}")
    collect(front.step())
    for i in (2, 3):
        front.add_request(PROMPTS[i], GREEDY, f"r{i}")
    for _ in range(steps_before_abort):
        collect(front.step())
    front.abort("r3")
    while front.has_unfinished():
        collect(front.step())
    got.pop("r3", None)
    return got


def _serve_rank(rank: int, port: int, dirs, speculative: bool, out) -> None:
    from tandem.colocated_node.lockstep import LockstepEngine, follow

    eng, sync = _build(rank, port, dirs, speculative)
    with torch.inference_mode():
        if rank == 0:
            front = LockstepEngine(eng, sync)
            got = _drive(front)
            front.close()
        else:
            follow(eng, sync)
            got = None
    _leave(sync)
    out.put((rank, got, eng.allocator.num_free == eng.allocator.num_usable))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_tp2_colocated_engine_equals_one_rank(tmp_path, speculative):
    dirs = tiny_model_and_head(tmp_path)
    reports, codes = run_ranks(_serve_rank, 2, dirs, speculative, timeout_s=180)
    assert codes == [0, 0]
    by_rank = {r: (got, free) for r, got, free in reports}
    assert by_rank[0][1] and by_rank[1][1], "a rank kept pages after the abort"
    one = LLMEngine.from_config(_cfg(dirs[0]))
    want = [list(c.output_ids) for c in one.generate(PROMPTS[:3], GREEDY)]
    assert [by_rank[0][0][f"r{i}"] for i in range(3)] == want


def _idle_rank(rank: int, port: int, dirs, out) -> None:
    from tandem.colocated_node.lockstep import LockstepEngine, follow

    eng, sync = _build(rank, port, dirs, False, timeout_s=3.0)
    with torch.inference_mode():
        if rank == 0:
            front = LockstepEngine(eng, sync, heartbeat_s=0.3)
            time.sleep(6.0)  # twice the process group's timeout, idle
            front.add_request(PROMPTS[0], GREEDY, "late")
            toks = []
            while front.has_unfinished():
                toks += [t for o in front.step() for t in o.new_token_ids]
            front.close()
        else:
            follow(eng, sync)
            toks = None
    _leave(sync)
    out.put((rank, toks))


def test_idle_leader_keeps_followers_past_the_group_timeout(tmp_path):
    dirs = tiny_model_and_head(tmp_path)
    reports, codes = run_ranks(_idle_rank, 2, dirs, timeout_s=120)
    assert codes == [0, 0]
    toks = dict(reports)[0]
    one = LLMEngine.from_config(_cfg(dirs[0]))
    assert toks == list(one.generate([PROMPTS[0]], GREEDY)[0].output_ids)


def _sampling_rank(rank: int, port: int, dirs, out) -> None:
    eng, sync = _build(rank, port, dirs, False)
    if rank == 0:  # this process draws from torch's global RNG; its peer does not
        torch.rand(1000)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    with torch.inference_mode():
        got = [c.output_ids for c in eng.generate(PROMPTS, params)]
    _leave(sync)
    out.put((rank, got))


def test_tp_ranks_draw_the_same_unseeded_tokens(tmp_path):
    dirs = tiny_model_and_head(tmp_path)
    reports, codes = run_ranks(_sampling_rank, 2, dirs, timeout_s=180)
    assert codes == [0, 0]
    by_rank = dict(reports)
    assert by_rank[0] == by_rank[1]


def test_lockstep_engine_runs_on_rank_0_only():
    from tandem.colocated_node.lockstep import LockstepEngine

    class Rank1:
        rank, size = 1, 2

    with pytest.raises(ValueError, match="sync"):
        LockstepEngine(object(), Rank1())


def test_each_local_rank_takes_its_own_gpu():
    from tandem.colocated_node.tp_processes import rank_config

    cpu = EngineConfig(model="x", device="cpu")
    assert rank_config(cpu, 1) is cpu
    for device in ("cuda", "cuda:0"):
        assert rank_config(EngineConfig(model="x", device=device), 2).device == "cuda:2"


def test_a_dead_rank_leaves_the_group_untouched(monkeypatch):
    """A tick that fails (a rank died) marks the engine broken; closing then skips the group's
    teardown, which can abort the process on a gloo group whose peer is gone, and says so."""
    from tandem.colocated_node import tp_processes
    from tandem.colocated_node.lockstep import LockstepEngine

    class DeadPeer:
        rank, size = 0, 2

        def broadcast(self, obj):
            raise RuntimeError("Connection reset by peer")

    left = []
    monkeypatch.setattr(tp_processes, "leave_group", lambda: left.append(True))
    front = LockstepEngine(object(), DeadPeer(), heartbeat_s=60)
    with pytest.raises(RuntimeError, match="reset"):
        front.step()
    assert front.broken
    assert tp_processes.TPEngine(engine=front, procs=[]).close() is False
    assert left == []


def test_a_clean_close_leaves_the_group(monkeypatch):
    from tandem.colocated_node import tp_processes
    from tandem.colocated_node.lockstep import LockstepEngine

    class Peer:
        rank, size = 0, 2

        def broadcast(self, obj):
            pass

    left = []
    monkeypatch.setattr(tp_processes, "leave_group", lambda: left.append(True))
    front = LockstepEngine(object(), Peer(), heartbeat_s=60)
    assert tp_processes.TPEngine(engine=front, procs=[]).close() is True
    assert not front.broken and left == [True]


def test_the_dead_rank_exit_prints_the_exception_on_its_way_out(monkeypatch, capsys):
    """`tandem serve --tp` ends with `os._exit` where a rank died; an exception leaving the
    serve loop then would vanish with the process, so it is printed first."""
    from tandem.cli import serve

    codes = []
    monkeypatch.setattr(serve.os, "_exit", codes.append)
    monkeypatch.setattr(serve.logging, "shutdown", lambda: None)  # pytest's handlers stay
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("the serve loop broke")
        finally:
            serve._exit_now(1)
    assert codes == [1] and "the serve loop broke" in capsys.readouterr().err
    serve._exit_now(0)  # nothing on its way out: nothing printed
    assert codes == [1, 0] and capsys.readouterr().err == ""
