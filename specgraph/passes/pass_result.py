"""What every pass returns, what it is given, and how it declares its order and states its contract."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch


ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


class PassContractError(RuntimeError):
    """A pass broke its own postcondition, or the graph broke an invariant of passes/README.md after a
    pass: a specgraph bug (the model is not at fault). Raised, never asserted, so ``python -O`` keeps it."""


class PipelineOrderError(ValueError):
    """A pipeline lists a pass before one it must follow (its ``after``)."""


_IN_PIPELINE = contextvars.ContextVar("specgraph_in_pipeline", default=False)


def recompile(gm: torch.fx.GraphModule) -> None:
    """A pass's last step: ``gm``'s Python code made again from its rewritten graph, so that it runs as
    rewritten. Inside ``run_pipeline`` (``one_recompile``) left to the pipeline's end: no pass runs the
    module, and the code generation was half of a capture's pass time, once per pass."""
    if not _IN_PIPELINE.get():
        gm.recompile()


@contextlib.contextmanager
def one_recompile():
    """Passes run inside it leave ``recompile`` to the caller, who recompiles the final module once."""
    token = _IN_PIPELINE.set(True)
    try:
        yield
    finally:
        _IN_PIPELINE.reset(token)


def ensure(ok: bool, pass_name: str, what: str) -> None:
    """A pass's postcondition: raise ``PassContractError`` naming the pass and ``what`` broke unless ``ok``."""
    if not ok:
        raise PassContractError(f"{pass_name}: {what}")


def graph_pass(*, after: tuple[str, ...] = ()):
    """Declare a pass and the passes it must follow when both run (their names): ``build_pipeline`` refuses
    an order that breaks it. Skipping an earlier pass is allowed; running it later is not."""
    def mark(fn):
        fn.after = tuple(after)
        return fn
    return mark


def check_order(passes) -> tuple:
    """``passes`` as a tuple, once every pass's ``after`` names are known passes listed before it (or absent)."""
    names = [p.__name__ for p in passes]
    problems = []
    for i, p in enumerate(passes):
        after = getattr(p, "after", None)  # set by @graph_pass
        if after is None:
            problems.append(f"{p.__name__} is not declared with @graph_pass(after=...)")
        for earlier in after or ():
            if earlier in names[i + 1:]:
                problems.append(f"{p.__name__} must run after {earlier}; move {earlier} before it")
    if len(set(names)) != len(names):
        problems.append(f"a pass is listed twice: {names}")
    if problems:
        raise PipelineOrderError("pipeline order refused: " + "; ".join(problems))
    return tuple(passes)


def val(node):
    """A node's example value (``meta["val"]``), or None (a constant, or no metadata)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def is_call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def drop_dead_code(graph: torch.fx.Graph, bypassed) -> None:
    """Dead code out, including the ``bypassed`` nodes that only export's dtype asserts still read
    (``_assert_tensor_metadata`` has no users but is not pure, so it keeps its input alive)."""
    graph.eliminate_dead_code()
    for node in bypassed:
        if not node._erased and node.users and all(user.target == ASSERT_METADATA for user in node.users):
            for user in list(node.users):
                graph.erase_node(user)
    graph.eliminate_dead_code()


def walk_back(node, targets, keep=lambda node: True):
    """Follow ``args[0]`` back from ``node`` while it is a call of one of ``targets`` that ``keep``
    accepts (views, casts: ops that do not change what a matcher looks for)."""
    while (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets
           and keep(node)):
        node = node.args[0]
    return node


@dataclass
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HiddenTaps:
    """Which residual-stream states the step returns besides logits.

    ``convention`` says what a layer id means, because engines disagree:
    ``"layer_input"`` = the hidden state entering decoder layer i (EAGLE-3's
    "capture before layer"; layer_input of 0 is the embedding output),
    ``"layer_output"`` = what decoder layer i returns (= layer_input of i+1).
    ``final`` adds the state after the final norm, the LM head's input
    (EAGLE-1, Medusa).
    """

    layer_ids: tuple[int, ...] = ()
    convention: str = "layer_output"
    final: bool = False

    def __post_init__(self):
        if self.convention not in ("layer_input", "layer_output"):
            raise ValueError(f"HiddenTaps.convention={self.convention!r}: 'layer_input' or 'layer_output'")


@dataclass(frozen=True)
class GraphContext:
    """The captured graph's placeholders by role, the target's facts, and what the step must return."""

    info: object  # capture.TargetInfo
    kv: str  # placeholder of the stacked cache buffer [2L, B, H_kv, S_max, D]
    cache_len: str
    tree_mask: str
    taps: HiddenTaps | None = None
    logits_rows: tuple[int, int] | None = None  # (start, stop) of node rows whose logits are computed
    params: dict | None = field(default=None, hash=False, compare=False)  # parameter placeholder -> its tensor
    tp: object = field(default=None, hash=False, compare=False)  # parallel.TensorParallel: the target is sharded

    def placeholder(self, gm: torch.fx.GraphModule, role: str) -> torch.fx.Node:
        name = getattr(self, role)
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.name == name:
                return node
        raise KeyError(f"graph has no placeholder {name!r} ({role})")


def lm_head_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``aten.linear`` nodes inside a module whose path ends in ``lm_head``."""
    return [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
            if any(path.endswith("lm_head") for path, _ in (n.meta.get("nn_module_stack") or {}).values())]
