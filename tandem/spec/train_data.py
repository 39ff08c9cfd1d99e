"""Training data for EAGLE heads, built offline: chat prompts from text that ships on the
machine (the Python standard library's sources and docstrings, Debian's `fortunes` and
`python3.11-doc` when installed) and prompts the target writes itself (`self_prompts`), answered
by the target itself (self-distillation).

Answers are stored as token ids in a JSONL file, appended as they are generated, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tandem.spec.chat_prompts import chat_prompts

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "machine learning", "the French "
    "Revolution", "healthy sleep", "learning a new language", "time management", "recursion",
    "the internet", "volcanoes", "climate change", "the human heart", "prime numbers",
    "electric cars", "the Roman Empire", "coffee", "gardening", "public speaking", "budgeting",
    "the moon", "rainbows", "vaccines", "databases", "encryption", "the stock market",
    "renewable energy", "bees", "chess", "meditation", "the Great Wall of China", "DNA",
    "earthquakes", "compilers", "the Olympic Games", "bread baking", "jazz", "gravity",
    "friendship", "running a marathon", "the printing press", "oceans", "version control",
    "operating systems", "the immune system", "electricity", "weather forecasting", "poetry",
)

TEMPLATES = (
    "What is {t}? Explain briefly.",
    "Give me three interesting facts about {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "List five questions a student might ask about {t}.",
    "Summarize the history of {t} in a few sentences.",
)

CODE_TEMPLATES = (
    "Explain what this Python function does:\n\n```python\n{code}\n```",
    "Suggest a better name and a docstring for this function:\n\n```python\n{code}\n```",
    "Write a unit test for this function:\n\n```python\n{code}\n```",
)

DOC_TEMPLATES = (
    "Summarize this in one or two sentences:\n\n{text}",
    "Rewrite this more simply:\n\n{text}",
    "What are the key points of the following text?\n\n{text}",
)


def _stdlib_snippets(rng: random.Random, limit: int) -> tuple[list[str], list[str]]:
    """(short functions, docstrings) from the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    rng.shuffle(files)
    funcs, docs = [], []
    for path in files:
        if len(funcs) >= limit and len(docs) >= limit:
            break
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                # Whole lines, dedented (ast.get_source_segment rescans the source per call:
                # quadratic over the standard library).
                seg = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                if 3 <= seg.count("\n") <= 25 and len(funcs) < limit:
                    funcs.append(seg)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and 200 <= len(doc) <= 1200 and len(docs) < limit:
                    docs.append(doc)
    return funcs, docs


def _text_files() -> list[str]:
    """Paragraphs from Debian text packages, when installed (optional)."""
    out: list[str] = []
    fortunes = Path("/usr/share/games/fortunes")
    if fortunes.is_dir():
        for f in sorted(fortunes.iterdir()):
            if f.suffix or not f.is_file():
                continue
            try:
                out += [s.strip() for s in f.read_text(errors="ignore").split("\n%\n")
                        if 80 <= len(s.strip()) <= 600]
            except OSError:
                continue
    docs = Path("/usr/share/doc/python3.11/html/_sources")
    if docs.is_dir():
        for f in sorted(docs.rglob("*.txt"))[:400]:
            paras = f.read_text(errors="ignore").split("\n\n")
            out += [p.strip() for p in paras if 200 <= len(p.strip()) <= 1000]
    return out


def build_prompts(num: int, seed: int = 0, chat_fraction: float = 0.75) -> list[str]:
    """`num` distinct user prompts, deterministic for a seed: `chat_fraction` of them general
    chat (chat_prompts.py), the rest about code and documentation text found on the machine.
    No prompt touches the subject of a held-out evaluation question (`is_held_out`)."""
    rng = random.Random(seed)
    funcs, docs = _stdlib_snippets(rng, limit=num)
    texts = docs + _text_files()
    chat = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS] + chat_prompts(rng)
    other = [rng.choice(CODE_TEMPLATES).format(code=c) for c in funcs]
    other += [rng.choice(DOC_TEMPLATES).format(text=t) for t in texts]
    rng.shuffle(chat)
    rng.shuffle(other)
    # Interleave so any prefix of the list (a smaller --num-prompts) has the same mix.
    mixed, ci, oi = [], 0, 0
    while ci < len(chat) or oi < len(other):
        take_chat = oi >= len(other) or (ci < len(chat) and ci < chat_fraction * (ci + oi + 1))
        if take_chat:
            mixed.append(chat[ci])
            ci += 1
        else:
            mixed.append(other[oi])
            oi += 1
    seen, out = set(), []
    for p in mixed:
        if p not in seen and not is_held_out(p):
            seen.add(p)
            out.append(p)
    return out[:num]


HELD_OUT_QUESTIONS = (
    "What is the capital of France?",
    "Explain in two sentences what a CPU does.",
    "Give me three tips for learning to cook.",
    "What is the difference between a list and a tuple in Python?",
    "Why do leaves change color in autumn?",
    "Write a short poem about the night sky.",
    "How does a bicycle stay upright?",
    "What are the benefits of regular exercise?",
    "Describe how a rainbow forms.",
    "What should I pack for a weekend hiking trip?",
)


# Subjects of the held-out questions: a training prompt that mentions one is dropped, so the
# evaluation measures prompts the head has not seen, not paraphrases of its training set.
HELD_OUT_SUBJECTS = ("capital of", "cpu", "cook", "list and a tuple", "tuple", "leaves",
                     "autumn", "night sky", "bicycle", "exercise", "rainbow", "hiking", "pack")


def is_held_out(prompt: str) -> bool:
    """A prompt no training set may hold: it mentions a held-out subject, or it contains one
    of the evaluation's chat prompts (`EVAL_CHAT_PROMPTS`, held out by prompt, not subject)."""
    low = prompt.lower()
    if any(s in low for s in HELD_OUT_SUBJECTS):
        return True
    norm = _normalize(prompt)
    return any(q in norm for q in _eval_chat_prompts())


# 50 short chat questions `tandem eval-eagle --prompts-file` measures tau on (one per line).
# Their subjects are common, so they are held out by prompt: no training prompt may contain one.
EVAL_CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "chat-prompts-50.txt"


@cache
def _eval_chat_prompts() -> tuple[str, ...]:
    lines = EVAL_CHAT_PROMPTS.read_text().splitlines() if EVAL_CHAT_PROMPTS.is_file() else []
    return tuple(_normalize(q) for q in lines if q.strip())


def _normalize(text: str) -> str:
    """Lower case, punctuation as spaces, single spaces: 'What is X?' matches 'what is x'."""
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]


def read_samples(path: Path) -> list[Sample]:
    """Samples stored by `generate_samples` (JSONL, or gzipped JSONL when the name ends .gz)."""
    if not path.is_file():
        return []
    if path.suffix == ".gz":
        import gzip

        text = gzip.decompress(path.read_bytes()).decode()
    else:
        text = path.read_text()
    out = []
    for line in text.splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Sample(prompt_ids=tuple(d["p"]), answer_ids=tuple(d["a"])))
    return out


def prompt_ids(tok, prompt: str) -> list[int]:
    """The token ids a self-distillation sample stores for a user prompt: the chat template
    around one user turn, the last 1,024 tokens."""
    from tandem.tokenizer import ChatMessage

    return tok.encode_chat([ChatMessage(role="user", content=prompt)])[-1024:]


def unanswered(tok, prompts: list[str], answered: list[Sample]) -> list[str]:
    """`prompts` minus those whose stored ids (`prompt_ids`) some sample in `answered` already
    has, order kept: a new run on a larger prompt set answers only new prompts."""
    known = {s.prompt_ids for s in answered}
    return [p for p in prompts if tuple(prompt_ids(tok, p)) not in known]


def generate_samples(engine, prompts: list[str], out_path: Path, max_new_tokens: int,
                     batch_size: int, progress: bool = True) -> Iterator[int]:
    """Answer `prompts` with the target (greedy), appending to `out_path`; skips prompts
    already answered. Yields the number of answered prompts after each batch."""
    from tandem.engine import SamplingParams

    done = len(read_samples(out_path))
    tok = engine.tokenizer
    params = SamplingParams(max_new_tokens=max_new_tokens)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), initial=done, unit="prompt", desc="self-distill")
    for start in range(done, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids = [prompt_ids(tok, p) for p in chunk]
        completions = engine.generate(ids, params)
        with out_path.open("a") as f:
            for p, c in zip(ids, completions):
                f.write(json.dumps({"p": list(p), "a": list(c.output_ids)}) + "\n")
        if bar is not None:
            bar.update(len(chunk))
        yield start + len(chunk)
    if bar is not None:
        bar.close()


# Openings of self-written prompts (`self_prompts`): half of them start free, the rest with one
# of these words, which steers the target towards short everyday questions and requests.
SELF_PROMPT_OPENINGS = ("What", "How", "Why", "Can you", "Explain", "Give me", "Write", "Describe",
                        "Tell me", "Is it", "Which", "When", "Where", "Who", "Should I", "List",
                        "Help me", "I need", "Summarize", "Compare")


# Openings of the "short" style: the plain questions and requests a chat user types first
# (what the held-out evaluation asks), rather than the long, often odd requests an open user
# turn gives.
SHORT_OPENINGS = ("What is", "What are", "How do", "How does", "How can I", "Why do", "Why is",
                  "Why does", "Explain", "Describe", "Give me three", "Write a short",
                  "What causes", "What is the difference between", "How should I", "Tell me")


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfPromptConfig:
    temperature: float = 0.9
    top_p: float = 0.95
    max_tokens: int = 96  # a prompt longer than this (no end-of-turn) is dropped
    min_chars: int = 12
    max_chars: int = 400
    # "open": half the user turns start empty, half with a SELF_PROMPT_OPENINGS word;
    # "short": every turn starts with a SHORT_OPENINGS phrase and at most 120 characters are
    # kept -- short plain questions.
    style: str = "open"

    def __post_init__(self) -> None:
        if self.style not in ("open", "short"):
            raise ValueError(f"style: '{self.style}' is not one of open, short")

    @staticmethod
    def of_style(style: str) -> SelfPromptConfig:
        return SelfPromptConfig(style=style, max_chars=120 if style == "short" else 400)


def _user_turn_prefix(tok) -> str:
    """The chat template up to where a user message's text begins (system prompt included)."""
    from tandem.tokenizer import ChatMessage

    mark = "\x00USER\x00"
    full = tok.apply_chat_template([ChatMessage(role="user", content=mark)],
                                   add_generation_prompt=False)
    return full[: full.index(mark)]


def keep_self_prompt(text: str, cfg: SelfPromptConfig = SelfPromptConfig()) -> bool:
    """A self-written prompt worth answering: a plausible length, mostly plain text, and not
    about a held-out evaluation subject."""
    if not cfg.min_chars <= len(text) <= cfg.max_chars:
        return False
    letters = sum(c.isascii() and (c.isalnum() or c.isspace()) for c in text)
    if letters < 0.85 * len(text):  # other scripts, emoji runs, markup soup
        return False
    return not is_held_out(text)


def self_prompts(engine, num: int, seed: int = 0, cfg: SelfPromptConfig = SelfPromptConfig(),
                 batch_size: int = 256) -> Iterator[list[str]]:
    """Prompts the target writes itself (as Magpie does): given only the chat template up to a
    user turn's text, it samples what a user would ask, ending at its end-of-turn token. Yields
    each batch's kept prompts (distinct, `keep_self_prompt`) until `num` are kept or 4 * num
    were tried. Reproducible for a seed where the engine's sampling is (torch's RNG is seeded
    before each batch)."""
    import torch

    from tandem.engine import SamplingParams
    from tandem.engine.request import FinishReason

    tok = engine.tokenizer
    prefix = _user_turn_prefix(tok)
    end_ids = tuple(sorted(tok.eos_token_ids))  # <|im_end|> among them
    rng = random.Random(seed)
    seen: set[str] = set()
    kept = tried = 0
    while kept < num and tried < 4 * num:
        n = min(batch_size, 4 * num - tried)
        if cfg.style == "short":
            openings = [rng.choice(SHORT_OPENINGS) for _ in range(n)]
        else:
            openings = [rng.choice(SELF_PROMPT_OPENINGS) if rng.random() < 0.5 else ""
                        for _ in range(n)]
        ids = [tok.encode(prefix + o) for o in openings]
        # No per-request seeds: unseeded rows are sampled in one batched draw (a seeded row
        # draws alone, ~10 kernel launches each per step); torch's RNG is seeded per batch.
        params = SamplingParams(max_new_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, stop_token_ids=end_ids)
        torch.manual_seed(seed * 1_000_003 + tried)
        tried += n
        out = []
        for o, c in zip(openings, engine.generate(ids, params)):
            if c.finish_reason is not FinishReason.STOP:
                continue  # ran out of tokens: no end of turn
            text = (o + tok.decode(c.output_ids)).strip()
            if cfg.style == "short":  # the opening and its continuation: "What is" + " a ..."
                text = " ".join(text.split())
            if text not in seen and keep_self_prompt(text, cfg):
                seen.add(text)
                out.append(text)
        out = out[: num - kept]
        kept += len(out)
        yield out
