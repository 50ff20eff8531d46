"""Input from outside (a YAML file, a mapping) to a `KVTierConfig`, or a `ConfigError`.

Contract:
- `load_config(path)` and `parse_config(mapping)` return a `KVTierConfig` or raise `ConfigError`
  whose `field` is the dotted path of the bad value (`tiers.gpu.capacity`), whose `value` is the
  bad input and whose `expected` says what would do, naming the source. No pydantic, YAML or OS
  exception escapes; only the first fault is reported.
- YAML is read safely, and a key repeated in one mapping is an error rather than last-wins
  (merge keys, `<<: *anchor`, may be overridden). A file is at most `MAX_FILE_CHARS` long and
  its values, with every alias written out, at most `MAX_VALUES`: no "billion laughs"; its
  own values are counted as they are read, so that the reading stops at the first past it.
- An error never shows an API key or secret: a value under `api_keys`, `admin_key`,
  `secret` or `password` (the remote tier's cluster secret and AUTH password), or one that shows
  any of the keys given there, is replaced by `HiddenKey()`. A YAML error comes before the keys
  are known, so it shows no text of the file: its value is a `HiddenLine` (line and column) and
  its `expected` names the kind of fault, with every quoted part of the reader's words and
  every alias, anchor and tag name left out (`_fault_kind`). Nor is text where no field's value
  goes shown (a top level that is not a mapping, a scalar or a list where a section goes, as a
  secrets file given for a config has): its value is a `HiddenText` naming its kind (and, in a
  file, the top level's line and column).
- A file is opened without blocking and read only when it is a regular file (a link to one is
  followed) or a FIFO or pipe (`--config <(envsubst < tmpl)`, a piped `/dev/stdin`), the latter
  read with poll() to its end within `FIFO_WAIT_S` in all (no writer, or a stalled one, is
  refused naming the path and the wait); a device or a directory is refused naming the path,
  and so is a file with the other-write bit. A file another user owns is read (a checkout
  bind-mounted into a container that runs as root, a deploy user's file read by the service's
  user): refusing it broke those, and its owner is a user the operator chose.
- `default_config()` is the embedded default (`kvtier serve` without `--config`) and equals
  `configs/default.yaml`: `KVTierConfig()` and a disk tier of `DEFAULT_DISK`.
"""

from __future__ import annotations

import os
import re
import select
import stat
import time
from collections.abc import Hashable, Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from kvtier.config.fields import HiddenText, InvalidValue, NotASection
from kvtier.config.root import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.private_files import file_kind


class _Absent:
    def __repr__(self) -> str:
        return "nothing"


class HiddenKey:
    """Stands in an error for an API key's value: the error names the key's place
    (`tenants.a.api_keys.0`) and what was expected, never the key."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HiddenKey)

    def __hash__(self) -> int:
        return hash(HiddenKey)

    def __repr__(self) -> str:
        return "<a key, not shown>"


class HiddenLine:
    """Stands in a YAML error for the text at `line` and `column` (1-based) of a config file:
    the file could not be read far enough to know which of its words are keys."""

    def __init__(self, line: int, column: int) -> None:
        self.line, self.column = line, column

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HiddenLine) and (self.line, self.column) == (
            other.line,
            other.column,
        )

    def __hash__(self) -> int:
        return hash((HiddenLine, self.line, self.column))

    def __repr__(self) -> str:
        return f"<line {self.line}, column {self.column}: not shown>"


_PHRASES = {
    "missing": "a value (this key is required)",
    "model_type": "a mapping of keys",
    "dict_type": "a mapping",
    "string_type": "a string",
}


def _config_error(exc: ValidationError, source: str, keys: set[str]) -> ConfigError:
    """The first error of `exc`, with its dotted path, input and a phrase for what would do.
    The input is hidden when it is (or shows one of) the API keys `keys`, or sits in a key
    field: an error names a key's place, never its value."""
    error = exc.errors()[0]
    path = [str(part) for part in error["loc"]]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, InvalidValue):
        path += [cause.key] if cause.key else []
        value, expected = cause.value, cause.expected
    else:
        value = _Absent() if error["type"] == "missing" else error["input"]
        expected = _PHRASES.get(error["type"], error["msg"])
    if isinstance(cause, NotASection) or error["type"] in _SECTION_TYPES:
        value = value if value is None else HiddenText.of(value)  # no field's value: not shown
    if _KEY_FIELDS.intersection(path) or any(key in repr(value) for key in keys):
        value = HiddenKey()
    return ConfigError(".".join(path) or "<top level>", value, f"{expected} (in {source})")


_SECTION_TYPES = frozenset({"model_type", "dict_type"})
"""pydantic's errors for something else where a section (a mapping) goes."""

# secret and password: tiers.remote's
_KEY_FIELDS = frozenset({"api_keys", "admin_key", "secret", "password"})


def _key_values(data: object) -> set[str]:
    """Every string (or other scalar, as text) given under a key field anywhere in `data`."""
    found: set[str] = set()
    seen: set[int] = set()  # YAML anchors can make a list contain itself
    stack = [data]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Mapping):
            for name, value in item.items():
                if name in _KEY_FIELDS:
                    values = value if isinstance(value, (list, tuple)) else [value]
                    found.update(str(v) for v in values if not isinstance(v, (Mapping, list)))
                stack.append(value)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return {key for key in found if key}


MAX_VALUES = 100_000
"""The most values a config holds once its aliases are written out (a config has about 80)."""


def _expanded_size(item: object, sizes: dict[int, int], inside: set[int]) -> int:
    """The values in `item` as if every part it shares (a YAML alias) were written out, each
    shared part counted once (`sizes`, by id); a part inside itself counts 1, as repr shows it."""
    if not isinstance(item, (Mapping, list, tuple)):
        return 1
    key = id(item)
    if key in inside:
        return 1
    if key not in sizes:
        inside.add(key)
        children = item.values() if isinstance(item, Mapping) else item
        sizes[key] = 1 + sum(_expanded_size(child, sizes, inside) for child in children)
        inside.discard(key)
    return sizes[key]


def parse_config(mapping: object, source: str = "<dict>") -> KVTierConfig:
    """Validate a mapping (as read from YAML or JSON). Raises `ConfigError`."""
    try:
        values = _expanded_size(mapping, {}, set())
    except RecursionError:
        raise ConfigError(
            "<top level>", "values nested too deeply", f"a config (in {source})"
        ) from None
    if values > MAX_VALUES:
        raise ConfigError("<top level>", f"{values} values with its aliases written out",
                          f"at most {MAX_VALUES} values (in {source})")  # fmt: skip
    if not isinstance(mapping, Mapping):
        shown = mapping if mapping is None else HiddenText.of(mapping)
        raise ConfigError("<top level>", shown, f"a mapping of config sections (in {source})")
    try:
        return KVTierConfig.model_validate(dict(mapping))
    except ValidationError as exc:
        raise _config_error(exc, source, _key_values(mapping)) from None


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_PLAIN_WORDS = re.compile(r"[A-Za-z0-9 ,;()<>'-]{1,160}")
_KINDS = {  # by the reader's stage, for words that do not pass `_PLAIN_WORDS`
    "ScannerError": "text that is not a YAML token",
    "ParserError": "YAML structure that cannot be parsed",
    "ComposerError": "an alias or anchor that cannot be resolved",
    "ConstructorError": "a value that cannot be read",
}


_SHOWN_PART = re.compile(r"'(<[a-z ]{1,20}>|[^A-Za-z0-9\s'\\])'")
"""A quoted part shown: a token's kind (`'<scalar>'`) or one punctuation mark (`'}'`)."""


def _quoted_part(match: re.Match[str]) -> str:
    return match[0] if _SHOWN_PART.fullmatch(match[0]) else "'…'"


def _fault_kind(exc: yaml.YAMLError) -> str:
    """What kind of fault `exc` is, in words that show nothing of the file: the reader's
    problem with every quoted part (a character, an alias, anchor or tag name) made `'…'`,
    but a token's kind or a punctuation mark, or, when anything but plain words is left, the
    name of the reader's stage that failed."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or ""
    context = getattr(exc, "context", None)
    if context and str(problem).startswith("but "):  # half a sentence alone: "but found another
        problem = f"{context}, {problem}"  # document" (a second `---` document in the file)
    words = _QUOTED.sub(_quoted_part, str(problem))
    if _PLAIN_WORDS.fullmatch(_QUOTED.sub("''", words)):
        return words
    return _KINDS.get(type(exc).__name__, "text that is not YAML")


class TooManyValues(Exception):
    """More than `MAX_VALUES` nodes in a YAML document, found while it is read."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key repeated in one mapping instead of keeping the last, and
    a scalar Python cannot convert (an int of 5000 digits, a 13th month) with its line."""

    nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        """Counted as `_expanded_size` counts values (a mapping's keys are not, an alias is
        one): past `MAX_VALUES` the reading stops (`TooManyValues`), before the rest is
        parsed; a 1 MiB list of `1,1,...` was read whole first (46 s here)."""
        is_key = isinstance(parent, yaml.MappingNode) and index is None
        self.nodes += 0 if is_key else 1
        if self.nodes > MAX_VALUES:
            raise TooManyValues
        return super().compose_node(parent, index)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError):
            problem = "a value that cannot be read (a number too long, a date out of range)"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # the SafeLoader refuses it, with its line
                continue
            if key in seen:
                problem = "a key repeated in one mapping (each key once per mapping)"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_FILE_CHARS = 2**20
"""The longest config file read (the shipped ones are under 6,000 characters)."""


FIFO_WAIT_S = 10.0
"""How long a FIFO or pipe given as the config (`--config <(envsubst < tmpl)`, `/dev/stdin`)
may take, from the open to its end, before it is refused: one with no writer or a stalled one
is a `ConfigError`, never a hang."""


def _read_text(source: str) -> str:
    """The text of `source`, at most `MAX_FILE_CHARS + 1` characters: a regular file (a link to
    one followed), or a FIFO or pipe read to its end within `FIFO_WAIT_S` (`_read_stream`),
    that other users cannot write (one they can would let any local user give the server API
    keys, paths and an admin key of theirs). Opened with O_NONBLOCK, so that a FIFO blocks
    neither the open nor a read: anything else (a directory, a device) is refused naming what
    it is."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # why, in the OS's words (missing, not allowed, a loop of links)
        raise ConfigError("<file>", source, f"a readable YAML file ({exc.strerror})") from None
    except ValueError:  # a NUL byte in the path
        raise ConfigError("<file>", source, "a readable YAML file (a path without NUL)") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # open() on a directory raises
        os.close(fd)
        expected = f"a readable YAML file (a regular file or a FIFO), found {file_kind(mode)}"
        raise ConfigError("<file>", source, expected)
    if mode & stat.S_IWOTH:  # any local user could set the keys, the dirs (a FIFO's writer too)
        os.close(fd)
        expected = (
            f"a config file other users cannot write (mode {stat.S_IMODE(mode):04o}: chmod o-w)"
        )
        raise ConfigError("<file>", source, expected)
    with open(fd, encoding="utf-8") as file:
        try:
            if stat.S_ISREG(mode):
                return file.read(MAX_FILE_CHARS + 1)
            return _read_stream(fd, source).decode("utf-8")[: MAX_FILE_CHARS + 1]
        except UnicodeDecodeError:  # what, never the bytes (they may be a secret's)
            expected = "a YAML file in UTF-8 (it holds bytes that are not UTF-8 text)"
            raise ConfigError("<file>", source, expected) from None
        except OSError as exc:
            raise ConfigError("<file>", source, f"a readable YAML file ({exc.strerror})") from None


def _read_stream(fd: int, source: str) -> bytes:
    """The bytes of the FIFO `fd` (opened O_NONBLOCK) up to its end, at most
    `4 * MAX_FILE_CHARS + 1`, waiting with poll() no longer than `FIFO_WAIT_S` in all."""
    limit = 4 * MAX_FILE_CHARS + 1  # more bytes are more than MAX_FILE_CHARS characters
    deadline = time.monotonic() + FIFO_WAIT_S
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            expected = (
                f"a readable YAML file (a FIFO or pipe that ends within {FIFO_WAIT_S:g} s;"
                " none came: no writer, or one that stalled)"
            )
            raise ConfigError("<file>", source, expected)
        try:
            chunk = os.read(fd, min(1 << 16, limit - size))
        except BlockingIOError:
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _load_yaml(text: str) -> tuple[object, tuple[int, int]]:
    """The document in `text` (`yaml.load` with `_UniqueKeyLoader`, a SafeLoader) and the line
    and column (1-based) where its top level starts ((0, 0) for an empty document)."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, (0, 0)
        mark = node.start_mark
        return loader.construct_document(node), (mark.line + 1, mark.column + 1)
    finally:
        loader.dispose()


def load_config(path: str | os.PathLike[str]) -> KVTierConfig:
    """Read and validate a YAML config file. Raises `ConfigError`, never a YAML or OS error."""
    source = os.fspath(path)
    text = _read_text(source)
    if len(text) > MAX_FILE_CHARS:
        raise ConfigError("<file>", source, f"a YAML file of at most {MAX_FILE_CHARS} characters")
    fault: ConfigError | None = None  # raised outside the handler: no YAML error chained
    try:
        data, start = _load_yaml(text)
    except yaml.MarkedYAMLError as exc:  # its text and marks quote the file: none shown
        mark = exc.problem_mark or exc.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
        expected = f"valid YAML (the YAML reader says: {_fault_kind(exc)}; in {source})"
        fault = ConfigError("<yaml>", HiddenLine(line, column), expected)
    except yaml.YAMLError as exc:  # a ReaderError: a character YAML does not allow
        position = getattr(exc, "position", "?")
        expected = f"valid YAML (a character YAML does not allow at position {position})"
        fault = ConfigError("<yaml>", source, expected)
    except RecursionError:
        fault = ConfigError("<yaml>", source, "valid YAML nested less deeply")
    except TooManyValues:
        fault = ConfigError("<top level>", f"more than {MAX_VALUES} values",
                            f"at most {MAX_VALUES} values (in {source})")  # fmt: skip
    if fault is not None:
        raise fault
    if data is not None and not isinstance(data, Mapping):  # its kind and where, not its text
        expected = f"a mapping of config sections (in {source})"
        raise ConfigError("<top level>", HiddenText.of(data, *start), expected)
    return parse_config(data, source)


DEFAULT_DISK = {"capacity": "2GiB", "path": "./kvtier-data"}
"""The embedded default's disk tier: modest, and refused at start (`tiers.disk.capacity`)
where the filesystem has not that much free beyond its reserve."""


def default_config() -> KVTierConfig:
    """The embedded default (`configs/default.yaml`): `KVTierConfig()` with `DEFAULT_DISK`."""
    return parse_config({"tiers": {"disk": DEFAULT_DISK}}, "<embedded default>")
