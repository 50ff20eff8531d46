"""The shape of the code (issue 12): small modules and classes, small constructors, and no
module reaching into another's private members. Read from the source with `ast`.

- no module over 400 lines, no class over 300 (the Triton kernel bodies are functions);
- no constructor with more than 8 parameters: an explicit `__init__`, or a dataclass's fields
  (records that mirror a file format, a wire format or a model's hyperparameters excepted,
  `RECORDS`);
- no `obj._name` where `_name` is defined in another module of kvtier and not in this one, and
  no `from kvtier.x import _name`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvtier"
MODULES = sorted(ROOT.rglob("*.py"))

RECORDS = {
    "LlamaConfig",  # the model's hyperparameters, as the GGUF names them
    "LayerWeights",  # one decoder layer's tensors
    "ReplayResult",  # the figures of a replay report
    "CudaIpcDescription",  # the wire fields of a CUDA IPC handle
    "DiskCheckReport",  # the counts `kvtier check` prints
    "BlockHeader",  # the fields of the on-disk slot header
}


def trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in MODULES}


def test_no_module_over_400_lines_and_no_class_over_300() -> None:
    long_modules = {
        str(path.relative_to(ROOT)): n
        for path in MODULES
        if (n := len(path.read_text().splitlines())) > 400
    }
    long_classes = {
        f"{path.relative_to(ROOT)}:{node.name}": n
        for path, tree in trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (n := (node.end_lineno or node.lineno) - node.lineno + 1) > 300
    }
    assert (long_modules, long_classes) == ({}, {})


def _init_fields(node: ast.ClassDef) -> int | None:
    decorators = [ast.unparse(d) for d in node.decorator_list]
    if not any(d.startswith("dataclass") for d in decorators) or any(
        "init=False" in d for d in decorators
    ):
        return None
    count = 0
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if "ClassVar" in ast.unparse(item.annotation):
                continue
            if item.value is not None and "init=False" in ast.unparse(item.value):
                continue
            count += 1
    return count


def test_no_constructor_takes_more_than_8_parameters() -> None:
    wide: dict[str, int] = {}
    for path, tree in trees().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = _init_fields(node)
            if fields is not None and fields > 8 and node.name not in RECORDS:
                wide[f"{path.relative_to(ROOT)}:{node.name} (fields)"] = fields
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    n = len(args.args) - 1 + len(args.kwonlyargs)
                    n += (args.vararg is not None) + (args.kwarg is not None)
                    if n > 8:
                        wide[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert wide == {}


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def test_no_private_member_is_used_across_modules() -> None:
    parsed = trees()
    defined = {path: _defined(tree) for path, tree in parsed.items()}
    ours = set().union(*defined.values())
    leaks: list[str] = []
    for path, tree in parsed.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name = node.attr
                private = name.startswith("_") and not name.startswith("__")
                if private and name in ours and name not in defined[path]:
                    leaks.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
                leaks.extend(
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                )
    assert leaks == []


@pytest.mark.parametrize("name", ["_flights", "_owners"])
def test_the_private_member_check_can_fail(tmp_path: Path, name: str) -> None:
    """The check above sees a leak when one module reads another's private attribute."""
    a = ast.parse(f"class A:\n    def __init__(self):\n        self.{name} = []\n")
    b = ast.parse(f"def peek(a):\n    return a.{name}\n")
    defined_a, defined_b = _defined(a), _defined(b)
    uses = [n.attr for n in ast.walk(b) if isinstance(n, ast.Attribute)]
    assert name in defined_a and name not in defined_b and uses == [name]
