"""specgraph: a compiler for speculative decoding.

``compile(model, draft)`` makes a HF causal LM speculate with a draft
(``specgraph.drafts``) over a tree (``Chain``, ``StaticTree``, ``DynamicTree``; ``WithLookup`` adds a prompt-lookup branch);
``attach(model, draft)`` routes the model's own ``generate`` through it.
docs/api.md lists every public name; docs/design.md is the map.
"""
from . import drafts
from .api import SpecModel, compile
from .attach import attach, detach
from .errors import CompileError
from .trees import (
    EAGLE1_MC_SIM_7B_63,
    MAX_NODES,
    MEDUSA_MC_SIM_7B_63,
    Chain,
    DynamicTree,
    StaticTree,
    Tree,
    TreeSpec,
    WithLookup,
)
from .selection import select_tree

__version__ = "0.1.0.dev0"

__all__ = [
    "compile", "attach", "detach", "SpecModel", "CompileError", "drafts",
    "Chain", "StaticTree", "DynamicTree", "TreeSpec", "WithLookup", "Tree", "select_tree",
    "EAGLE1_MC_SIM_7B_63", "MEDUSA_MC_SIM_7B_63", "MAX_NODES", "__version__",
]
