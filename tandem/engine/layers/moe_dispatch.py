"""All-to-all token dispatch for expert-parallel MoE: each token row travels to the EP ranks that
hold its top-k experts, and the expert outputs travel back (`all_to_all_single`), instead of
every rank running every token through its own experts and all-reducing (the default,
"allreduce", which stays as the oracle).

Two variants, both exact (the same expert rows, summed by the caller in one fixed order):

- "alltoall" (variable splits): exactly the routed rows cross the wire. `all_to_all_single`
  takes its split sizes as host ints, so each MoE layer reads the exchanged counts once
  (SYNC): meant for prefill-sized batches.
- "alltoall_padded" (fixed capacity): every rank sends `capacity` rows to every rank, where
  capacity = (the most tokens any rank brings) * top_k, so no token is ever dropped even when
  all of them pick one rank's experts. Padding rows carry local expert id -1; the ids (the
  counts, in effect) are exchanged on the device and never reach the host. Every buffer's
  shape depends only on (capacity, ep, H): capturable in a CUDA graph per decode batch size.

Layout on the source rank, A = T * k assignments (assignment a = token a // k, top-k slot
a % k): dest[a] = expert[a] // experts_per_rank; assignments sorted by dest (stable) leave in
rank order. The receiver runs its experts on the rows in the order they came and sends them
back in that order with the splits swapped, so the source un-permutes with the index it
permuted with. Routing weights never travel: the source applies them to the returned rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.parallel import ParallelGroup


def even_counts(total: int, parts: int) -> tuple[int, ...]:
    """`total` rows split over `parts` ranks, the first `total % parts` ranks one row more
    (host ints: a rank may get 0 rows, e.g. a batch of 1 over 2 ranks)."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if r < extra else 0) for r in range(parts))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Dispatched:
    """The rows this rank received for its experts, and how to send its own rows' results
    back. Built by `AllToAllDispatcher.dispatch`, consumed once by `combine`."""

    rows: torch.Tensor  # [N, H] token rows for this rank's experts (N = sum of recv splits,
    #                     or ep * capacity padded)
    local_expert: torch.Tensor  # [N] int64 index into this rank's experts; -1 on padding rows
    order: torch.Tensor  # [A] int64 assignment index of each sent row, in send order
    send_slot: torch.Tensor | None  # [A] int64 padded: send-buffer row of each sent row
    send_splits: tuple[int, ...] | None  # variable: rows sent to each rank (host)
    recv_splits: tuple[int, ...] | None  # variable: rows received from each rank (host)


class AllToAllDispatcher:
    """Moves token rows between the ranks of `ep`, rank r holding experts
    [r * experts_per_rank, (r + 1) * experts_per_rank). Stateless between forwards; owns no
    buffer (a CUDA-graph runner would own the padded ones)."""

    def __init__(self, ep: ParallelGroup, experts_per_rank: int, padded: bool) -> None:
        self.ep, self.experts_per_rank, self.padded = ep, experts_per_rank, padded

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, capacity: int) -> Dispatched:
        """x [T, H] this rank's token rows; experts [T, k] int64 global expert ids; capacity:
        padded rows per destination rank (>= T * k on every rank; unused when variable)."""
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [A] global expert of each assignment
        dest = torch.div(flat, self.experts_per_rank, rounding_mode="floor")  # [A] owner rank
        order = torch.argsort(dest, stable=True)  # [A] assignments grouped by owner rank
        sent_rows = x[torch.div(order, k, rounding_mode="floor")]  # [A, H] one row per send
        local = (flat - dest * self.experts_per_rank)[order]  # [A] expert index at the owner
        # [ep] int64 rows for each rank; scatter_add, not bincount, which sizes its output from
        # a device read on CUDA
        send_counts = torch.zeros(self.ep.size, dtype=torch.int64, device=dest.device)
        send_counts.scatter_add_(0, dest, torch.ones_like(dest))
        if self.padded:
            return self._dispatch_padded(sent_rows, local, order, dest[order], send_counts,
                                         capacity)
        return self._dispatch_variable(sent_rows, local, order, send_counts)

    def _dispatch_variable(
        self, sent_rows: torch.Tensor, local: torch.Tensor, order: torch.Tensor,
        send_counts: torch.Tensor,
    ) -> Dispatched:
        recv_counts = torch.empty_like(send_counts)  # [ep] int64
        _all_to_all(self.ep, recv_counts, send_counts)
        # SYNC: one host read per MoE layer -- all_to_all_single needs host split sizes; the
        # padded variant is the one without it (decode, CUDA graphs).
        both = torch.cat([send_counts, recv_counts]).tolist()
        send, recv = tuple(both[: self.ep.size]), tuple(both[self.ep.size :])
        rows = sent_rows.new_empty((sum(recv), sent_rows.shape[1]))  # [N, H]
        _all_to_all(self.ep, rows, sent_rows, recv, send)
        ids = local.new_empty(sum(recv))  # [N] int64
        _all_to_all(self.ep, ids, local, recv, send)
        return Dispatched(rows=rows, local_expert=ids, order=order, send_slot=None,
                          send_splits=send, recv_splits=recv)

    def _dispatch_padded(
        self, sent_rows: torch.Tensor, local: torch.Tensor, order: torch.Tensor,
        sorted_dest: torch.Tensor, send_counts: torch.Tensor, capacity: int,
    ) -> Dispatched:
        num_assign = sent_rows.shape[0]
        if num_assign > capacity:  # host ints: shapes, never a device read
            raise ValueError(f"moe capacity {capacity} < {num_assign} routed rows on one rank")
        starts = torch.cumsum(send_counts, 0) - send_counts  # [ep] first sorted row per rank
        pos = torch.arange(num_assign, device=local.device) - starts[sorted_dest]  # [A]
        slot = sorted_dest * capacity + pos  # [A] row in the send buffer
        width = self.ep.size * capacity
        send = sent_rows.new_zeros((width, sent_rows.shape[1]))  # [ep * C, H]
        send.index_copy_(0, slot, sent_rows)
        send_ids = local.new_full((width,), -1)  # [ep * C] int64, -1 = padding
        send_ids.index_copy_(0, slot, local)
        rows = torch.empty_like(send)  # [ep * C, H]: C rows from each source rank
        _all_to_all(self.ep, rows, send)
        ids = torch.empty_like(send_ids)  # [ep * C] int64
        _all_to_all(self.ep, ids, send_ids)
        return Dispatched(rows=rows, local_expert=ids, order=order, send_slot=slot,
                          send_splits=None, recv_splits=None)

    def combine(self, y: torch.Tensor, sent: Dispatched) -> torch.Tensor:
        """y [N, H]: expert outputs for `sent.rows` (same order; padding rows anything) ->
        [A, H] this rank's assignments' outputs, in assignment order (token-major, slot)."""
        num_assign = sent.order.shape[0]
        if sent.send_slot is None:
            assert sent.send_splits is not None and sent.recv_splits is not None
            back = y.new_empty((num_assign, y.shape[1]))  # [A, H] in send order
            _all_to_all(self.ep, back, y.contiguous(), sent.send_splits, sent.recv_splits)
        else:
            padded_back = torch.empty_like(y)  # [ep * C, H] laid out like the send buffer
            _all_to_all(self.ep, padded_back, y.contiguous())
            back = padded_back[sent.send_slot]  # [A, H] in send order
        out = torch.empty_like(back)  # [A, H]
        out.index_copy_(0, sent.order, back)
        return out


def _all_to_all(
    ep: ParallelGroup, out: torch.Tensor, inp: torch.Tensor,
    out_splits: tuple[int, ...] | None = None, in_splits: tuple[int, ...] | None = None,
) -> None:
    """`all_to_all_single` over ep (equal splits when none are given)."""
    import torch.distributed as dist

    dist.all_to_all_single(out, inp, list(out_splits) if out_splits is not None else None,
                           list(in_splits) if in_splits is not None else None, group=ep.handle)
