"""What a PromQL expression refers to, and whether a sidecar's /metrics has it (`test_deploy.py`).

    exported = Exported.parse(metrics_text)
    exported.problems(Query("rule KvtierDown", 'rate(kvtier_x_total{tier="gpu"}[5m])'))
    # ['rule KvtierDown: kvtier_x_total is not exported', ...]

A query names series by their sample names, as Prometheus stores them: a counter as
`<name>_total`, a histogram as `<name>_bucket` / `_count` / `_sum`. So are the names compared:
sample name to sample name, with no suffix stripped (a rule reading `kvtier_tier_hits` would
find nothing in Prometheus, and is reported). Checked per query: every `kvtier_*` name is
exported; every label a `kvtier_*` selector matches on is a label of that name, and every
value it selects (`=`, or `=~` an alternation of plain values) is one of its exported values;
every label the query groups by (`by`, `on`, ...) or prints (a legend's `{{label}}`, a rule
annotation's `$labels.label`) is a label of one of its names. `instance` and `job`, the labels
Prometheus adds at scrape, are always allowed; a value with a `$` (a Grafana variable) is not
checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TARGET_LABELS = frozenset({"instance", "job"})
"""Labels Prometheus attaches to every scraped series: never in /metrics itself."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = re.compile(r"(?<![\w:])kvtier_\w+")
_SELECTOR = re.compile(r"(?<![\w:])(kvtier_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_PLAIN_VALUES = re.compile(r"[\w./>-]+(?:\|[\w./>-]+)*")


@dataclass(frozen=True)
class Matcher:
    metric: str
    label: str
    op: str
    value: str


@dataclass(frozen=True)
class Query:
    """One PromQL expression, where it came from, and the labels its output prints."""

    where: str
    expr: str
    printed: frozenset[str] = field(default_factory=frozenset)


def names(expr: str) -> set[str]:
    """The `kvtier_*` names in `expr`, outside its string literals."""
    return set(_NAME.findall(_STRING.sub('""', expr)))


def matchers(expr: str) -> list[Matcher]:
    """The label matchers of every `kvtier_*` selector in `expr`."""
    return [
        Matcher(metric, *m.groups())
        for metric, body in _SELECTOR.findall(expr)
        for m in _MATCHER.finditer(body)
    ]


def grouping(expr: str) -> set[str]:
    """Labels named by `by (...)`, `without`, `on`, `ignoring`, `group_left`, `group_right`."""
    return {
        label.strip()
        for found in _GROUPING.findall(_STRING.sub('""', expr))
        for label in found.split(",")
        if label.strip()
    }


def printed(template: str) -> frozenset[str]:
    """Labels a Grafana legend (`{{tier}}`) or a rule annotation (`$labels.tier`) prints."""
    legend = re.findall(r"\{\{\s*(\w+)\s*\}\}", template)
    return frozenset(legend + re.findall(r"\$labels\.(\w+)", template))


@dataclass(frozen=True)
class Exported:
    """The samples of one /metrics page: each sample name's labels and their values."""

    labels: dict[str, frozenset[str]]
    values: dict[tuple[str, str], frozenset[str]]

    @classmethod
    def parse(cls, text: str) -> Exported:
        labels: dict[str, set[str]] = {}
        values: dict[tuple[str, str], set[str]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    values.setdefault((sample.name, label), set()).add(value)
        return cls(
            {name: frozenset(found) for name, found in labels.items()},
            {key: frozenset(found) for key, found in values.items()},
        )

    def problems(self, query: Query) -> list[str]:
        """What `query` refers to that these samples lack, one line each (module doc)."""
        used = names(query.expr)
        out = [f"{name} is not exported" for name in sorted(used - self.labels.keys())]
        for m in matchers(query.expr):
            if m.label in TARGET_LABELS or "$" in m.value:
                continue
            if m.label not in self.labels.get(m.metric, ()):
                out.append(f"{m.metric} has no label {m.label!r}")
                continue
            if m.op == "=~" and _PLAIN_VALUES.fullmatch(m.value) is None:
                out.append(f"{m.metric}{{{m.label}=~{m.value!r}}}: not a list of plain values")
                continue
            if m.op in ("=", "=~"):
                have = self.values.get((m.metric, m.label), frozenset())
                out += [
                    f"{m.metric}{{{m.label}={value!r}}} is not exported"
                    for value in m.value.split("|")
                    if value not in have
                ]
        known = TARGET_LABELS.union(*(self.labels.get(name, ()) for name in used))
        out += [
            f"label {label!r} is on none of {sorted(used)}"
            for label in sorted((grouping(query.expr) | query.printed) - known)
        ]
        return [f"{query.where}: {line}" for line in out]
