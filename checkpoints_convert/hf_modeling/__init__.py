"""The modeling code shipped into NOSA / InfLLM-V2 exports.

``write_modeling_files(out_dir)`` writes ``modeling_nosa.py`` (this folder) and COPIES of the
reference modules of ``nosa_layers`` it uses, renamed ``nosa_<module>.py`` with their package
imports made relative, so the export runs with only torch + transformers installed. Imports of
optional framework parts (the Triton kernels in ``nosa_layers.ops``) become lazy
``importlib`` calls, which the guarded code paths only reach when the framework is installed.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELING_FILE = "modeling_nosa.py"
MODEL_CLASS = "NOSALlamaForCausalLM"
AUTO_MAP = {"AutoModelForCausalLM": f"modeling_nosa.{MODEL_CLASS}"}
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


def reference_sources() -> dict:
    """``{file name: source}`` of every file an export ships (modeling file included)."""
    import nosa_layers

    pkg = Path(nosa_layers.__file__).resolve().parent
    header = ("# Copied from nosa_layers/{name}.py by checkpoints_convert.to_hf (imports made relative).\n"
              "# Do not edit: the framework's reference is the single source of the NOSA math.\n")
    files = {MODELING_FILE: (HERE / MODELING_FILE).read_text()}
    for name in SHIPPED:
        files[f"nosa_{name}.py"] = header.format(name=name) + rewrite_reference_source((pkg / f"{name}.py").read_text())
    return files


def write_modeling_files(out_dir) -> list:
    out = Path(out_dir)
    written = []
    for name, src in reference_sources().items():
        (out / name).write_text(src)
        written.append(name)
    return written
