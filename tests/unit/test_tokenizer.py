"""Tokenizer, chat template and incremental detokenizer, checked against HF transformers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer as HFBackendTokenizer

from tandem.engine.model_import import smollm2_gguf_path
from tandem.tokenizer import ChatMessage, ChatTemplateError, IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:  # transformers is the oracle; import it lazily so collection stays fast
    from transformers import PreTrainedTokenizerBase

# Strings where transformers' GGUF tokenizer and SmolLM2's real pre-tokenizer agree.
STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { x[i] = "y"; }',
    "   leading and trailing spaces   ",
    "\n\n\n  \t \n",
    "price: $1,234.56 on 2024-11-26 at 10:00",
    "héllo wörld, naïve café, Ærøskøbing, ñandú",
    "日本語のテキスト、中文字符和한국어",
    "emoji 🎉🚀 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "Ünïcödé ∑∫√∞ ≠ ≤ ≥ → ← «quotes» „Anführungszeichen“",
    "",
]
# Whitespace runs right before digits: transformers reads `tokenizer.ggml.pre = "smollm"` as plain
# GPT-2 splitting; llama.cpp and SmolLM2's own tokenizer.json split every digit off first.
DIGIT_AFTER_SPACES = ["a  12", "x   1", "  42\n\n\t  7", "2024-11-26  10:00", "col1    col2\n  1    2"]


def _digit_split(text: str) -> list[str]:
    """llama.cpp's first `smollm` pre-tokenizer pass: every \\p{N} character on its own."""
    pieces: list[str] = []
    for ch in text:
        if ch.isnumeric() or not pieces or pieces[-1][-1:].isnumeric():
            pieces.append(ch)
        else:
            pieces[-1] += ch
    return pieces


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def ref_tok() -> PreTrainedTokenizerBase:  # transformers' tokenizer read straight from the GGUF
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# ----------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", STRINGS)
def test_encode_matches_transformers_gguf(tok: Tokenizer, ref_tok: PreTrainedTokenizerBase, text: str) -> None:
    assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", STRINGS + DIGIT_AFTER_SPACES)
def test_encode_splits_digits_like_llama_cpp(tok: Tokenizer, ref_tok: PreTrainedTokenizerBase, text: str) -> None:
    expected = [i for piece in _digit_split(text) for i in ref_tok.encode(piece, add_special_tokens=False)]
    assert tok.encode(text) == expected


def test_digits_after_spaces_keep_the_space_run_whole(tok: Tokenizer, smollm2_dir: Path) -> None:
    backend = HFBackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert [backend.id_to_token(i) for i in tok.encode("a  12")] == ["a", "ĠĠ", "1", "2"]


@pytest.mark.parametrize("text", STRINGS + DIGIT_AFTER_SPACES)
def test_decode_round_trips(tok: Tokenizer, ref_tok: PreTrainedTokenizerBase, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", STRINGS + DIGIT_AFTER_SPACES)
def test_token_bytes_concatenate_to_the_text(tok: Tokenizer, text: str) -> None:
    """Each token's bytes (what logprobs return per token): a character split over several
    byte-level tokens has part of its UTF-8 in each, and together they spell the text."""
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_other_tokenizers() -> None:
    from tokenizers import models

    word = HFBackendTokenizer(models.WordLevel(vocab={"w0": 0, "w1": 1}, unk_token="w0"))
    t = Tokenizer(tokenizer=word, chat_template=None, special_tokens={})
    assert t.token_bytes(1) == b"w1"
    assert t.token_bytes(5) == b""  # outside the vocabulary
    bpe = HFBackendTokenizer(models.BPE(vocab={"<0xE2>": 0, "<0x82>": 1, "a": 2}, merges=[],
                                        byte_fallback=True))
    t = Tokenizer(tokenizer=bpe, chat_template=None, special_tokens={})
    assert [t.token_bytes(i) for i in range(3)] == [b"\xe2", b"\x82", b"a"]


def test_special_tokens_and_properties(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.decode(tok.encode("<|im_start|>assistant\nHi<|im_end|>")) == "assistant\nHi"
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2, 0})  # <|im_end|> (eos) and <|endoftext|>


# ----------------------------------------------------------------------------- chat template

CONVERSATIONS = [
    [ChatMessage(role="user", content="What is 2+2?")],
    [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="Hi!")],
    [
        ChatMessage(role="user", content="Write a haiku about tea."),
        ChatMessage(role="assistant", content="Steam rises, leaves unfurl\nwarmth in a small cup"),
        ChatMessage(role="user", content="Now one about coffee ☕, please."),
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tok: Tokenizer, ref_tok: PreTrainedTokenizerBase, conversation: list[ChatMessage], add_generation_prompt: bool
) -> None:
    dicts = [{"role": m.role, "content": m.content} for m in conversation]
    expected = ref_tok.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = ref_tok.apply_chat_template(dicts, tokenize=True, add_generation_prompt=add_generation_prompt)
    expected_ids = expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids
    assert tok.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == list(expected_ids)


def test_chat_template_sees_special_tokens_and_raise_exception(smollm2_dir: Path) -> None:
    backend = HFBackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    template = (
        "{% if messages[0].role == 'tool' %}{{ raise_exception('tool first: ' + messages[0].content) }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}{{ eos_token }}"
    )
    tok = Tokenizer(tokenizer=backend, chat_template=template, special_tokens=special)
    assert tok.apply_chat_template([ChatMessage(role="user", content="<a&b>")]) == '<|im_start|>"<a&b>"<|im_end|>'
    with pytest.raises(ChatTemplateError, match="tool first: x"):
        tok.apply_chat_template([ChatMessage(role="tool", content="x")])
    no_template = Tokenizer(tokenizer=backend, chat_template=None, special_tokens=special)
    with pytest.raises(ValueError, match="no chat_template"):
        no_template.apply_chat_template([ChatMessage(role="user", content="x")])


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([], r"^messages: must not be empty"),
        ([ChatMessage(role="user", content="a"), ChatMessage(role="bot", content="b")],
         r"^messages\[1\]\.role: unknown role 'bot' \(expected one of system, user, assistant, tool\)"),
        ([ChatMessage(role="user", content=3)],  # type: ignore[arg-type]
         r"^messages\[0\]\.content: expected str, got int"),
        ([{"role": "user", "content": "hi"}], r"^messages\[0\]: expected ChatMessage, got dict"),
    ],
)
def test_bad_messages_name_the_field(tok: Tokenizer, messages: list[ChatMessage], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=pattern):
        tok.encode_chat(messages)


# ----------------------------------------------------------------------------- checkpoint dirs


def test_reads_a_transformers_saved_directory(ref_tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    # transformers 5 saves the template to chat_template.jinja, not tokenizer_config.json.
    ref_tok.save_pretrained(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    for text in STRINGS + DIGIT_AFTER_SPACES:
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)
    dicts = [{"role": m.role, "content": m.content} for m in CONVERSATIONS[1]]
    assert tok.apply_chat_template(CONVERSATIONS[1]) == ref_tok.apply_chat_template(
        dicts, tokenize=False, add_generation_prompt=True
    )
    assert 2 in tok.eos_token_ids and tok.bos_token_id == 1


def test_transformers_reads_the_imported_directory(tok: Tokenizer, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for text in STRINGS + DIGIT_AFTER_SPACES:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    dicts = [{"role": m.role, "content": m.content} for m in CONVERSATIONS[0]]
    assert hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        CONVERSATIONS[0]
    )


# ----------------------------------------------------------------------------- incremental detokenizer


def _stream(tok: Tokenizer, ids: list[int], chunk: int, skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.token_ids == tuple(ids)
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", STRINGS + DIGIT_AFTER_SPACES)
def test_incremental_deltas_concatenate_to_decode(
    tok: Tokenizer, text: str, chunk: int, skip_special_tokens: bool
) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids, chunk, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", STRINGS + DIGIT_AFTER_SPACES + ["ok 🎉 — ünïcödé 中文 ok"])
def test_held_ids_come_with_the_next_feed(tok: Tokenizer, text: str) -> None:
    """A speculative round holds all but the last of its tokens and feeds that one
    (`SpecEngine._commit_row`): the text is what per-token feeding gives, and decode's."""
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas, i, sizes = [], 0, [3, 1, 5, 2]
    while i < len(ids):
        run = ids[i : i + sizes[len(deltas) % 4]]
        detok.hold(run[:-1])
        deltas.append(detok.feed(run[-1]))
        i += len(run)
    deltas.append(detok.flush())
    assert "".join(deltas) == "".join(_stream(tok, ids, 1)) == tok.decode(ids)


def test_incremental_holds_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode(" 🎉")
    # The test is only meaningful if the emoji really is spread over several tokens.
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed(i) for i in ids] == [""] * (len(ids) - 1) + [" 🎉"]


def test_incremental_flush_emits_an_incomplete_tail_like_decode(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.feed(i) for i in ids)
    assert streamed == "ok"
    assert streamed + detok.flush() == tok.decode(ids)
    assert detok.text.endswith("\ufffd")
    assert detok.flush() == ""
