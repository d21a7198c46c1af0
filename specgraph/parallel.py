"""Tensor parallelism: the target sharded over the ranks of a torch.distributed process group.

``specgraph.compile(model, draft, tp=True)`` (or ``tp=<ProcessGroup>``) in every process of a
``torchrun --nproc-per-node N`` launch, each holding the same full model: ``shard_model`` keeps,
on rank r, the r-th slice of every decoder layer's column-parallel projections (q/k/v, gate/up:
rows, i.e. its heads, its KV heads and its share of the MLP) and row-parallel ones (o, down:
columns). Each rank's o/down product is then a partial sum; the ``all_reduce_partial_sums`` pass
(passes/tensor_parallel.py) adds ``_c10d_functional.all_reduce`` + ``wait_tensor`` after each, in
the captured graph (torch.distributed's own collectives: NCCL on GPUs, gloo on CPUs). Embedding,
norms, the LM head and the draft stay whole on every rank (replicated), so after each all-reduce
every rank holds the same residual stream, the same logits, and takes the same accept decision
with no further communication. Tree attention, verify and KV compaction run per rank on its own
heads: each rank's KV cache holds only its KV heads.

Why plain local shards rather than transformers' ``tp_plan="auto"`` as it is: that plan makes the
weights DTensors, and torch.export (torch 2.13) refuses them ("found non-fx-graphable type
DTensorSpec"). A model loaded with ``tp_plan="auto"`` is adopted (``adopt_hf_tp``): its shards are
the same slices, kept as plain tensors, and transformers' forward wrappers go.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")  # partial sums: an all-reduce after each
# model types whose attention and MLP were checked to compute per head / per column (views with -1 heads,
# per-head q/k norms only) and whose sharded generate is tested token-exact (tests/test_tensor_parallel.py)
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


@dataclass(frozen=True)
class TensorParallel:
    """The process group a target is sharded over, and this process's place in it."""

    group: object  # torch.distributed.ProcessGroup
    group_name: str  # what the functional collectives name it by
    rank: int
    world_size: int


def resolve(tp) -> tuple[TensorParallel | None, list[str]]:
    """compile's ``tp`` argument -> (TensorParallel or None, blockers)."""
    if tp is None or tp is False:
        return None, []
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, [f"tp={tp!r}: torch.distributed is not initialised; launch with `torchrun --nproc-per-node N "
                      f"script.py` and call torch.distributed.init_process_group() (NCCL on GPUs, gloo on CPUs) first"]
    if tp is True:
        group = dist.group.WORLD
    elif isinstance(tp, dist.ProcessGroup):
        group = tp
    else:
        return None, [f"tp={tp!r}: True (the default process group) or a torch.distributed.ProcessGroup"]
    return TensorParallel(group, group.group_name, dist.get_rank(group), dist.get_world_size(group)), []


def decoder_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every decoder layer, in order."""
    return sorted(((name, m) for name, m in model.named_modules() if LAYER.search(name)),
                  key=lambda item: int(LAYER.search(item[0]).group(1)))


def shard_problems(model, tp: TensorParallel, policy: str, draft=None) -> list[str]:
    """Everything that keeps ``model`` from being sharded over ``tp`` (empty: it can be)."""
    config = getattr(model.config, "text_config", None) or model.config
    world, problems = tp.world_size, []
    if policy != "fixed":
        problems.append(f"policy={policy!r} with tp: each rank would time and choose its own mode (and the ranks "
                        f"must run the same graphs); use policy='fixed'")
    done = model.__dict__.get("_specgraph_tp")
    if done is not None:  # compiled with tp before: already sharded (over this group, or refused)
        if done.world_size != world or done.group_name != tp.group_name:
            problems.append(f"the model was sharded over {done.world_size} ranks (group {done.group_name!r}) by an "
                            f"earlier specgraph.compile; load it again to shard it over {world}")
        return problems
    problems += hf_tp_problems(model, tp)
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        problems.append(f"model_type={model_type!r}: tensor parallelism is verified for "
                        f"{', '.join(VERIFIED_MODEL_TYPES)} only (their attention computes per head, their MLP per column)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", intermediate)):
        if not isinstance(value, int) or value % world:
            problems.append(f"config.{name}={value} is not divisible by the world size {world}: use a tensor-parallel "
                            f"size that divides it")
    if isinstance(draft, torch.nn.Module) and any(_is_dtensor(p) for p in draft.parameters()):
        problems.append("the draft's parameters are DTensors: the draft runs whole (replicated) on every rank")
    layers = decoder_layers(model)
    if not layers:
        problems.append("no decoder layers found (modules named '...layers.<i>')")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    where: dict[str, list[int]] = {}  # problem -> the layers that have it (one line per problem)
    for i, (_, layer) in enumerate(layers):
        for sub in COLUMN + ROW:
            if not isinstance(layer.get_submodule(sub) if _has(layer, sub) else None, torch.nn.Linear):
                where.setdefault(f"{sub}: not an nn.Linear (fused or renamed projections, MoE experts, Conv1D ... "
                                 f"are not sharded)", []).append(i)
        for name, p in layer.named_parameters():
            module = name.rsplit(".", 1)[0]
            if module in COLUMN + ROW:
                continue
            if module in ("self_attn.q_norm", "self_attn.k_norm") and p.shape == (head_dim,):
                continue  # per-head norms: replicated
            if module.count(".") == 0 and p.dim() == 1 and p.shape[0] == config.hidden_size:
                continue  # the layer's own norms over the hidden state: replicated
            where.setdefault(f"{name} {tuple(p.shape)}: a parameter whose sharding is unknown", []).append(i)
    problems += [f"decoder layers {_spans(ids)}: {what}" for what, ids in where.items()]
    return problems


def _spans(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else \
        ", ".join(map(str, ids))


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def check_replicated(modules, tp: TensorParallel, what: str) -> list[str]:
    """Blockers when the parameters of ``modules`` differ across ranks (a checksum per parameter,
    compared with two all-reduces): every rank must start from the same weights."""
    import torch.distributed as dist

    params = [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]
    if not params:
        return []
    with torch.no_grad():
        sums = torch.stack([p.detach().double().sum() + p.detach().double().abs().sum() * 1e-3 for p in params])
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, dist.ReduceOp.MAX, group=tp.group)
    dist.all_reduce(low, dist.ReduceOp.MIN, group=tp.group)
    if torch.equal(high, low):
        return []
    return [f"the {what}'s parameters differ across ranks: load the same checkpoint on every rank (random "
            f"weights: seed every rank alike) before specgraph.compile(..., tp=...)"]


def _is_dtensor(p) -> bool:
    return type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"


def _role(path: str) -> str | None:
    """"column" / "row" for a decoder layer's projection module path, else None."""
    if not LAYER.search(path.rsplit(".", 2)[0]):
        return None
    tail = ".".join(path.split(".")[-2:])
    return "column" if tail in COLUMN else "row" if tail in ROW else None


def hf_tp_problems(model, tp: TensorParallel) -> list[str]:
    """Blockers for adopting a model transformers sharded (``tp_plan="auto"``: DTensor weights)."""
    from torch.distributed import get_process_group_ranks
    from torch.distributed.tensor import Replicate, Shard

    problems = []
    for name, p in model.named_parameters():
        if not _is_dtensor(p):
            continue
        path, kind = name.rsplit(".", 1)
        mesh, placements = p.device_mesh, tuple(p.placements)
        if mesh.ndim != 1 or get_process_group_ranks(mesh.get_group()) != get_process_group_ranks(tp.group):
            problems.append(f"{name}: sharded over a device mesh {tuple(mesh.shape)} that is not the tp group's ranks "
                            f"{get_process_group_ranks(tp.group)}")
            continue
        role = _role(path)
        want = {("column", "weight"): Shard(0), ("column", "bias"): Shard(0), ("row", "weight"): Shard(1),
                ("row", "bias"): Replicate()}.get((role, kind))
        shard = placements[0]
        if want is not None and not (shard == want or (want == Shard(1) and shard == Shard(-1))):
            problems.append(f"{name}: placement {placements} from the tp_plan, where specgraph's layout has {want}")
    return problems


@torch.no_grad()
def adopt_hf_tp(model, tp: TensorParallel) -> None:
    """A model sharded by transformers (``tp_plan``): its projections' DTensor shards become plain
    local Parameters in specgraph's layout (the same slices), any other DTensor parameter whole
    (``full_tensor``, a collective), and transformers' forward wrappers go; the all-reduces are then
    the pass's."""
    new: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not _is_dtensor(p):
            continue
        path, kind = name.rsplit(".", 1)
        module = model.get_submodule(path)
        if id(p) not in new:
            role = _role(path)
            local = p.to_local() if role else p.full_tensor()
            if role == "row" and kind == "bias" and tp.rank != 0:
                local = torch.zeros_like(local)  # added once, by rank 0's partial sum
            new[id(p)] = torch.nn.Parameter(local.contiguous().clone(), requires_grad=False)
        module._parameters[kind] = new[id(p)]
    for _, module in model.named_modules():
        if "forward" in module.__dict__ and getattr(module, "_is_hooked", False):
            del module.__dict__["forward"]  # transformers' TP wrapper (install_forward)
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape


@torch.no_grad()
def shard_model(model, tp: TensorParallel) -> None:
    """Keep rank r's slice of every column- and row-parallel projection (in place, new Parameters);
    a row-parallel bias is kept on rank 0 only (the all-reduce adds it once). A model sharded by
    transformers' ``tp_plan`` is adopted instead (``adopt_hf_tp``). Idempotent."""
    if model.__dict__.get("_specgraph_tp") is not None:
        return
    if any(_is_dtensor(p) for p in model.parameters()):
        adopt_hf_tp(model, tp)
        model._specgraph_tp = tp
        return
    r, world = tp.rank, tp.world_size
    for _, layer in decoder_layers(model):
        for sub in COLUMN:
            linear = layer.get_submodule(sub)
            rows = linear.out_features // world
            linear.weight = torch.nn.Parameter(linear.weight[r * rows:(r + 1) * rows].clone(), requires_grad=False)
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(linear.bias[r * rows:(r + 1) * rows].clone(), requires_grad=False)
            linear.out_features = rows
        for sub in ROW:
            linear = layer.get_submodule(sub)
            cols = linear.in_features // world
            linear.weight = torch.nn.Parameter(linear.weight[:, r * cols:(r + 1) * cols].clone(), requires_grad=False)
            if linear.bias is not None and r != 0:
                linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
            linear.in_features = cols
    model._specgraph_tp = tp


def shard(model, tp=True, policy: str = "fixed", draft=None) -> TensorParallel | None:
    """Shard ``model`` over ``tp`` (True: the default group; a ProcessGroup; None: nothing) now, or
    raise CompileError with every blocker. A collective: every rank of the group calls it. Call it
    before moving a model too large for one device onto it (``shard(model); model.cuda()``):
    ``compile(model, ..., tp=...)`` then finds it sharded. Returns the TensorParallel."""
    from .errors import CompileError

    tp, problems = resolve(tp)
    if tp is None:
        if problems:
            raise CompileError(f"cannot shard {type(model).__name__}", problems)
        return None
    problems = shard_problems(model, tp, policy, draft)
    if problems:
        raise CompileError(f"cannot shard {type(model).__name__} over {tp.world_size} ranks", problems)
    if sharded(model) is None and not any(_is_dtensor(p) for p in model.parameters()):
        problems = check_replicated([model], tp, "target")  # (transformers' shards differ by design)
    problems += check_replicated([draft], tp, "draft")
    if problems:
        raise CompileError(f"cannot shard {type(model).__name__} over {tp.world_size} ranks", problems)
    shard_model(model, tp)
    return tp


def sharded(model) -> TensorParallel | None:
    """The TensorParallel ``model`` was sharded over by compile, or None."""
    return model.__dict__.get("_specgraph_tp")


def call_seed(tp: TensorParallel, seed: int | None) -> int:
    """The seed every rank samples one generate call with (seeded sampling, kernels/gumbel.py: the same
    logits and the same seed give the same draws on every rank, so the ranks accept alike with no
    collective per step). The caller's, when every rank passed the same one; without one, a seed drawn
    on the group's rank 0 from torch's global RNG and broadcast. A host collective once per call."""
    import torch.distributed as dist

    seeds = [None] * tp.world_size
    dist.all_gather_object(seeds, seed, group=tp.group)
    if len(set(seeds)) > 1:  # every rank sees the same list, so every rank refuses
        raise ValueError(f"seed: the ranks of a tensor-parallel target passed different seeds {seeds}; pass the same "
                         f"seed on every rank (or none: rank 0 draws one for all)")
    if seeds[0] is not None:
        return seeds[0]
    drawn = [int(torch.randint(0, 2**63 - 1, ()).item()) if tp.rank == 0 else None]
    dist.broadcast_object_list(drawn, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return drawn[0]
