"""The prefill -> decode hand-off of one request: the EAGLE seed as bytes (what travels in the
transfer's aux slot) and the value a prefill engine hands to its transfer layer.

Seed layout (little-endian):
    header  <4sIIqqII   magic b"TSD1", version, topk, num_cached, last_token, hidden_size,
                         len(generator state)
    topk_ids    int64 [topk]
    topk_logp   float32 [topk]
    hidden      float32 [hidden_size]
    gen_state   uint8 [n]   the request's sampling generator state (empty when greedy), so the
                            decode side continues the exact random stream colocated would use
  then, only when the request asks for logprobs, the first token's (messages/logprobs.py), so
  the decode side's first output carries them like the prefill worker's `FirstToken`:
    logprob     <Iif        magic b"TLP1" as u32, top_logprobs k, the first token's logprob
    top_ids     int64 [k]
    top_logp    float32 [k]
A payload that ends after gen_state has no logprobs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from tandem.messages import MAX_TOP_LOGPROBS, TokenLogprob
from tandem.spec.phases import DraftSeed

_MAGIC = b"TSD1"
_HEADER = struct.Struct("<4sIIqqII")
_LP_MAGIC = struct.unpack("<I", b"TLP1")[0]
_LP_HEADER = struct.Struct("<Iif")


class SeedFormatError(ValueError):
    """Bytes that are not a seed (wrong magic, truncated)."""


def encode_seed(seed: DraftSeed, generator_state: bytes = b"",
                first_logprob: TokenLogprob | None = None) -> bytes:
    ids = seed.topk_ids.detach().to("cpu", torch.int64).numpy()
    logp = seed.topk_logp.detach().to("cpu", torch.float32).numpy()
    hidden = seed.hidden.detach().to("cpu", torch.float32).numpy()
    header = _HEADER.pack(_MAGIC, 1, ids.shape[0], seed.num_cached, seed.last_token,
                          hidden.shape[0], len(generator_state))
    out = header + ids.tobytes() + logp.tobytes() + hidden.tobytes() + generator_state
    if first_logprob is not None:
        lp = first_logprob
        out += (_LP_HEADER.pack(_LP_MAGIC, len(lp.top_ids), lp.logprob)
                + np.asarray(lp.top_ids, np.int64).tobytes()
                + np.asarray(lp.top_logprobs, np.float32).tobytes())
    return out


def decode_seed(buf: bytes, device: torch.device, dtype: torch.dtype
                ) -> tuple[DraftSeed, bytes]:
    """-> (seed with hidden in `dtype` on `device`, generator state bytes)."""
    if len(buf) < _HEADER.size:
        raise SeedFormatError(f"seed: {len(buf)} bytes is shorter than its header")
    magic, version, topk, num_cached, last, hidden_size, gen_len = _HEADER.unpack_from(buf)
    if magic != _MAGIC or version != 1:
        raise SeedFormatError(f"seed: bad magic/version {magic!r}/{version}")
    need = _HEADER.size + topk * 12 + hidden_size * 4 + gen_len
    if len(buf) < need:
        raise SeedFormatError(f"seed: {len(buf)} bytes, header says {need}")
    off = _HEADER.size
    ids = np.frombuffer(buf, np.int64, topk, off)
    off += topk * 8
    logp = np.frombuffer(buf, np.float32, topk, off)
    off += topk * 4
    hidden = np.frombuffer(buf, np.float32, hidden_size, off)
    off += hidden_size * 4
    seed = DraftSeed(
        num_cached=num_cached, last_token=last,
        topk_ids=torch.from_numpy(ids.copy()).to(device),
        topk_logp=torch.from_numpy(logp.copy()).to(device),
        hidden=torch.from_numpy(hidden.copy()).to(device=device, dtype=dtype),
    )
    return seed, bytes(buf[off : off + gen_len])


def decode_first_logprob(buf: bytes) -> TokenLogprob | None:
    """The first token's logprob from an encoded seed (None: the request did not ask). The
    seed's own fields are checked by `decode_seed`."""
    _, _, topk, _, last, hidden_size, gen_len = _HEADER.unpack_from(buf)
    off = _HEADER.size + topk * 12 + hidden_size * 4 + gen_len
    if len(buf) == off:
        return None
    if len(buf) < off + _LP_HEADER.size:
        raise SeedFormatError(f"seed: {len(buf) - off} trailing bytes are not a logprob")
    magic, k, logprob = _LP_HEADER.unpack_from(buf, off)
    off += _LP_HEADER.size
    if magic != _LP_MAGIC or not 0 <= k <= MAX_TOP_LOGPROBS or len(buf) != off + k * 12:
        raise SeedFormatError(f"seed: bad logprob section (magic {magic:#x}, k {k}, "
                              f"{len(buf) - off} bytes)")
    ids = np.frombuffer(buf, np.int64, k, off)
    top = np.frombuffer(buf, np.float32, k, off + k * 8)
    return TokenLogprob(token_id=last, logprob=logprob, top_ids=tuple(ids.tolist()),
                        top_logprobs=tuple(top.tolist()))


def seed_nbytes(topk: int, hidden_size: int, generator_state: int = 5056) -> int:
    """Upper bound of an encoded seed (CPU mt19937 generator state is 5056 bytes), with the
    first token's logprobs at their largest."""
    return (_HEADER.size + topk * 12 + hidden_size * 4 + generator_state + _LP_HEADER.size
            + MAX_TOP_LOGPROBS * 12)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PrefillHandoff:
    """A prefilled request, ready to move to a decode worker. Its pages stay allocated on the
    prefill side until the transfer layer reports the transfer done (then `free_pages`)."""

    req_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    seed: DraftSeed
    page_ids: tuple[int, ...]  # prefill-side pages holding the prompt's target and draft KV
    generator_state: bytes  # empty when greedy
    finished: bool  # the first token already ended the request (nothing to transfer)
    first_text: str = ""  # the first token's text (what the client sees when finished here)
    # False when the first token completed a stop string: the request ended here and the client
    # gets the text before the stop string, but not the token (docs/architecture.md, "Request
    # semantics").
    first_token_returned: bool = True
    finish_reason: str | None = None  # "stop" | "length" when finished here
    # The first token's logprob when the request asks (and the token is returned)
    first_logprob: TokenLogprob | None = None

    def seed_bytes(self) -> bytes:
        return encode_seed(self.seed, self.generator_state, self.first_logprob)


def restore_generator(params, generator_state: bytes, device: torch.device
                      ) -> torch.Generator | None:
    """A handed-in request's sampling generator: the prefill side's state, so a seeded request
    goes on drawing the stream it started there; None for a greedy request, and for an
    unseeded one without state (it draws with the other unseeded rows from the shared RNG,
    as in LLMEngine.add_request)."""
    if params.greedy or not (generator_state or params.seed is not None):
        return None
    gen = torch.Generator(device=device)
    if generator_state:
        gen.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
    else:
        gen.manual_seed(params.seed)
    return gen
