"""Typed errors for the caller's mistakes and for conditions the caller must handle.

Contract: every error raised at a public boundary of kvtier is a `KVTierError`. Its message
names the bad value and what was expected, so that a log line alone tells an operator what to
fix. Errors of the caller never change stored state: the raising method checks before it
commits. Our own bugs are `assert`s (or `InvariantError` from a `check()`), never these.

Each error also subclasses the closest builtin (`ValueError`, `KeyError`, ...), so callers that
catch builtins keep working.

A caller's value in a message is `shown(value)`: bounded, whatever its size, and never an int
converted to decimal past 40 digits (Python refuses past 4300, and the work grows with the
square of the length), so a huge argument gets the typed error a small bad one gets.
"""

from __future__ import annotations

import reprlib

SHOWN_CHARS = 80
"""The most characters `shown` keeps of a value's repr (a marker of its length follows)."""

_DIGITS = 10**40


def _integer(value: int) -> str:
    if -_DIGITS < value < _DIGITS:
        return repr(value)
    sign = "a negative" if value < 0 else "an"
    return f"{sign} integer of {value.bit_length()} bits"


class _Bounded(reprlib.Repr):
    """`reprlib`'s bounded repr, with ints (inside containers too) through `_integer`."""

    def repr_int(self, x: int, level: int) -> str:
        return _integer(x)


_REPR = _Bounded()
_REPR.maxstring = _REPR.maxother = SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 8


def shown(value: object) -> str:
    """`value` as an error message shows it: its repr, at most `SHOWN_CHARS` characters plus
    a marker; an int past 40 digits (sign included) as `an integer of N bits`. The work is
    bounded by the shown size (containers show their first few items), and it never raises."""
    if type(value) is int:
        return _integer(value)
    try:
        text = _REPR.repr(value)
    except Exception:  # a caller's object whose __repr__ fails is still named
        text = f"<a {type(value).__name__}>"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}… (cut: {len(text)} characters)"


class KVTierError(Exception):
    """Base of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid. `field` is the dotted path, e.g. `tiers.gpu.capacity`."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        # a path or URL of the operator's is shown whole; anything else bounded (`shown`)
        got = repr(value) if type(value) is str and len(value) <= 1024 else shown(value)
        super().__init__(f"config field {field!r}: got {got}, expected {expected}")


class InvalidTokensError(KVTierError, ValueError):
    """Token ids are not a 1-D sequence of non-negative integers below 2**32."""


class InvalidKVError(KVTierError, ValueError):
    """A KV tensor has the wrong dtype, shape or device for the store's layout."""


class UnknownTenantError(KVTierError, KeyError):
    """A tenant id that the configuration does not list."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class LeaseError(KVTierError, KeyError):
    """A lease id that is unknown, already released or expired."""

    def __str__(self) -> str:
        return str(self.args[0])


class CapacityError(KVTierError, MemoryError):
    """A request cannot be satisfied within a tier's capacity; nothing was changed."""


class QuotaError(CapacityError):
    """A tenant's quota (leased or reserved blocks of a tier, `tenants.<id>.quota`) would be
    exceeded; nothing was changed. The message names the tenant, the tier and the limit."""


class NotWrittenError(KVTierError, ValueError):
    """A reservation's slot was committed without being written (or its reservation ended
    before the write): a slot publishes only bytes its reserver wrote (DESIGN invariant 8)."""


class StorageError(KVTierError, OSError):
    """The disk refused a write that an operation needs to be durable (a clear, a persist):
    the operation did not take durable effect, and the message says what is left."""


class ReplyError(KVTierError, ValueError):
    """A sidecar's reply that the client refuses (`kvtier.client`): a field of the wrong type
    or out of range, a shared-memory name that is not one of ours, a CUDA IPC description that
    does not fit the layout. The message names the field; nothing was mapped or written."""


class LayoutChangedError(ReplyError):
    """The server behind a client's URL restarted with another model layout than the one the
    client was serving (`pools.layout`): nothing of this call was read or written; its KV would
    be the other layout's."""


class ClosedError(KVTierError, RuntimeError):
    """The store (or one of its parts) was closed."""


class InvariantError(KVTierError, AssertionError):
    """`check()` found state that breaks a DESIGN.md invariant; the message has the numbers."""


class InvalidArgumentError(KVTierError, ValueError):
    """Another argument of a public method is out of range or of the wrong type."""


class ResidencyError(KVTierError, LookupError):
    """A kernel was asked to read a gpu slot that no live lease covers (unleased, released,
    expired, freed or demoted): its memory may hold another block, or none."""


class TraceError(KVTierError, ValueError):
    """A request trace (`kvtier replay`) cannot be read: the message names the file and the
    1-based line, the bad value and what was expected. `line` is 0 for the file as a whole."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line else path
        super().__init__(f"trace {where}: {problem}")
