"""`CompatInfo`: what prefill and decode must agree on before any request moves
(docs/architecture.md, "Compatibility at handshake"), its digest, and the field-by-field check
that names every difference.

The check raises `TransferError(HANDSHAKE)` (errors.py). A differing `tp_size` alone is a valid
deployment when the KV heads re-slice (reslice.py): both sides name the model's `num_kv_heads` and
each side's heads split (or replicate) evenly over its ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from tandem.kvtransfer.errors import ErrorKind, TransferError


@dataclass(frozen=True, slots=True, kw_only=True)
class CompatInfo:
    model: str  # target model id/path digest the worker loaded
    dtype: str  # KV dtype, e.g. "bfloat16"
    page_size: int  # tokens per KV page
    kv_layout: str  # byte layout inside a page, e.g. "NHD" (tokens, heads, head_dim)
    tp_size: int
    tp_rank: int  # with equal TP sizes, prefill rank r pairs with decode rank r only
    draft_model: str  # "" when no draft
    draft_hidden_size: int  # 0 when no draft
    topk: int  # draft top-k carried in the seed (1 = chain)
    feature_layers: tuple[int, ...]  # target layers whose features feed the draft (EAGLE-3)
    # The model's KV heads (all ranks together); 0 = not stated, then only equal TP sizes pair.
    num_kv_heads: int = 0
    # The draft head's KV on this rank: "sliced" like the target's (a head sharded over TP),
    # "all" its heads (TP 1, or replicated); "" = not stated (older peers: not checked).
    draft_kv: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        for name in ("page_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CompatInfo.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"CompatInfo.tp_rank {self.tp_rank} not in [0, {self.tp_size})")

    def to_wire(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> CompatInfo:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def digest(self) -> str:
        """16 hex chars over every field (canonical JSON), for logs and quick equality."""
        blob = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def differences(self, other: CompatInfo) -> list[tuple[str, object, object]]:
        """(field, self value, other value) for every differing field, in declaration order."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def check_compat(
    local: CompatInfo, remote: CompatInfo, *, local_role: str, remote_role: str
) -> None:
    """Raise unless `local` and `remote` may exchange KV. The message names each differing field
    with both values, e.g. "dtype: prefill='bfloat16' decode='float16'"."""
    if local.digest() == remote.digest():
        return
    diffs = local.differences(remote)
    tp_differs = local.tp_size != remote.tp_size
    # With different TP sizes, rank pairing is a re-slicing question, not a mismatch; so is
    # the draft KV's layout (checked below).
    soft = ({"tp_size", "tp_rank"} if tp_differs else set()) | {"draft_kv"}
    hard = [d for d in diffs if d[0] not in soft]
    if hard:
        parts = [f"{name}: {local_role}={a!r} {remote_role}={b!r}" for name, a, b in hard]
        raise TransferError(ErrorKind.HANDSHAKE,
                            "incompatible peers, refused before any request: " + "; ".join(parts))
    # The draft's KV re-slices like the target's when both sides shard the head, or copies
    # whole where a side holds all of it with TP 1; a replicated head on several ranks
    # against a sharded one has no pairing (TANDEM_SHARD_DRAFT differs between the sides).
    for a, b, a_role, b_role in ((local, remote, local_role, remote_role),
                                 (remote, local, remote_role, local_role)):
        if a.draft_kv == "sliced" and b.draft_kv == "all" and b.tp_size > 1:
            raise TransferError(
                ErrorKind.HANDSHAKE,
                f"draft_kv: {a_role}='sliced' (tp_size {a.tp_size}) {b_role}='all' (tp_size "
                f"{b.tp_size}): the draft head is sharded over TP on one side and replicated on "
                "the other (set TANDEM_SHARD_DRAFT alike on both)")
    if not tp_differs:
        return
    # Only the TP layout differs: legal exactly when the KV heads re-slice between the sizes.
    from tandem.kvtransfer.reslice import reslice_problem

    why = ("num_kv_heads is not stated by both sides" if not local.num_kv_heads
           else reslice_problem(local.num_kv_heads, *((local.tp_size, remote.tp_size)
                                                      if local_role == "prefill"
                                                      else (remote.tp_size, local.tp_size))))
    if why:
        raise TransferError(ErrorKind.HANDSHAKE,
                            f"tp_size: {local_role}={local.tp_size} {remote_role}={remote.tp_size}"
                            f" cannot re-slice KV heads ({why})")
