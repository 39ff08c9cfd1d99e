"""What the HTTP front's tests share: a word-level tokenizer with a chat template (written next to
a tiny checkpoint, so its engine and a deployment's router both load it: text prompts and chat
work on the tiny model), and OpenAI SDK clients of a front on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

VOCAB = 256  # hf_tiny's vocabulary: "w0" .. "w255", one word per id ("w0" doubles as unknown)
# Role and turn markers are ordinary words; the template inserts each content verbatim.
CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ m.role }} {{ m.content }} w2 {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")


def word_tokenizer_json() -> str:
    hf = HFTokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return hf.to_str()


def write_word_tokenizer(model_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json into `model_dir`."""
    (model_dir / "tokenizer.json").write_text(word_tokenizer_json())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def word_tokenizer():
    from tandem.tokenizer import Tokenizer

    return Tokenizer(tokenizer=HFTokenizer.from_str(word_tokenizer_json()),
                     chat_template=CHAT_TEMPLATE, special_tokens={})


def openai_client(port: int, token: str | None = None, timeout_s: float = 60.0):
    """The real OpenAI SDK against the front; no retries (a test sees every answer)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token or "none",
                         max_retries=0, timeout=timeout_s)
