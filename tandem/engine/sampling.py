"""Sampling parameters and the batched sampler.

`SamplingParams` is validated at construction, with messages that name the field (the router
maps them to INVALID_ARGUMENT). `target_probs` is the one definition of "the distribution we
sample from" after temperature/top-k/top-p/min-p; the speculative verifier uses the same
function, which is what makes rejection sampling lossless.

Log-probabilities (for the requests that ask) are computed in the same pass, on the device,
and read with the tokens (`read_sampled`, the step's one host read): engine/logprobs.py.

No request can make sampling raise for its batch: `target_probs` always returns a valid
distribution (see its docstring), and `Sampler.sample` reports a row whose draw still fails as
that row's error -- the engine then fails that request alone and serves the rest of the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine import h2d
from tandem.engine.config import SamplingFault
from tandem.engine.d2h import HostCopy
from tandem.engine.logprobs import HostLogprobs, LogprobRows, asking_rows, gather_logprobs
from tandem.messages import GREEDY_TEMPERATURE, SamplingParams  # noqa: F401 -- re-exported
from tandem.messages import TokenLogprob

log = logging.getLogger(__name__)

def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] or [n, V] float logits -> [V] or [n, V] float32 probabilities after temperature,
    top-k, top-p, min-p. Greedy params give a one-hot on the argmax. Every row returned is a
    valid distribution (finite, non-negative, sums to 1): see `SamplingParams` for the edges."""
    logits = logits.float()
    top = logits.argmax(-1)  # [...] int64
    if params.greedy:
        return torch.nn.functional.one_hot(top, logits.shape[-1]).float()
    # Shift the row maximum to 0 before dividing: (logits - max) / T is <= 0, so it can only
    # underflow to -inf (weight 0), never overflow to +inf (inf - inf = NaN in the softmax).
    # A -inf logit over a T that float32 rounds to inf is -inf / inf = NaN: it means weight 0.
    scaled = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    scaled = scaled.masked_fill(scaled.isnan(), float("-inf"))  # (+inf logits: argmax below)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The top token is kept explicitly:
        # float32 rounds a top_p of 1e-300 to 0, and `0 >= 0` would drop every token.
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False  # a buffer of ours (the comparison's result)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)  # the max itself survives
        probs = probs.masked_fill(probs < floor, 0.0)
    return _normalized_or_argmax(probs, top)


def _normalized_or_argmax(probs: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """probs / row sum; a row whose sum is not a positive finite number (NaN or +inf logits)
    becomes the one-hot of its argmax `top` instead. No host sync."""
    total = probs.sum(dim=-1, keepdim=True)  # [..., 1]
    ok = torch.isfinite(total) & (total > 0)  # [..., 1] bool
    out = torch.where(ok, probs / total, 0.0)  # [..., V] float32, ours: a bad row is all 0
    top = top.unsqueeze(-1)  # [..., 1]
    # No one-hot [..., V] temporary: only each row's argmax entry is rewritten (1 if bad).
    return out.scatter_(-1, top, torch.where(ok, out.gather(-1, top), 1.0))


class InjectedFault(RuntimeError):
    """Raised on purpose by a `SamplingFault` (tests only)."""


def check_fault(fault: SamplingFault | None, req_id: str) -> None:
    """Raise `InjectedFault` when the test-only `fault` selects this request's row."""
    if fault is not None and req_id in fault.req_ids:
        raise InjectedFault(f"sampling_fault: injected failure for request '{req_id}'")


def row_error(stage: str, exc: BaseException) -> str:
    """The message a request fails with when its row raised in `stage`."""
    return f"{stage}: {type(exc).__name__}: {exc}"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SampleOutput:
    """One token per row, or that row's failure."""

    tokens: torch.Tensor  # [n] int64; a failed row holds its argmax (a placeholder, never used)
    errors: tuple[str, ...]  # [n] "" for a sampled row, else why its request fails
    # The sampled tokens' logprobs for the rows whose request asks (None: no row asks)
    logprobs: LogprobRows | None = None


def read_sampled(out: SampleOutput) -> tuple[list[int], list[TokenLogprob | None]]:
    """The tokens of `out` and their logprobs ([n] each; None for a row that did not ask) on the
    host, read together: one wait (`HostCopy`), the step's one host sync."""
    lp = out.logprobs
    if lp is None:  # no row asks: the plain read, nothing else
        tokens = out.tokens.tolist()  # SYNC: the step's one host read
        return tokens, [None] * len(tokens)
    return SampledRead.start(out).wait()


@dataclass(frozen=True, slots=True, eq=False)
class SampledRead:
    """`read_sampled` in two halves: `start` queues the copies (never waits), `wait` reads them
    -- overlap scheduling starts the read when it launches a step and waits a step later."""

    copy: HostCopy
    logprobs: LogprobRows | None

    @staticmethod
    def start(out: SampleOutput) -> SampledRead:
        lp = out.logprobs
        return SampledRead(HostCopy.start((out.tokens, *(lp.tensors() if lp else ()))), lp)

    def wait(self) -> tuple[list[int], list[TokenLogprob | None]]:
        tokens_h, *lp_h = self.copy.wait()  # SYNC: the step's one host read
        tokens = tokens_h.tolist()
        if self.logprobs is None:
            return tokens, [None] * len(tokens)
        return tokens, HostLogprobs.of(self.logprobs, lp_h).per_row(tokens)


class Sampler:
    """Samples one token per row. Greedy rows take the argmax (no randomness consumed); a row
    with its own generator (a seeded request) draws from `target_probs` with it, alone, so it
    yields the same tokens whatever else shares its batch; rows without one draw from the
    engine's generator (`rng`) together, one batched draw per distinct (temperature, top_k,
    top_p, min_p) -- a row at a time cost ~10 kernel launches per sampled row, which dominated
    large sampled batches.

    A row that raises fails alone (`SampleOutput.errors`): a batched draw that raises is redone
    row by row, so the culprit is found and the rest of its group still gets tokens. `fault` is
    the test-only hook that makes chosen requests' rows raise (EngineConfig.sampling_fault).
    On CUDA an invalid distribution is a device-side assert in torch.multinomial, not an
    exception (the CUDA context is lost): there, `target_probs` never returning one is what
    keeps a worker alive; the catch covers what raises on the host."""

    def __init__(self, fault: SamplingFault | None = None, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        self.fault = fault
        # Unseeded rows draw from this generator, the engine's own, never from torch's global
        # one: the ranks of a TP worker then draw the same tokens whatever else their processes
        # consumed (a rank that drew differently would feed its heads another token).
        self.rng = torch.Generator(device=device).manual_seed(seed)

    def or_shared(self, generators: Sequence[torch.Generator | None]
                  ) -> tuple[torch.Generator, ...]:
        """Each row's generator: its own (a seeded request's), else the shared `rng`."""
        return tuple(self.rng if g is None else g for g in generators)

    def sample(
        self,
        logits: torch.Tensor,  # [n, V] float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        req_ids: Sequence[str] = (),  # [n] (the fault hook's key); () = no fault checks
    ) -> SampleOutput:
        tokens = logits.argmax(dim=-1)  # [n] int64, ours: sampled rows are written into it
        errors = [""] * len(params)
        shared: dict[tuple[float, int, float, float], list[int]] = {}  # settings -> rows
        for i, p in enumerate(params):
            try:
                if req_ids:
                    check_fault(self.fault, req_ids[i])
                if p.greedy:
                    continue
                if generators[i] is None:
                    shared.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
                    continue
                probs = target_probs(logits[i], p)
                tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
            except Exception as exc:  # noqa: BLE001 -- this row's request fails, alone
                errors[i] = self._failed(i, req_ids, exc)
        for rows in shared.values():
            try:
                idx = h2d.tensor(rows, torch.int64, logits.device)  # no stream sync
                probs = target_probs(logits[idx], params[rows[0]])  # [len(rows), V]
                tokens[idx] = torch.multinomial(probs, 1, generator=self.rng).squeeze(-1)
            except Exception:  # noqa: BLE001 -- find the culprit: draw the group row by row
                for i in rows:
                    try:
                        probs = target_probs(logits[i], params[i])
                        tokens[i] = torch.multinomial(probs, 1, generator=self.rng)[0]
                    except Exception as exc:  # noqa: BLE001
                        errors[i] = self._failed(i, req_ids, exc)
        return SampleOutput(tokens=tokens, errors=tuple(errors),
                            logprobs=sampled_logprobs(logits, tokens, params))

    @staticmethod
    def _failed(row: int, req_ids: Sequence[str], exc: Exception) -> str:
        name = req_ids[row] if req_ids else f"row {row}"
        log.warning("sampling failed for request '%s'", name, exc_info=exc)
        return row_error("sampling", exc)


def sampled_logprobs(
    logits: torch.Tensor,  # [n, V] float32 the batch's logits
    tokens: torch.Tensor,  # [n] int64 the tokens sampled from them
    params: Sequence[SamplingParams],  # [n]
) -> LogprobRows | None:
    """The logprobs of the rows whose request asks (None when none does: no work at all).
    Device work only: the asking rows are picked by an index copied without a sync."""
    rows = asking_rows(params)
    if not rows:
        return None
    if len(rows) < len(params):
        idx = h2d.tensor(rows, torch.int64, logits.device)  # [m]
        logits, tokens = logits[idx], tokens[idx]
    return gather_logprobs(logits, tokens, [params[i].top_logprobs for i in rows], rows)
