"""The layering of docs/ARCHITECTURE.md, checked on the source: every import statement of every product
module (function-level imports included) is read with ``ast``; no product module is imported. A new import
that breaks a rule fails; today's known exceptions are reported as warnings until they are fixed, and one
that no longer occurs fails until it is deleted from its list (so the lists cannot go stale)."""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the other packages of this repository it may import (docs/ARCHITECTURE.md, "Package floors")
LIBRARIES = {"nosa_layers", "data"}
MAY_IMPORT = {
    "nosa_layers": set(),
    "data": set(),
    "runtime": LIBRARIES,
    "inference": LIBRARIES,
    "train": {"runtime"} | LIBRARIES,
    "checkpoints_convert": {"inference", "runtime"} | LIBRARIES,
    "eval": {"checkpoints_convert", "inference", "runtime"} | LIBRARIES,
    "bench": {"eval", "checkpoints_convert", "inference", "runtime"} | LIBRARIES,
}

# inside nosa_layers, lowest floor first; a module belongs to the floor of its longest listed prefix
NOSA_FLOORS = {
    "references": ("nosa_layers.config", "nosa_layers.reference", "nosa_layers.selection", "nosa_layers.eviction",
                   "nosa_layers.decode", "nosa_layers.locality", "nosa_layers.rope", "nosa_layers.query_chunks"),
    "ops": ("nosa_layers.ops",),
    "dispatch": ("nosa_layers.dispatch", "nosa_layers"),  # the package root is the public API over dispatch
    "layers": ("nosa_layers.megatron", "nosa_layers.reference_layer", "nosa_layers.demo"),
}
# the fused-op exception: the layers call these kernels themselves (no backend to choose), no other of ops/
FUSED_OPS = {"nosa_layers.ops.rms_norm", "nosa_layers.ops.rope", "nosa_layers.ops.gated_score",
             "nosa_layers.ops._common"}

# Known exceptions, (importer, imported) -> why. Reported until fixed; see docs/ARCHITECTURE.md.
KNOWN_FLOOR_BREAKS = {
    ("bench.attention.breakdown", "train.profiling"): "reuses the profiler's kernel classification and "
                                                      "device_ms_per_call",
    ("bench.attention.selection", "train.profiling"): "reuses the profiler's device_ms_per_call",
    ("bench.probes.layer_host", "train.host_time"): "reuses the launch-function prefixes of the host-time breakdown",
    ("bench.probes.host_syncs", "train.main"): "runs the trainer in its own process under CUDA's sync debug mode",
    ("bench.probes.host_syncs", "train.trainer"): "runs the trainer in its own process under CUDA's sync debug mode",
}
KNOWN_CYCLES: dict = {}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (a module of the scanned tree)
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


def product_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the packages in ``MAY_IMPORT`` (a package is its ``__init__``)."""
    out = {}
    for package in MAY_IMPORT:
        for f in sorted((root / package).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a scanned module (``a.b.f`` -> ``a.b`` when ``f`` is a name)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The imports of one module that name a scanned module. ``bench/`` scripts import each other by bare
    name (the folder is on ``sys.path``), so there a bare name of a ``bench`` module means that module."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def target(name: str) -> str | None:
        hit = _resolve(name, modules)
        if hit is None and module.startswith("bench.") and f"bench.{name.split('.')[0]}" in modules:
            hit = f"bench.{name.split('.')[0]}"
        return hit

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), type_only)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    up = package[: len(package) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                # ``from a import b``: the submodule a.b when there is one, else the module a
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
            for name in dict.fromkeys(names):
                hit = target(name) if name else None
                if hit is not None and hit != module:
                    found.append(Import(module, hit, child.lineno, type_only))
            visit(child, type_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def all_imports(root: Path) -> tuple[dict[str, Path], list[Import]]:
    modules = product_modules(root)
    return modules, [imp for m, f in modules.items() for imp in imports_of(m, f, modules)]


def nosa_floor(module: str) -> str | None:
    best, floor = -1, None
    for name, prefixes in NOSA_FLOORS.items():
        for p in prefixes:
            exact_root = p == "nosa_layers"  # the root module only, not everything under it
            if (module == p or (not exact_root and module.startswith(p + "."))) and len(p) > best:
                best, floor = len(p), name
    return floor


def floor_breaks(imports: list[Import]) -> list[Import]:
    """Imports between packages that ``MAY_IMPORT`` does not allow."""
    out = []
    for imp in imports:
        a, b = imp.importer.split(".")[0], imp.imported.split(".")[0]
        if a != b and b not in MAY_IMPORT[a]:
            out.append(imp)
    return out


def nosa_breaks(imports: list[Import]) -> list[Import]:
    """Imports inside nosa_layers that point up (references <- ops <- dispatch <- layers), or from the layers
    into ops/ beyond the fused ops."""
    order = list(NOSA_FLOORS)
    out = []
    for imp in imports:
        a, b = nosa_floor(imp.importer), nosa_floor(imp.imported)
        if a is None or b is None:
            continue
        up = order.index(b) > order.index(a)
        past_dispatch = a == "layers" and b == "ops" and imp.imported not in FUSED_OPS
        if up or past_dispatch:
            out.append(imp)
    return out


def mutual_imports(imports: list[Import]) -> dict[frozenset, list[Import]]:
    """Pairs of modules that import each other (imports that run; ``TYPE_CHECKING`` ones left out)."""
    by_pair: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if not imp.type_only:
            by_pair.setdefault((imp.importer, imp.imported), []).append(imp)
    return {frozenset(p): by_pair[p] + by_pair[p[::-1]] for p in by_pair if p[::-1] in by_pair and p[0] < p[1]}


def _judge(found: dict, known: dict, what: str) -> None:
    new = {k: v for k, v in found.items() if k not in known}
    assert not new, f"{what} (docs/ARCHITECTURE.md):\n" + "\n".join(
        f"  {', '.join(i.where() for i in v)}" for v in new.values())
    gone = [k for k in known if k not in found]
    assert not gone, f"known exceptions that no longer occur; delete them here and in docs/ARCHITECTURE.md: {gone}"
    for k, v in found.items():
        warnings.warn(f"known {what}: {', '.join(i.where() for i in v)}: {known[k]}", stacklevel=2)


@pytest.fixture(scope="module")
def product():
    return all_imports(ROOT)


def test_every_product_module_sits_on_a_floor(product):
    modules, _ = product
    assert len(modules) > 100 and "nosa_layers.ops.attention_op" in modules and "bench.train_throughput" in modules
    unplaced = [m for m in modules if m.startswith("nosa_layers") and nosa_floor(m) is None]
    assert not unplaced, f"nosa_layers modules on no floor (add them to NOSA_FLOORS, docs/ARCHITECTURE.md): {unplaced}"


def test_packages_import_only_downward(product):
    _, imports = product
    found: dict = {}
    for imp in floor_breaks(imports):
        found.setdefault((imp.importer, imp.imported), []).append(imp)
    _judge(found, KNOWN_FLOOR_BREAKS, "import against the package floors")


def test_nosa_layers_references_ops_dispatch_layers(product):
    _, imports = product
    breaks = nosa_breaks(imports)
    assert not breaks, "imports against references <- ops <- dispatch <- layers (docs/ARCHITECTURE.md):\n" + "\n".join(
        f"  {i.where()}" for i in breaks)


def test_no_two_product_modules_import_each_other(product):
    _, imports = product
    _judge(mutual_imports(imports), KNOWN_CYCLES, "pair of modules importing each other")


def _write(root: Path, files: dict[str, str]) -> None:
    for package in MAY_IMPORT:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_finds_each_kind_of_break(tmp_path):
    """On a small tree with one break of each rule and the allowed cases beside them."""
    _write(tmp_path, {
        "data/loader.py": "def f():\n    from nosa_layers.selection import x\n",  # a library importing the other
        "runtime/files.py": "from nosa_layers.config import C\n",  # allowed
        "train/main.py": "",
        "eval/run.py": "from train import main\n",  # nothing imports train
        "bench/a.py": "from b import helper\nfrom eval.run import g\n",  # bare sibling name; bench -> eval allowed
        "bench/b.py": "import a\n",
        "nosa_layers/config.py": "",
        "nosa_layers/selection.py": "from nosa_layers.dispatch import f\n",  # a reference reaching up
        "nosa_layers/dispatch.py": "from nosa_layers import ops\n",
        "nosa_layers/ops/__init__.py": "from .topk import t\n",
        "nosa_layers/ops/topk.py": "from ..config import C\n",  # relative, downward
        "nosa_layers/ops/rope.py": "",
        "nosa_layers/megatron/layer.py": "from nosa_layers.ops.rope import r\nfrom nosa_layers.ops.topk import t\n"
                                         "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from nosa_layers.megatron.spec import S\n",
        "nosa_layers/megatron/spec.py": "from nosa_layers.megatron.layer import L\n",
    })
    modules, imports = all_imports(tmp_path)
    pairs = {(i.importer, i.imported) for i in floor_breaks(imports)}
    assert pairs == {("data.loader", "nosa_layers.selection"), ("eval.run", "train.main")}
    assert {(i.importer, i.imported) for i in nosa_breaks(imports)} == {
        ("nosa_layers.selection", "nosa_layers.dispatch"), ("nosa_layers.megatron.layer", "nosa_layers.ops.topk")}
    assert set(mutual_imports(imports)) == {frozenset({"bench.a", "bench.b"})}  # the TYPE_CHECKING pair is not one
    assert ("nosa_layers.ops.topk", "nosa_layers.config") in {(i.importer, i.imported) for i in imports}
    assert ("nosa_layers.dispatch", "nosa_layers.ops") in {(i.importer, i.imported) for i in imports}


def test_a_known_exception_that_no_longer_occurs_fails_until_deleted():
    imp = Import("bench.a", "train.main", 3, False)
    known = {("bench.a", "train.main"): "why", ("bench.b", "train.x"): "why"}
    with pytest.raises(AssertionError, match="no longer occur"):
        _judge({("bench.a", "train.main"): [imp]}, known, "x")
    with pytest.raises(AssertionError, match=r"bench.a -> train.main \(line 3\)"):
        _judge({("bench.a", "train.main"): [imp]}, {}, "x")
    with pytest.warns(UserWarning, match="known x: bench.a -> train.main .line 3.: why"):
        _judge({("bench.a", "train.main"): [imp]}, {("bench.a", "train.main"): "why"}, "x")
