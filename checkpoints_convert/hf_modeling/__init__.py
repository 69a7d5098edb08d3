"""The modeling code shipped into NOSA / InfLLM-V2 exports.

``write_modeling_files(out_dir)`` writes ``modeling_nosa.py``, ``attention_nosa.py`` (its attention layer) and
``configuration_nosa.py`` (this folder, ``OWN_FILES``; the config class gives sparse exports their own
``model_type``) and COPIES of the modules they use: the NOSA
reference of ``nosa_layers`` (the single source of the NOSA math), the decode kernels of ``nosa_layers.ops``
and the decode engine of ``inference`` (``SHIPPED``), each as ``nosa_<module>.py`` next to the modeling file
(transformers loads remote code from one flat folder), with its imports of shipped modules made relative, so
the export runs with only torch + transformers installed. Imports of other framework parts (the training
kernels in ``nosa_layers.ops``) become lazy ``importlib`` calls, which the guarded code paths only reach when
the framework is installed. Eviction heads registered from outside ``nosa_layers/eviction.py`` travel as
copies of their class source appended to ``nosa_eviction.py`` (:func:`extra_eviction_heads`).
"""

from __future__ import annotations

import ast
import builtins
import dis
import importlib.util
import inspect
import re
import textwrap
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELING_FILE = "modeling_nosa.py"
ATTENTION_FILE = "attention_nosa.py"
CONFIG_FILE = "configuration_nosa.py"
OWN_FILES = (MODELING_FILE, ATTENTION_FILE, CONFIG_FILE)  # this folder's files an export ships
MODEL_CLASS = "NOSALlamaForCausalLM"
CONFIG_CLASS = "NOSALlamaConfig"
AUTO_MAP = {"AutoConfig": f"configuration_nosa.{CONFIG_CLASS}", "AutoModelForCausalLM": f"modeling_nosa.{MODEL_CLASS}"}
# modules copied next to the modeling file, each as ``shipped_name(module)``
SHIPPED = (
    "nosa_layers.config", "nosa_layers.eviction", "nosa_layers.selection", "nosa_layers.reference",
    "nosa_layers.dispatch", "nosa_layers.decode", "nosa_layers.query_chunks",  # the NOSA reference
    "nosa_layers.ops.decode_attention", "nosa_layers.ops.decode_selection",  # the decode kernels (optional Triton)
    "nosa_layers.ops.offload_copy",
    "inference.storage", "inference.stats", "inference.streams", "inference.transfers", "inference.decode_select",
    "inference.decode_step", "inference.decode_graph", "inference.block_cache",  # the decode engine
)
PACKAGES = ("nosa_layers", "inference")  # what an export must not import as such

_FROM_OTHER = re.compile(r"^(\s*)from (nosa_layers(?:\.\w+)*) import ([\w, ]+?)\s*(#.*)?$", re.M)
_IMPORT_OTHER = re.compile(r"^(\s*)import (nosa_layers(?:\.\w+)*)\s*(#.*)?$", re.M)
_ANY = re.compile(r"^\s*(from|import)\s+(" + "|".join(PACKAGES) + r")\b.*$", re.M)


def shipped_name(module: str) -> str:
    """The file a shipped module is copied to: ``nosa_<last part of its name>.py``."""
    return f"nosa_{module.rsplit('.', 1)[-1]}.py"


def rewrite_source(src: str, where: str = "a shipped module") -> str:
    """Make one shipped file self-contained inside an export directory: imports of shipped modules become
    relative (``from .nosa_selection import ...``), those of other ``nosa_layers`` modules lazy; a module-level
    import of an unshipped module (it would fail without the framework) is an error naming it."""
    shipped = re.compile(r"^(\s*)from (" + "|".join(re.escape(m) for m in SHIPPED) + r") import ", re.M)
    src = shipped.sub(lambda m: f"{m.group(1)}from .{shipped_name(m.group(2))[:-3]} import ", src)

    def lazy_from(m: re.Match) -> str:
        ind, mod, names = m.group(1), m.group(2), [n.strip() for n in m.group(3).split(",") if n.strip()]
        if not ind:
            raise RuntimeError(f"{where} imports {mod} at module level, which exports do not ship; add it to "
                               f"checkpoints_convert.hf_modeling.SHIPPED or import it where it is used")
        binds = "; ".join(f"{n} = _mod.{n}" for n in names)
        return f'{ind}_mod = __import__("importlib").import_module("{mod}"); {binds}'

    src = _FROM_OTHER.sub(lazy_from, src)
    src = _IMPORT_OTHER.sub(lambda m: f'{m.group(1)}__import__("importlib").import_module("{m.group(2)}")', src)
    left = _ANY.findall(src)
    if left:
        raise RuntimeError(f"{where}: could not make {len(left)} import(s) of {', '.join(PACKAGES)} relative "
                           f"(only 'from <shipped module> import ...' lines are rewritten)")
    return src


def extra_eviction_heads() -> str:
    """Source of every registered eviction head defined outside ``nosa_layers/eviction.py``, each
    followed by its registration, to append to the shipped copy of that module.

    A head class may use only what ``eviction.py`` defines (``torch``, ``nn``, ``F``,
    ``EvictionHead``, ...) and earlier heads; anything else is a one-line error naming it."""
    from nosa_layers import eviction

    known = set(vars(eviction)) | set(dir(builtins))
    parts = []
    for name, cls in eviction.EVICTION_HEADS.items():
        if cls.__module__ == eviction.__name__:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        tree.body[0].decorator_list = []  # registered explicitly below
        src = ast.unparse(tree)
        unknown = _free_names(compile(src, cls.__qualname__, "exec")) - known
        if unknown:
            raise ValueError(f"eviction head {name!r} ({cls.__module__}.{cls.__qualname__}) uses "
                               f"{', '.join(sorted(unknown))}, which an export cannot ship; define "
                               f"them inside the class or in nosa_layers/eviction.py")
        parts.append(f"\n\n# eviction head {name!r}, copied from {cls.__module__}\n{src}\n"
                     f"register_eviction_head({name!r})({cls.__name__})\n")
        known.add(cls.__name__)
    return "".join(parts)


def _free_names(code: types.CodeType) -> set:
    """Global names a compiled class reads (its body and every function in it)."""
    loaded, stored = set(), set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            loaded.add(ins.argval)
        elif ins.opname == "STORE_NAME":
            stored.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            loaded |= _free_names(const)
    return loaded - stored


def reference_sources() -> dict:
    """``{file name: source}`` of every file an export ships (modeling file included)."""
    header = ("# Copied from {path} by checkpoints_convert.to_hf (imports made relative).\n"
              "# Do not edit: the framework's module is the single source of this code.\n")
    files = {name: rewrite_source((HERE / name).read_text(), name) for name in OWN_FILES}
    for module in SHIPPED:
        name = shipped_name(module)
        if name in files:
            raise RuntimeError(f"export file name clash: {module} would ship as {name}, the name of another "
                               f"shipped file; rename one")
        package, *rest = module.split(".")
        root = Path(importlib.util.find_spec(package).origin).parent  # found, not imported
        rel = "/".join([package, *rest]) + ".py"
        src = (root / Path(*rest)).with_suffix(".py").read_text()
        src += extra_eviction_heads() if module == "nosa_layers.eviction" else ""
        files[name] = header.format(path=rel) + rewrite_source(src, rel)
    return files


def write_modeling_files(out_dir) -> list:
    out = Path(out_dir)
    written = []
    for name, src in reference_sources().items():
        (out / name).write_text(src)
        written.append(name)
    return written
