"""A colocated engine over `tp` ranks in local processes, without Ray: `tandem serve --tp N`.

This process is rank 0 (it serves); ranks 1..tp-1 are spawned processes on this host that join
the process group at a free loopback port, build their share of the engine and `follow` rank
0's `LockstepEngine` (lockstep.py) until it closes. On CUDA rank r uses GPU r of the ones this
process sees. `bench/deployments.py` runs the same ranks as Ray actors instead (clusters).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
from dataclasses import dataclass

from tandem.colocated_node.lockstep import LockstepEngine, follow
from tandem.engine.config import EngineConfig
from tandem.spec.config import SpecConfig
from tandem.worker.ranks import RankInfo, join_group, leave_group

log = logging.getLogger(__name__)
HOST = "127.0.0.1"  # the ranks share this host; their group listens on loopback only


def build_engine(engine_cfg: EngineConfig, spec: SpecConfig | None, parallel=None):
    """One rank's engine: speculative when `spec` is given."""
    if spec is not None:
        from tandem.spec import SpecEngine

        return SpecEngine.from_config(engine_cfg, spec, parallel)
    from tandem.engine import LLMEngine

    return LLMEngine.from_config(engine_cfg, parallel)


def rank_config(engine_cfg: EngineConfig, rank: int) -> EngineConfig:
    """Rank r's engine on CUDA: GPU r (`cuda` or `cuda:0` means this host's first)."""
    if not engine_cfg.device.startswith("cuda"):
        return engine_cfg
    return dataclasses.replace(engine_cfg, device=f"cuda:{rank}")


def join_rank(info: RankInfo, host: str, port: int, engine_cfg: EngineConfig,
              spec: SpecConfig | None):
    """One rank of a colocated TP engine: join its process group (blocks until every rank
    joined), then build its share of the engine. Returns (engine, the ranks' channel)."""
    par, sync = join_group(info, host, port, engine_cfg.device)
    return build_engine(engine_cfg, spec, par), sync


def _follower(rank: int, tp: int, port: int, engine_cfg: EngineConfig,
              spec: SpecConfig | None) -> None:
    try:
        follow(*join_rank(RankInfo(rank=rank, tp=tp), HOST, port, engine_cfg, spec))
    finally:
        leave_group()


@dataclass
class TPEngine:
    """Rank 0's engine (`engine`, for one EngineLoop) and the follower processes it owns."""

    engine: LockstepEngine
    procs: list

    def close(self, timeout_s: float = 30.0) -> bool:
        """After the loop driving `engine` stopped: release the followers, wait for them, leave
        the process group. Returns False where a rank died: the group is then left as it is,
        since tearing down a gloo group whose peer is gone can abort the process
        (std::terminate from its threads), and the caller should end the process with
        `os._exit` so that no finaliser tears it down either."""
        self.engine.close()
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                log.warning("tp rank process %d did not stop; killing it", p.pid)
                p.kill()
        if self.engine.broken:
            log.warning("a TP rank died: its process group is not torn down")
            return False
        leave_group()
        return True


def launch(engine_cfg: EngineConfig, spec: SpecConfig | None, tp: int) -> TPEngine:
    """Spawn ranks 1..tp-1, join them as rank 0 and build this rank's engine."""
    import socket

    if tp < 2:
        raise ValueError(f"tp: a TP engine needs at least 2 ranks, got {tp}")
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower, name=f"tandem-tp-rank{r}", daemon=True,
                         args=(r, tp, port, rank_config(engine_cfg, r), spec))
             for r in range(1, tp)]
    for p in procs:
        p.start()
    try:
        engine, sync = join_rank(RankInfo(rank=0, tp=tp), HOST, port,
                                 rank_config(engine_cfg, 0), spec)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return TPEngine(engine=LockstepEngine(engine, sync), procs=procs)
