"""A byte-level BPE tokenizer built from a GGUF file's vocabulary, merges and chat template.

Contract:
- `encode(text)` -> token ids, with no BOS/EOS added; control tokens written in the text
  (`<|im_start|>`, ...) become their single ids. `decode(ids)` -> text, control tokens included.
  `decode(encode(s)) == s` for plain text (byte-level BPE loses nothing).
- `chat_prompt(user_text)` -> the ids of a one-turn ChatML prompt with the template's system line,
  ending where the assistant's answer begins.

Pre-tokenization is SmolLM2's (GGUF pre "smollm"): each digit alone, then GPT-2's byte-level
split. Ids should match the official tokenizer for ordinary text, but exactness is not promised:
what matters here is real text in, real KV out. Needs the `tokenizers` package.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvtier.reference.gguf_loader import field

CONTROL_TOKEN_TYPE = 3
"""`tokenizer.ggml.token_type` of control tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL)."""

_SYSTEM_LINE = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL)


class BPETokenizer:
    """Byte-level BPE over a GGUF vocabulary; see the module docstring for the contract."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        control_ids: Sequence[int],
        system_line: str,
    ) -> None:
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
        bpe = models.BPE(vocab=vocab, merges=pairs)
        self._tokenizer = Tokenizer(bpe)
        self._tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        self._tokenizer.decoder = decoders.ByteLevel()
        self._tokenizer.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in control_ids]
        )
        self.system_line = system_line

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> BPETokenizer:
        """The tokenizer of a gpt2-style GGUF file; `ValueError` for any other tokenizer model
        or a chat template without a ChatML system line."""
        model = field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model: got {model!r}, expected 'gpt2'")
        tokens = field(reader, "tokenizer.ggml.tokens")
        types = field(reader, "tokenizer.ggml.token_type")
        template = field(reader, "tokenizer.chat_template")
        system = _SYSTEM_LINE.search(template)
        if system is None:
            raise ValueError(f"chat template has no ChatML system line: {template[:200]!r}")
        control_ids = [i for i, kind in enumerate(types) if kind == CONTROL_TOKEN_TYPE]
        return cls(tokens, field(reader, "tokenizer.ggml.merges"), control_ids, system.group(1))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def chat_prompt(self, user_text: str) -> list[int]:
        """ChatML: system line, one user turn, then the opening of the assistant's turn."""
        return self.encode(
            f"<|im_start|>system\n{self.system_line}<|im_end|>\n"
            f"<|im_start|>user\n{user_text}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
