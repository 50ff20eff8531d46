"""The vocabulary the config sections are written in: validated field types and `Section`.

Contract:
- Every check here runs before (or instead of) pydantic's own and, on a bad value, raises
  `InvalidValue(value, expected, key)`: the bad input as given, a phrase for what would do (it
  becomes `ConfigError.expected`), and optionally the key below pydantic's location where the
  fault lies (`NotASection` where a mapping goes: the value is not shown). The sections' own
  validators raise it too; `loading.py` turns it into a
  `ConfigError`, and nothing else reads it.
- A path (`FilePath`) is a string the OS can take as one (`private_files.is_path`: no NUL byte,
  no lone surrogate), so that a file's open never fails with anything but an `OSError`; and
  one without a shell's leading `~` or a `$NAME` / `${NAME}`, which nothing expands (they
  would name a directory `~` or `$HOME` in the working directory).
- Types are exact: `True` is not an int and `1` is not `True`; a float is accepted only where
  the field says number.
- `Section` is the base of every section: frozen, strict, and closed to unknown keys (the
  error lists the allowed ones, and names the unknown key when it is letters, `_` and `-`
  only: any other may be text of a file that is no config, a secret's, and is not shown).
- Capacities: `MemoryCapacity` is a size or a fraction in (0, 1] (gpu, host and the per-tier
  tenant settings); `DiskCapacity` is a size only. Both serialise back through
  `Capacity.to_config`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    model_validator,
)

from kvtier.errors import ConfigError
from kvtier.private_files import PATH_EXPECTED, is_path
from kvtier.sizes import FRACTION_EXPECTED, Capacity, format_size, parse_size

_DISK_EXPECTED = "a size like '1TiB' (a fraction of free memory is for gpu and host only)"


class InvalidValue(ValueError):
    """Raised by validators; `key`, if set, extends pydantic's location down to the bad key."""

    def __init__(self, value: object, expected: str, key: str | None = None) -> None:
        super().__init__(expected)
        self.value, self.expected, self.key = value, expected, key


class HiddenText:
    """Stands in an error for document text where no field's value goes (a top level that is
    not a mapping, a scalar or a list where a section goes, an unknown key that is not a
    misspelling's shape): its `kind` ('a string'), and its `line` and `column` (1-based) when
    known; never the text, which may be anything (a secrets file given for a config)."""

    def __init__(self, kind: str, line: int | None = None, column: int | None = None) -> None:
        self.kind, self.line, self.column = kind, line, column

    @classmethod
    def of(cls, value: object, line: int | None = None, column: int | None = None) -> HiddenText:
        """`value` described by its kind ('a string', 'a list')."""
        return cls(_KIND_NAMES.get(type(value), f"a {type(value).__name__}"), line, column)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HiddenText) and self._parts() == other._parts()

    def __hash__(self) -> int:
        return hash((HiddenText, *self._parts()))

    def _parts(self) -> tuple[str, int | None, int | None]:
        return self.kind, self.line, self.column

    def __repr__(self) -> str:
        where = f" at line {self.line}, column {self.column}" if self.line is not None else ""
        return f"<{self.kind}{where}: not shown>"


_KIND_NAMES = {
    str: "a string",
    list: "a list",
    tuple: "a list",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    bytes: "binary data",
}


class NotASection(InvalidValue):
    """Raised where a section (a mapping) goes and something else came: the error shows its
    kind, never its text (`HiddenText`)."""


def rule(ok: Callable[[Any], bool], expected: str) -> BeforeValidator:
    """A check that refuses any value for which `ok` is false, saying `expected`."""

    def check(value: object) -> object:
        if not ok(value):
            raise InvalidValue(value, expected)
        return value

    return BeforeValidator(check)


def matching(pattern: re.Pattern[str], expected: str, optional: bool = False) -> BeforeValidator:
    """A string that `pattern` matches whole (or None, when `optional`), saying `expected`."""
    return rule(
        lambda v: (optional and v is None) or (isinstance(v, str) and bool(pattern.fullmatch(v))),
        expected,
    )


def int_in(low: int, high: float = math.inf) -> BeforeValidator:
    """An int (not a bool) in [low, high]."""
    expected = f"an integer in [{low}, {high}]" if high < math.inf else f"an integer >= {low}"
    if low == 1 and high == math.inf:
        expected = "a positive integer"
    return rule(lambda v: type(v) is int and low <= v <= high, expected)


def bytes_in(low: int, high: int) -> BeforeValidator:
    """A number of bytes in [low, high]: an int (not a bool) or a size as capacities are
    written (`'8MiB'`, `'2GiB'`, `'65536'`; `sizes.parse_size`), taken as its int. Before, these
    fields took an int only, and `max_body_bytes: 2GiB` was refused though every capacity beside
    it is written so."""
    expected = (
        f"a size like '8MiB' or a whole number of bytes, in [{format_size(low)}, "
        f"{format_size(high)}] ([{low}, {high}] bytes)"
    )

    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidValue(value, expected)
        try:
            nbytes = parse_size(value)
        except ConfigError:
            raise InvalidValue(value, expected) from None
        if not low <= nbytes <= high:
            raise InvalidValue(value, expected)
        return nbytes

    return BeforeValidator(check)


def number_in(low: float, high: float, expected: str) -> BeforeValidator:
    """A finite int or float in (low, high]."""
    return rule(lambda v: type(v) in (int, float) and low < v <= high and v < math.inf, expected)


def one_of(choices: tuple[object, ...]) -> BeforeValidator:
    """One of `choices`, compared with its type, so that 1 is not taken for True."""
    shown = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
    # compared one by one: a list or a mapping from the file is refused, not a TypeError
    return rule(lambda v: any(type(v) is type(c) and v == c for c in choices), f"one of {shown}")


def _capacity(value: object, expected: str) -> Capacity:
    try:
        return Capacity.parse(value)
    except ConfigError:
        raise InvalidValue(value, expected) from None


def _disk_capacity(value: object) -> Capacity:
    capacity = _capacity(value, _DISK_EXPECTED)
    if capacity.fraction is not None:
        raise InvalidValue(value, _DISK_EXPECTED)
    return capacity


PositiveInt = Annotated[int, int_in(1)]
Name = Annotated[str, rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")]
_UNEXPANDED = re.compile(r"\A~|\$(\{|[A-Za-z_])")
"""A shell's `~` or `$NAME` / `${NAME}`, which nothing here expands: `path: ~/kvtier-data`
made a directory named `~` in the working directory (and a later `rm -rf ~` of it, the home)."""
UNEXPANDED_EXPECTED = (
    "a path written out (kvtier expands no '~' or '$NAME', as a shell would: "
    "'/home/me/kvtier-data', not '~/kvtier-data' or '$HOME/kvtier-data')"
)


def _file_path(value: object) -> object:
    if not is_path(value):
        raise InvalidValue(value, PATH_EXPECTED)
    if isinstance(value, str) and _UNEXPANDED.search(value):  # a leading `~`, `$NAME`, `${`
        raise InvalidValue(value, UNEXPANDED_EXPECTED)
    return value


FilePath = Annotated[str, BeforeValidator(_file_path)]
"""A file or directory: refused here, naming its field, when no system call could take it, or
when it holds a shell's `~` or `$NAME` that would be taken as the characters they are."""
HostText = Annotated[
    str,
    rule(
        lambda v: isinstance(v, str) and v.isprintable() and " " not in v and v != "",
        "a host name or an IP address (printable, no space)",
    ),
]
Fraction01 = Annotated[float, number_in(0.0, 1.0, "a fraction in (0, 1]")]
MemoryCapacity = Annotated[
    Capacity,
    PlainValidator(lambda v: _capacity(v, FRACTION_EXPECTED)),
    PlainSerializer(Capacity.to_config),
]
DiskCapacity = Annotated[
    Capacity, PlainValidator(_disk_capacity), PlainSerializer(Capacity.to_config)
]


def _key_ref(what: str) -> BeforeValidator:
    return rule(
        lambda v: isinstance(v, str) and (len(v) >= 16 or v.startswith("env:")),
        f"{what} of at least 16 characters, or 'env:NAME' to read it from $NAME",
    )


_API_KEY = re.compile(r"[\x21-\x7e\xa1-\xff]([\x20-\x7e\xa0-\xff]*[\x21-\x7e\xa1-\xff])?")
"""What a request's header can carry (read as latin-1, stripped): printable latin-1, no space at
either end."""
API_KEY_EXPECTED = (
    "an API key of at least 16 printable latin-1 characters (spaces inside only: an HTTP header "
    "carries it, stripped)"
)

KeyRef = Annotated[
    str,
    rule(
        lambda v: (
            isinstance(v, str)
            and (v.startswith("env:") or (len(v) >= 16 and bool(_API_KEY.fullmatch(v))))
        ),
        f"{API_KEY_EXPECTED}, or 'env:NAME' to read it from $NAME",
    ),
]
SecretRef = Annotated[str, _key_ref("a secret")]  # `resolve_key` reads both


def resolve_key(ref: str, field: str) -> str:
    """A configured key or secret: the literal, or the value of `$NAME` for `env:NAME` less one
    trailing newline (a secret file's, as Kubernetes puts it in the environment: a Redis password
    read with it would fail AUTH); `ConfigError` naming `field` (never the value) when `$NAME` is
    unset or then short."""
    if not ref.startswith("env:"):
        return ref
    name = ref.removeprefix("env:")
    value = os.environ.get(name)
    if value is not None:
        value = value.removesuffix("\n").removesuffix("\r")
    if value is None or len(value) < 16:
        raise ConfigError(field, ref, f"${name} set to a key of at least 16 characters")
    return value


def resolve_api_key(ref: str, field: str) -> str:
    """An API key (`KeyRef`) as requests present it: `resolve_key`'s (an `env:NAME` less one
    trailing newline). `ConfigError` naming `field` (never the value) unless the key is then at
    least 16 printable latin-1 characters without a space at either end: no request could
    present another (a header is stripped, and read as latin-1)."""
    key = resolve_key(ref, field)
    if len(key) < 16 or not _API_KEY.fullmatch(key):
        shown = ref if ref.startswith("env:") else "(a key, not shown)"
        raise ConfigError(field, shown, f"{API_KEY_EXPECTED} (a trailing newline is dropped)")
    return key


_SHOWN_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""An unknown key shown in its error, as a misspelled one is (`host2`, `model.name`); any
other (`:`, `=`, `$`, `/`, a space or a quote, or over 64 characters: a line of a secrets
file or of /etc/shadow read as a key) is not."""


def shown_key(key: object) -> object:
    """`key` as an error may show it: itself when `_SHOWN_KEY` matches it, else
    `HiddenText("a key")`."""
    if isinstance(key, str) and _SHOWN_KEY.fullmatch(key):
        return key
    return HiddenText("a key")


class Section(BaseModel):
    """Frozen and closed to unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: object) -> object:
        if isinstance(data, Mapping):
            for key in data:
                if key not in cls.model_fields:
                    allowed = ", ".join(cls.model_fields) or "none"
                    expected = f"a known key; allowed: {allowed}"
                    if isinstance(key, str) and _SHOWN_KEY.fullmatch(key):
                        raise InvalidValue(key, expected, key=key)
                    raise InvalidValue(HiddenText("a key"), expected, key="<a key, not shown>")
        return data
