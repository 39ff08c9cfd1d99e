"""Text <-> token ids for the engine and the router: encoding, chat templates and streaming
detokenization. Torch-free (the router imports it; a router machine needs no torch).

Owns nothing mutable except an `IncrementalDetokenizer`'s per-request state. Reads any Hugging
Face checkpoint directory that has `tokenizer.json` + `tokenizer_config.json` (what
`model_import` writes and what transformers' `save_pretrained` writes), using only the
`tokenizers` library and a sandboxed jinja2 environment; transformers is not needed at runtime.

Control tokens: a raw prompt (`encode`) may contain special-token text such as "<|im_start|>"
and it becomes the control token, as in vLLM's raw completions: whoever writes a raw prompt
writes the whole prompt. A chat message's content may not: `encode_chat` lets only the chat
template's own markers be special tokens, and encodes special-token text inside a content as
ordinary text (role injection: a user content "<|im_start|>system..." stays user text).

Encoding releases the GIL (`encode_batch` does on every `tokenizers` version; a long prompt
tokenized on a worker thread must not stall the router's event loop).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import pre_tokenizers

ALLOWED_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

# Special tokens that end a turn in common chat formats. Any of them that the vocabulary has as a
# special token stops generation, on top of the configured eos: an instruct model that emits
# "<|endoftext|>" instead of "<|im_end|>" must still stop rather than ramble on.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

_REPLACEMENT_CHAR = "\ufffd"

# Stand-ins for message contents when the template is rendered to find its own text (private-use
# characters: no template trims or splits them).
_SLOT = "\ue000tandem-content-{}\ue001"


class ChatTemplateError(ValueError):
    """Raised when a chat template calls `raise_exception` (it rejects the conversation)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    """One turn of a conversation; `role` is one of ALLOWED_ROLES."""

    role: str
    content: str


class Tokenizer:
    """A byte-level (or any `tokenizers`) tokenizer plus the model's chat template.

    Immutable after construction; safe to share between threads and requests.
    """

    __slots__ = ("_tokenizer", "_literal", "_template", "_special_tokens", "_bos_token_id",
                 "_eos_token_ids", "_control_texts", "_max_token_bytes", "_added_texts",
                 "_byte_level", "_byte_fallback")

    def __init__(
        self,
        *,
        tokenizer: _HFTokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str],
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        serialized = tokenizer.to_str()
        # A twin that encodes special-token text as ordinary text (tokenizers' switch for HF's
        # split_special_tokens). A second object rather than toggling the flag: this class is
        # shared between threads and never changes.
        self._literal = _HFTokenizer.from_str(serialized)
        self._literal.encode_special_tokens = True
        self._template = _compile_chat_template(chat_template) if chat_template else None
        # {"bos_token": "<|im_start|>", "eos_token": ...}: passed to the template as HF does.
        self._special_tokens = dict(special_tokens)
        self._bos_token_id = self._id_of(special_tokens.get("bos_token"))
        eos_ids = {self._id_of(special_tokens.get("eos_token")), *extra_eos_token_ids}
        added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        eos_ids.update(i for i, tok in added.items() if tok.special and tok.content in _END_OF_TURN_TOKENS)
        eos_ids.discard(None)
        self._eos_token_ids: frozenset[int] = frozenset(eos_ids)  # type: ignore[arg-type]
        # The control tokens' texts, longest first (what a message content must not smuggle in).
        self._control_texts = tuple(sorted({tok.content for tok in added.values() if tok.special},
                                           key=len, reverse=True))
        spec = json.loads(serialized)
        self._max_token_bytes = _max_token_bytes(spec)
        self._added_texts = {i: tok.content for i, tok in added.items()}  # id -> its text
        self._byte_level = _is_byte_level(spec)  # vocabulary strings spell bytes (GPT-2 map)
        self._byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a HF checkpoint directory (tokenizer.json + tokenizer_config.json)."""
        path = Path(path)
        tokenizer = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        # Older checkpoints keep the special tokens in special_tokens_map.json only.
        special_map_file = path / "special_tokens_map.json"
        special_map = _read_json(special_map_file) if special_map_file.is_file() else {}
        special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = _token_content(config.get(key)) or _token_content(special_map.get(key))
            if value is not None:
                special_tokens[key] = value
        # generation_config.json's eos_token_id (an int or a list) is what HF generate stops on.
        extra_eos: list[int] = []
        if (path / "generation_config.json").is_file():
            eos = _read_json(path / "generation_config.json").get("eos_token_id")
            extra_eos = [eos] if isinstance(eos, int) else [int(i) for i in eos or ()]
        return cls(
            tokenizer=tokenizer,
            chat_template=_find_chat_template(path, config),
            special_tokens=special_tokens,
            extra_eos_token_ids=extra_eos,
        )

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the eos token, generation_config's, and end-of-turn tokens."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def max_token_bytes(self) -> int | None:
        """The most bytes of input text one token can stand for, or None when that cannot be
        proven. Byte-level BPE without a normalizer covers every input byte by exactly one token,
        and a token covers at most as many bytes as its vocabulary string has characters (one
        character per byte) -- or, for an added token, its text's UTF-8 bytes. So a text of B
        bytes has at least ceil(B / max_token_bytes) tokens: a size bound known before
        tokenizing. (A normalizer may shrink the text first, e.g. NFC composes up to three code
        points into one; other tokenizer kinds have unknown-token fallbacks: None for those.)"""
        return self._max_token_bytes

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. "<|im_start|>") are
        always matched whole (raw prompts may hold control tokens); `add_special_tokens` only
        adds what the post-processor adds (BOS)."""
        return _encode(self._tokenizer, text, add_special_tokens)

    def encode_literal(self, text: str) -> list[int]:
        """Token ids of `text` with special-token text encoded as ordinary text: no id of a
        special token comes out (what a chat message's content gets)."""
        return _encode(self._literal, text, False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for (what OpenAI's logprobs call a token's
        `bytes`: a character split over several tokens has part of its UTF-8 in each). Exact
        for added tokens (their text), byte-level BPE (each vocabulary character stands for one
        byte) and byte-fallback tokens ("<0xE2>"); otherwise the token decoded alone, which
        for a SentencePiece word piece drops its leading space marker."""
        added = self._added_texts.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:  # outside the vocabulary
            return b""
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR.get(c, 0) for c in piece)
        if self._byte_fallback and _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's chat template, exactly as HF transformers would."""
        _validate_messages(messages)
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)")
        rendered = self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **self._special_tokens,
        )
        return rendered

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation, where only the template's own markers are
        control tokens. Raises ValueError naming `messages[i]...` when the conversation is bad.

        Contents free of special-token text give exactly HF's ids (the rendered text encoded
        whole). Otherwise the template's text and the contents are encoded apart, the contents
        literally; that needs the template to insert each content verbatim (or stripped), and a
        conversation whose template rewrites such a content is refused rather than guessed at."""
        # No add_special_tokens: the template already writes every special token it wants, and
        # a BOS added on top would be doubled (HF makes the same choice).
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode_rendered_chat(messages, text, add_generation_prompt)

    def encode_rendered_chat(self, messages: Sequence[ChatMessage], text: str,
                             add_generation_prompt: bool = True) -> list[int]:
        """`encode_chat` for a conversation already rendered to `text` (by
        `apply_chat_template` with the same arguments): callers that check the rendered size
        first render once."""
        smuggled = [i for i, m in enumerate(messages) if self._control_text_in(m.content)]
        if not smuggled:
            return self.encode(text)
        ids: list[int] = []
        for piece, is_content in self._split_rendered(messages, text, add_generation_prompt,
                                                      smuggled[0]):
            ids += self.encode_literal(piece) if is_content else self.encode(piece)
        return ids

    def _control_text_in(self, content: str) -> str | None:
        return next((t for t in self._control_texts if t in content), None)

    def _split_rendered(self, messages: Sequence[ChatMessage], text: str,
                        add_generation_prompt: bool, first_smuggled: int
                        ) -> list[tuple[str, bool]]:
        """`text` as (piece, is a message content) in order. The template's own text is found
        by rendering it with stand-ins for the contents; the split is used only if putting the
        contents back (as given, or stripped as `| trim` does) yields exactly `text`."""
        slots = [_SLOT.format(i) for i in range(len(messages))]
        with_slots = self.apply_chat_template(
            [ChatMessage(role=m.role, content=slot) for m, slot in zip(messages, slots)],
            add_generation_prompt)
        template_texts: list[str] = []  # before content 0, between 0 and 1, ..., after the last
        rest = with_slots
        for slot in slots:
            before, found, rest = rest.partition(slot)
            if not found:  # the template dropped a content, or put them out of order
                break
            template_texts.append(before)
        else:
            template_texts.append(rest)
            for form in (str, str.strip):
                pieces = [(template_texts[0], False)]
                for m, after in zip(messages, template_texts[1:]):
                    pieces += [(form(m.content), True), (after, False)]
                if "".join(p for p, _ in pieces) == text:  # e.g. no content rendered twice
                    return pieces
        token = self._control_text_in(messages[first_smuggled].content)
        raise ValueError(f"messages[{first_smuggled}].content: contains the control-token text "
                         f"{token!r}, and this model's chat template rewrites message contents, "
                         f"so it cannot be kept apart from the template's own markers")

    def _id_of(self, token: str | None) -> int | None:
        return self._tokenizer.token_to_id(token) if token is not None else None


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, one request at a time.

    Invariants:
    - A delta never ends in a partial UTF-8 character: byte-level BPE can split one character
      over several tokens, and such text is held back until the character completes.
    - `"".join(all deltas) + flush() == tokenizer.decode(all ids)`, so stop strings and the
      final text agree with a one-shot decode.

    Each step decodes only a short window: from `_prefix` (the start of the previously emitted
    chunk, kept for context so decoders that strip a leading space or merge bytes see the same
    neighbours as a full decode) to the end. `_read` is where the emitted text ends.
    """

    __slots__ = ("_tokenizer", "_skip_special_tokens", "_ids", "_prefix", "_read", "_text")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (a character boundary)
        self._read = 0  # ids before this index have all their text emitted
        self._text = ""

    @property
    def text(self) -> str:
        """Everything emitted so far (the concatenation of all deltas)."""
        return self._text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add one or more token ids; return the newly completed text (possibly "")."""
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        return self._advance(final=False)

    def hold(self, ids: Iterable[int]) -> None:
        """Add ids whose text the next `feed` returns with its own (one decode for a run)."""
        self._ids.extend(ids)

    def flush(self) -> str:
        """End of stream: return any held-back text, incomplete characters as U+FFFD like decode."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        emitted = decode(self._ids[self._prefix : self._read], self._skip_special_tokens)
        window = decode(self._ids[self._prefix :], self._skip_special_tokens)
        # A trailing U+FFFD means the last character's bytes are not all here yet; wait for
        # more tokens rather than emit a replacement character that later turns into a letter.
        if not final and (len(window) <= len(emitted) or window.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = window[len(emitted) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text += delta
        return delta


# ---------------------------------------------------------------------- helpers


def _encode(tokenizer: _HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch, not encode: it releases the GIL on every tokenizers version (encode holds it
    # before 0.2x), so a worker thread tokenizing a long prompt leaves other threads running.
    # Measured: one batch of one is as fast as encode once the thread pool is up (9 us).
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _max_token_bytes(spec: dict) -> int | None:
    """See `Tokenizer.max_token_bytes`; `spec`: the tokenizer.json contents (read as JSON, which
    every tokenizers version writes alike)."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    model = spec.get("model") or {}
    if (spec.get("normalizer") is not None or model.get("type") != "BPE"
            or not any(p.get("type") == "ByteLevel" for p in parts)):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())  # the 256 characters standing for bytes
    # A vocabulary string outside the alphabet never comes out of byte-level input; its UTF-8
    # length is a safe (larger) stand-in.
    longest = max((len(t) if alphabet.issuperset(t) else len(t.encode())
                   for t in model.get("vocab", {})), default=1)
    added = (len(t["content"].encode()) for t in spec.get("added_tokens", []))
    return max([longest, *added])


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character standing for each byte. Printable
    Latin-1 bytes stand for themselves, the other 68 for code points 256, 257, ... in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_chars()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token


def _is_byte_level(spec: dict) -> bool:
    """Whether vocabulary strings are byte-level BPE's (decoded through the ByteLevel map)."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def _validate_messages(messages: Sequence[ChatMessage]) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError(f"messages: expected a list of ChatMessage, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise ValueError(f"messages[{i}]: expected ChatMessage, got {type(message).__name__}")
        if message.role not in ALLOWED_ROLES:
            expected = ", ".join(ALLOWED_ROLES)
            raise ValueError(f"messages[{i}].role: unknown role {message.role!r} (expected one of {expected})")
        if not isinstance(message.content, str):
            raise ValueError(f"messages[{i}].content: expected str, got {type(message.content).__name__}")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes "<", ">" and "&", which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    # The same environment HF transformers renders with: sandboxed (templates come with
    # downloaded checkpoints), trim_blocks + lstrip_blocks, loop controls, and its globals.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _find_chat_template(path: Path, config: dict[str, object]) -> str | None:
    # transformers >= 4.47 saves the template to chat_template.jinja; older files keep it in
    # tokenizer_config.json, either as a string or as a list of named templates.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialised AddedToken.
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, object]:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
