"""The modeling code shipped into NOSA / InfLLM-V2 exports.

``write_modeling_files(out_dir)`` writes ``modeling_nosa.py`` and ``configuration_nosa.py`` (this
folder; the config class gives sparse exports their own ``model_type``) and COPIES of the
reference modules of ``nosa_layers`` it uses, renamed ``nosa_<module>.py`` with their package
imports made relative, so the export runs with only torch + transformers installed. Imports of
optional framework parts (the Triton kernels in ``nosa_layers.ops``) become lazy
``importlib`` calls, which the guarded code paths only reach when the framework is installed.
Eviction heads registered from outside ``nosa_layers/eviction.py`` travel as copies of their
class source appended to ``nosa_eviction.py`` (:func:`extra_eviction_heads`).
"""

from __future__ import annotations

import ast
import builtins
import dis
import inspect
import re
import textwrap
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELING_FILE = "modeling_nosa.py"
CONFIG_FILE = "configuration_nosa.py"
MODEL_CLASS = "NOSALlamaForCausalLM"
CONFIG_CLASS = "NOSALlamaConfig"
AUTO_MAP = {"AutoConfig": f"configuration_nosa.{CONFIG_CLASS}", "AutoModelForCausalLM": f"modeling_nosa.{MODEL_CLASS}"}
# modules of this folder shipped with the modeling file (they import the reference copies relatively)
MODELING_HELPERS = ("nosa_block_cache.py", "nosa_decode_select.py", "nosa_decode_attn.py", "nosa_decode_graph.py",
                    "nosa_uva.py")
# reference modules shipped next to the modeling file (the single source of NOSA math)
SHIPPED = ("config", "eviction", "selection", "reference", "dispatch", "decode")

_FROM_SHIPPED = re.compile(r"^(\s*)from nosa_layers\.(" + "|".join(SHIPPED) + r") import ", re.M)
_FROM_OTHER = re.compile(r"^(\s*)from (nosa_layers(?:\.\w+)*) import ([\w, ]+?)\s*(#.*)?$", re.M)
_IMPORT_OTHER = re.compile(r"^(\s*)import (nosa_layers(?:\.\w+)*)\s*(#.*)?$", re.M)
_ANY = re.compile(r"^\s*(from|import)\s+nosa_layers\b", re.M)


def rewrite_reference_source(src: str) -> str:
    """Make one reference module self-contained inside an export directory."""
    src = _FROM_SHIPPED.sub(lambda m: f"{m.group(1)}from .nosa_{m.group(2)} import ", src)

    def lazy_from(m: re.Match) -> str:
        ind, mod, names = m.group(1), m.group(2), [n.strip() for n in m.group(3).split(",") if n.strip()]
        binds = "; ".join(f"{n} = _mod.{n}" for n in names)
        return f'{ind}_mod = __import__("importlib").import_module("{mod}"); {binds}'

    src = _FROM_OTHER.sub(lazy_from, src)
    src = _IMPORT_OTHER.sub(lambda m: f'{m.group(1)}__import__("importlib").import_module("{m.group(2)}")', src)
    left = _ANY.findall(src)
    if left:
        raise RuntimeError(f"could not make {len(left)} nosa_layers import(s) relative")
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
    import nosa_layers

    pkg = Path(nosa_layers.__file__).resolve().parent
    header = ("# Copied from nosa_layers/{name}.py by checkpoints_convert.to_hf (imports made relative).\n"
              "# Do not edit: the framework's reference is the single source of the NOSA math.\n")
    files = {name: (HERE / name).read_text() for name in (MODELING_FILE, CONFIG_FILE, *MODELING_HELPERS)}
    for name in SHIPPED:
        if f"nosa_{name}.py" in files:
            raise RuntimeError(f"export file name clash: nosa_layers/{name}.py would ship as nosa_{name}.py, "
                               f"the name of a modeling file of checkpoints_convert/hf_modeling; rename one")
        src = (pkg / f"{name}.py").read_text() + (extra_eviction_heads() if name == "eviction" else "")
        files[f"nosa_{name}.py"] = header.format(name=name) + rewrite_reference_source(src)
    return files


def write_modeling_files(out_dir) -> list:
    out = Path(out_dir)
    written = []
    for name, src in reference_sources().items():
        (out / name).write_text(src)
        written.append(name)
    return written
