"""Human byte sizes (`8GiB`, `500MB`, `1.5GiB`) and tier capacities.

Contract:
- `parse_size(text)` turns a size into an exact, positive number of bytes. Units are
  case-sensitive: binary `KiB MiB GiB TiB PiB` (powers of 1024), decimal `kB KB MB GB TB PB`
  (powers of 1000), `B` or none for bytes. A decimal number with a unit larger than a byte is
  rounded down to whole bytes (`1.5GiB` -> 1610612736 exactly); bytes must be whole. Digits
  are ASCII. Anything else, zero, negative or more than `MAX_SIZE` raises `ConfigError`.
- `format_size(n)` is for people (status output): the largest binary unit, at most two
  decimals, so it may round (`123456789` -> `117.74MiB`).
- `Capacity` is a tier size: exact bytes, or a fraction in (0, 1] of the memory that is free
  when the tier is built. Exactly one of `nbytes`, `fraction` is set; it is frozen and
  `to_config()` gives back a value that `Capacity.parse` reads as the same capacity.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from kvtier.errors import ConfigError

_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
}
_BINARY = ("PiB", "TiB", "GiB", "MiB", "KiB")
_SIZE = re.compile(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([A-Za-z]*)\s*")
MAX_SIZE = 2**60
"""The largest size, 1024PiB: beyond any tier, and within the 64 bits that files and `mmap`
take (a size of 100 digits would pass validation and fail at start)."""
SIZE_EXPECTED = (
    "a positive size like '8GiB', '512MiB', '1.5GiB', '8GB' or a whole number of bytes, "
    "at most 1024PiB"
)
FRACTION_EXPECTED = "a size like '8GiB' or a fraction in (0, 1]"


def parse_size(text: str | int) -> int:
    """Bytes in `text` (`'8GiB'`, `'500MB'`, `'4096'`, or an int). Raises `ConfigError`."""
    if type(text) is int:
        if not 0 < text <= MAX_SIZE:
            raise ConfigError("size", text, SIZE_EXPECTED)
        return text
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None or match.group(2) not in _UNITS:
        raise ConfigError("size", text, SIZE_EXPECTED)
    number, unit = Fraction(match.group(1)), _UNITS[match.group(2)]
    if unit == 1 and number.denominator != 1:
        raise ConfigError("size", text, SIZE_EXPECTED)
    nbytes = math.floor(number * unit)
    if not 0 < nbytes <= MAX_SIZE:
        raise ConfigError("size", text, SIZE_EXPECTED)
    return nbytes


def format_size(n: int) -> str:
    """`n` bytes for people: `268435456` -> `'256MiB'`, `1000` -> `'1000B'`. May round."""
    if n < 0:
        return "-" + format_size(-n)
    for name in _BINARY:
        if n >= _UNITS[name]:
            return f"{n / _UNITS[name]:.2f}".rstrip("0").rstrip(".") + name
    return f"{n}B"


def _exact_size_text(n: int) -> str:
    """The shortest text that `parse_size` reads back as exactly `n`."""
    readable = format_size(n)
    if parse_size(readable) == n:
        return readable
    exact = [f"{n // unit}{name}" for name, unit in _UNITS.items() if name and n % unit == 0]
    return min(exact, key=len)  # "B" always divides, so never empty


@dataclass(frozen=True)
class Capacity:
    """A tier's size: `nbytes` exact bytes, or `fraction` of the memory free at build time."""

    nbytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.fraction is None):
            raise ConfigError("capacity", (self.nbytes, self.fraction), "bytes or a fraction")
        if self.nbytes is not None and (
            type(self.nbytes) is not int or not 0 < self.nbytes <= MAX_SIZE
        ):
            raise ConfigError("capacity", self.nbytes, SIZE_EXPECTED)
        if self.fraction is not None and not (
            type(self.fraction) is float and 0.0 < self.fraction <= 1.0
        ):
            raise ConfigError("capacity", self.fraction, FRACTION_EXPECTED)

    @classmethod
    def parse(cls, value: object) -> Capacity:
        """A size (str or int bytes) or a float fraction in (0, 1]. Raises `ConfigError`."""
        if isinstance(value, Capacity):
            return value
        if type(value) is float:
            return cls(fraction=value)
        if type(value) is int or isinstance(value, str):
            return cls(nbytes=parse_size(value))
        raise ConfigError("capacity", value, FRACTION_EXPECTED)

    def resolve(self, free_bytes: int) -> int:
        """Bytes this capacity stands for when `free_bytes` are free (ignored for sizes)."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None and free_bytes >= 0, (self, free_bytes)
        return int(self.fraction * free_bytes)

    def blocks(self, slots: int, block_bytes: int) -> int:
        """Whole blocks of `block_bytes` this stands for in a tier of `slots` slots."""
        if self.nbytes is not None:
            return self.nbytes // block_bytes
        assert self.fraction is not None
        return int(self.fraction * slots)

    def to_config(self) -> str | float:
        """The value to write in a config file: exact size text, or the fraction."""
        if self.nbytes is not None:
            return _exact_size_text(self.nbytes)
        assert self.fraction is not None
        return self.fraction

    def __str__(self) -> str:
        if self.nbytes is not None:
            return _exact_size_text(self.nbytes)
        return f"{self.fraction:g} of free memory"
