"""Engine keys as kvtier tokens: the keyed API beside the token API (issue 15).

Some engines name a page of KV by a key, not by its tokens: SGLang's HiCache storage hands a
backend the chained SHA-256 of each page (the page's tokens and every page before it).
kvtier stores a chain of such keys as if it were a token sequence. Page i becomes
`page_tokens` synthetic tokens derived from key i (`key_tokens`), so the radix index, prefix
closure, leases, every tier and the remote tier work unchanged. An engine page is then a run
of `page_tokens / block_tokens` kvtier blocks.

    keys  k0 k1 k2 ...  ->  tokens  words(k0) | words(k1) | words(k2) ...   (page_tokens each)
    words(k) = BLAKE2b-256(k, person = BLAKE2b-128(scope)) as 8 little-endian uint32, top bit set,
               then (page_tokens > 8) 0x80000000 + position within the page

`KeyedPages(page_tokens, scope)` does the mapping; `tokens(keys)` the whole chain's, and
`pages(num_tokens)` how many whole pages a token count holds.

Contract:
- Different keys give different pages, as BLAKE2b's collisions are out of reach: each page's
  tokens hold 248 bits of the key's digest (8 words of 31 bits), which is why a page must have
  at least 8 tokens (and at most `MAX_PAGE_TOKENS`, 65,536; `InvalidArgumentError` otherwise).
  kvtier's block ids then chain the pages (`blocks.py`), so a page is found only under the same
  keys before it.
- Disjoint from prompts: every synthetic token is >= 2**31, and no vocabulary comes near, so
  a keyed path never meets a token path. A client that sends such ids itself reaches only
  its own tenant's keyed data: tenants are namespaces of their own (`tenancy.py`).
- `scope` (a string of any length) holds what the engine's keys leave out but the bytes depend
  on. SGLang's keys name neither the model nor the rank, though each tensor-parallel rank
  holds its own heads, so its backend's scope names the model and the ranks (`sglang.py`).
  Keys of different scopes never meet: the scope's 128-bit digest personalizes every key's.
- Keys are bytes of any length, or strings of any length. A string in canonical hex (lowercase,
  even length: SGLang's) is the key of its bytes; any other string (capitals, whitespace,
  non-ASCII, lone surrogates) is a key of its own, hashed apart (BLAKE2b salt), so that no two
  different keys share a page: `bytes.fromhex` alone read "AB", "ab " and "a b" as "ab".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError, shown

TOP = 0x8000_0000
DIGEST_WORDS = 8  # BLAKE2b-256: 8 words of 32 bits, 31 kept
MAX_PAGE_TOKENS = 2**16
"""The most tokens a page may have: 16 of kvtier's largest blocks (4096 tokens). A page's
tokens are a list built per page, so an unbounded `page_tokens` (2**40) exhausted memory."""


class KeyedPages:
    def __init__(self, page_tokens: int, scope: str = "") -> None:
        if type(page_tokens) is not int or not DIGEST_WORDS <= page_tokens <= MAX_PAGE_TOKENS:
            raise InvalidArgumentError(
                f"page_tokens: got {shown(page_tokens)}, expected an int in [{DIGEST_WORDS}, "
                f"{MAX_PAGE_TOKENS}] tokens per page (a page carries 248 bits of its key, and "
                "its tokens are built in memory)"
            )
        if not isinstance(scope, str):
            raise InvalidArgumentError(f"scope: got {type(scope).__name__}, expected a str")
        text = scope.encode("utf-8", "surrogatepass")
        person = hashlib.blake2b(text, digest_size=16).digest()  # BLAKE2b's person: 16 bytes
        self.page_tokens, self.scope, self._person = page_tokens, scope, person
        self._filler = [TOP + i for i in range(DIGEST_WORDS, page_tokens)]

    def page(self, key: bytes | str) -> list[int]:
        """The synthetic tokens of one page."""
        data, salt = _key_bytes(key)
        digest = hashlib.blake2b(data, digest_size=32, person=self._person, salt=salt).digest()
        words = [TOP | int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4)]
        return words + self._filler

    def tokens(self, keys: Sequence[bytes | str]) -> list[int]:
        """The synthetic tokens of a chain of keys, page after page. `keys` is a sequence of
        keys: one key alone (a str or bytes) is an `InvalidArgumentError`, not a chain of its
        characters (a 64-character hex key read as 64 one-character keys was 64 pages)."""
        if isinstance(keys, (str, bytes, bytearray, memoryview)):
            raise InvalidArgumentError(
                f"keys: got one key {shown(keys)}, expected a sequence of keys ([key, ...])"
            )
        out: list[int] = []
        for key in keys:
            out += self.page(key)
        return out

    def pages(self, num_tokens: int) -> int:
        """How many whole pages `num_tokens` tokens hold."""
        return num_tokens // self.page_tokens


TEXT_SALT = b"kvtier-text-key"
"""The BLAKE2b salt of a string key that is not canonical hex: its UTF-8 is hashed apart from
bytes keys (which hash unsalted), so text never meets the bytes it encodes to."""


def _key_bytes(key: bytes | str) -> tuple[bytes, bytes]:
    """`(data, salt)` to hash for `key`. Injective: a string is read as hex only when it is
    exactly the hex its bytes print as, and every other string is salted apart."""
    if isinstance(key, bytes):
        return key, b""
    if isinstance(key, str):
        try:
            data = bytes.fromhex(key)
        except ValueError:
            data = None
        if data is not None and data.hex() == key:
            return data, b""
        return key.encode("utf-8", "surrogatepass"), TEXT_SALT
    raise InvalidArgumentError(f"key: got {type(key).__name__}, expected bytes or a str")
