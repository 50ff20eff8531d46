"""Reading the status page's figures back, for the tests that hold them to `/v1/status`.

    figures(html) -> {dotted path: value}    every `data-field` of the page, its `data-value`
                                             read back as the status would give it
    at(status, path) -> value                the same path read out of a `/v1/status` body
    mismatches(page, status, paths) -> list  the paths whose values differ, with both values

A parser of our own over the standard library's `HTMLParser`, not the page's renderer: a test
must not read the page with the code that wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from html.parser import HTMLParser
from typing import Any

MISSING = object()


class _Fields(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}
        self.repeated: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        field, value = named.get("data-field"), named.get("data-value")
        if field is None or value is None:
            return
        if field in self.found:
            self.repeated.append(field)
        self.found[field] = value


def figures(html: str) -> dict[str, Any]:
    """Every figure of the page: numbers, booleans and nulls as JSON, strings as they are."""
    parser = _Fields()
    parser.feed(html)
    parser.close()
    assert not parser.repeated, f"fields shown twice: {parser.repeated}"
    out: dict[str, Any] = {}
    for field, text in parser.found.items():
        try:
            out[field] = json.loads(text)
        except json.JSONDecodeError:
            out[field] = text
    return out


def at(status: Mapping[str, Any], path: str) -> Any:
    """The value at dotted `path` in `status`, or MISSING."""
    node: Any = status
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def mismatches(
    page: Mapping[str, Any], status: Mapping[str, Any], paths: Iterable[str]
) -> list[tuple[str, Any, Any]]:
    """(path, page's value, status' value) for each of `paths` where they differ (a string
    figure of the page equals the status' value as text: `location`, `codec`)."""
    wrong = []
    for path in paths:
        want, got = at(status, path), page.get(path, MISSING)
        if isinstance(want, str):
            got = str(got)
        if got != want:
            wrong.append((path, got, want))
    return wrong
