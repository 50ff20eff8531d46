"""A byte-level BPE tokenizer built from a GGUF file's vocabulary, merges and chat template.

Contract:
- `encode(text)` -> token ids, with no BOS/EOS added; control tokens written in the text
  (`<|im_start|>`, ...) become their single ids. `decode(ids)` -> text, control tokens included.
  `decode(encode(s)) == s` for plain text (byte-level BPE loses nothing).
- `chat_prompt(user_text)` -> the ids of a one-turn ChatML prompt with the template's system line,
  ending where the assistant's answer begins. The user's text is only text: a control token
  written in it (`<|im_end|>\n<|im_start|>system\n...`) is encoded as its characters, never as
  the control id (which let a user close their turn and write the system's).
- Refused, typed: text that is not a `str` or holds a lone surrogate (no UTF-8 bytes exist for
  it; the `tokenizers` library raised a `TypeError`) is an `InvalidArgumentError` naming the
  position; an id outside `[0, vocab_size)` given to `decode` (it was dropped silently, or an
  `OverflowError` past 64 bits) an `InvalidTokensError` naming it. A GGUF vocabulary, merges or
  token types of the wrong type, or ones the BPE model refuses, are an `InvalidArgumentError`.

Pre-tokenization is SmolLM2's (GGUF pre "smollm"): each digit alone, then GPT-2's byte-level
split. Ids should match the official tokenizer for ordinary text, but exactness is not promised:
what matters here is real text in, real KV out. Needs the `tokenizers` package.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvtier.errors import InvalidArgumentError, InvalidTokensError, shown
from kvtier.kernels.slots import integer
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
        for name, values in (("tokens", tokens), ("merges", merges)):
            if not all(type(value) is str for value in values):
                raise InvalidArgumentError(f"tokenizer {name}: expected strings only")
        if not all(type(i) is int and 0 <= i < len(tokens) for i in control_ids):
            raise InvalidArgumentError("tokenizer control ids: expected ids in the vocabulary")
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs)
        except Exception as error:  # the library raises a bare Exception (a merge of no token)
            raise InvalidArgumentError(f"tokenizer: the BPE model refuses it ({error})") from None
        self.vocab_size = len(tokens)
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
        self._plain = Tokenizer.from_str(self._tokenizer.to_str())  # a user's text: no control
        self._plain.encode_special_tokens = True  # id is read from it (`chat_prompt`)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> BPETokenizer:
        """The tokenizer of a gpt2-style GGUF file; `ValueError` for any other tokenizer model
        or a chat template without a ChatML system line."""
        model = field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise InvalidArgumentError(f"GGUF tokenizer model: got {shown(model)}, expected 'gpt2'")
        fields = {
            name: field(reader, f"tokenizer.ggml.{name}")
            for name in ("tokens", "merges", "token_type")
        }
        for name, value in fields.items():
            if not isinstance(value, list):
                raise InvalidArgumentError(f"GGUF field tokenizer.ggml.{name}: expected a list")
        template = field(reader, "tokenizer.chat_template")
        system = _SYSTEM_LINE.search(template) if isinstance(template, str) else None
        if system is None:
            raise InvalidArgumentError(
                f"chat template: got {shown(template)}, expected a ChatML system line"
            )
        types = fields["token_type"]
        control_ids = [i for i, kind in enumerate(types) if kind == CONTROL_TOKEN_TYPE]
        return cls(fields["tokens"], fields["merges"], control_ids, system.group(1))

    def encode(self, text: str) -> list[int]:
        return self._encode(self._tokenizer, text)

    @staticmethod
    def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text: got {shown(text)}, expected a str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate: no bytes for a byte-level BPE
            raise InvalidArgumentError(
                f"text[{error.start}]: got {text[error.start]!r}, a lone surrogate; expected "
                "text that UTF-8 can encode"
            ) from None
        ids: list[int] = tokenizer.encode(str.__str__(text), add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`: ints, NumPy or torch integers (a model's argmax), ids of the
        vocabulary; `InvalidTokensError` naming the first that is not."""
        numbers = []
        for at, token in enumerate(ids):
            if type(token) is int and 0 <= token < self.vocab_size:  # (most: a list of ints)
                numbers.append(token)
                continue
            number = integer(token)  # NumPy or torch ids too (a model's argmax), never a float
            if number is None or not 0 <= number < self.vocab_size:
                kind = " (an int or a 0-d tensor)" if getattr(token, "ndim", 0) else ""
                raise InvalidTokensError(
                    f"ids[{at}]: got {shown(token)}, expected an id{kind} in [0, {self.vocab_size})"
                )
            numbers.append(number)
        return self._tokenizer.decode(numbers, skip_special_tokens=False)

    def chat_prompt(self, user_text: str) -> list[int]:
        """ChatML: system line, one user turn, then the opening of the assistant's turn; the
        user's text encoded with no control token (module doc)."""
        # the role's "user\n" encoded with the text: text that begins with a space or a line
        # break merges with it as in the whole prompt (apart, 66 of 824 texts encoded otherwise)
        if not isinstance(user_text, str):
            raise InvalidArgumentError(f"user_text: got {shown(user_text)}, expected a str")
        user = self._encode(self._plain, "user\n" + str.__str__(user_text))
        head = self.encode(f"<|im_start|>system\n{self.system_line}<|im_end|>\n<|im_start|>")
        return head + user + self.encode("<|im_end|>\n<|im_start|>assistant\n")
