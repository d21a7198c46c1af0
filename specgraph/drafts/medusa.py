"""Medusa heads: K parallel heads on the target's final hidden state; head k
predicts the token k+1 places after the next one. They fill a fixed tree:
node at depth d with sibling rank r takes head d-1's r-th best token.

Public layouts ``from_pretrained`` reads (head count and depth come from the
keys, never from the config: FasterDecoding's uploaded configs are wrong):
  FasterDecoding  medusa_lm_head.{safetensors,pt}: {h}.{l}.linear.{weight,bias}, {h}.{L}.weight
  Medusa-2 full   model*.safetensors / pytorch_model*.bin: medusa_head.{h}.…  (same sub-layout)
  ModelOpt        medusa_heads.{h}.{l}.linear.*, medusa_heads.{h}.{L}.weight
  vLLM            blocks.{h}.layers.{l}.{weight,bias?}, lm_heads.{h}.weight
  legacy          {h}.{l}.linear.* without {h}.{L}.weight: the target's LM head is shared
  (vLLM's ``original_lm_head``: one lm_heads.0.weight shared by every head)
``save_pretrained(layout=...)`` writes them as the engines read them: "fasterdecoding"
(medusa_lm_head.safetensors, as FasterDecoding's trainer writes it), "fasterdecoding_pt"
(medusa_lm_head.pt, the file FasterDecoding's ``MedusaModel.from_pretrained`` loads), both with
config.json medusa_num_heads / medusa_num_layers / base_model_name_or_path; "vllm"
(model.safetensors, vLLM's ``Medusa`` names, config model_type "medusa", num_heads,
num_hidden_layers, truncated_vocab_size, medusa_fc_bias, original_lm_head).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..kernels.gumbel import coupled_scores
from ..passes import HiddenTaps
from .checkpoint import check_fields, read_checkpoint, write_checkpoint
from .base import Draft, DraftSession
from .eagle import _Borrowed
from ..selection import top_k
from ..trees import Chain, StaticTree, Tree, spec_parents

log = logging.getLogger(__name__)
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
LAYOUTS = ("fasterdecoding", "fasterdecoding_pt", "vllm")


class ResBlock(nn.Module):
    def __init__(self, hidden: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class Medusa(nn.Module, Draft):
    """Medusa-1 heads: K heads of ResBlocks, each with its own LM head (or the target's shared one),
    reading the target's final hidden state; head k proposes the token k+1 ahead, all at once
    (a StaticTree such as ``MEDUSA_MC_SIM_7B_63`` or a Chain). ``Medusa.from_pretrained(dir)`` reads
    FasterDecoding, Medusa-2, ModelOpt and vLLM layouts; ``save_pretrained`` writes FasterDecoding's."""

    kind = "medusa"
    reads_hidden = True  # the target's final (post-norm) hidden state of the last accepted node
    taps = HiddenTaps(final=True)

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 own_lm_head: bool = True, bias: bool = True):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads, self.num_layers = hidden_size, vocab_size, num_heads, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden_size, bias) for _ in range(num_layers)))
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)) \
            if own_lm_head else None
        self._shared_head = _Borrowed()  # the target's LM head when this checkpoint has none (legacy layout)

    def bind(self, model) -> list[str]:
        """Check against the target; share its LM head when this checkpoint has none. returns blockers."""
        config = model.config.get_text_config()
        problems = []
        if config.hidden_size != self.hidden_size:
            problems.append(f"Medusa hidden size {self.hidden_size} != target hidden size {config.hidden_size}")
        if config.vocab_size != self.vocab_size:
            problems.append(f"Medusa vocabulary {self.vocab_size} != target vocabulary {config.vocab_size}")
        if not problems:
            self._shared_head.module = model.get_output_embeddings()
            self.to(dtype=next(model.parameters()).dtype, device=next(model.parameters()).device)
        return problems

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> logits [B, K, V]."""
        out = []
        for k, block in enumerate(self.blocks):
            h = block(hidden)
            out.append(self.lm_heads[k](h) if self.lm_heads is not None else self._shared_head.module(h))
        return torch.stack(out, 1)

    def tree_problems(self, tree) -> list[str]:
        if not isinstance(tree, (Chain, StaticTree)):
            return [f"tree={tree}: Medusa heads fill a fixed tree; use Chain(k) or StaticTree(choices)"]
        if tree.max_depth > self.num_heads:
            return [f"tree depth {tree.max_depth} > {self.num_heads} Medusa heads"]
        return []

    @torch.no_grad()
    def propose_tree(self, hidden: torch.Tensor, tree, index: tuple[torch.Tensor, torch.Tensor] | None = None,
                     coupling: tuple | None = None) -> torch.Tensor:
        """hidden [B, H] -> draft tokens [B, N-1] for the tree's nodes 1..N-1; ``index``: ``tree_index(tree)``
        built once (a session's: a list made a tensor in a compiled frame would be baked in as a constant);
        ``coupling``: (keys, temperature, root positions [B]) of the target's seeded draws: head k's candidates
        (depth k + 1) ranked with the noise at root + k + 1 (``kernels.gumbel.coupled_scores``)."""
        head, rank = index if index is not None else tree_index(tree, hidden.device)
        topk = max(p[-1] for p in _paths(tree)) + 1
        logits = self(hidden)  # [B, K, V]
        if coupling is not None:
            keys, temperature, roots = coupling
            logits = torch.stack([coupled_scores(logits[:, k], keys, roots + k + 1, temperature)
                                  for k in range(logits.shape[1])], 1)
        top = top_k(logits, topk)[1]  # [B, K, topk]
        return top[:, head, rank]

    def session(self, tree, batch: int, max_length: int, device) -> "MedusaSession":
        return MedusaSession(self, tree, batch, device)

    # ------------------------------------------------------------------ formats
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Medusa":
        """Any layout of the module docstring; head count and depth from the keys (a config.json that claims more
        heads than the weights hold is logged and the weights decide). A bad key or shape is named."""
        state, config = read_checkpoint(path, WEIGHT_FILES, "Medusa")
        check_fields(config, path, required=())
        truncated = config.get("truncated_vocab_size")
        if "token_map" in state or (truncated and truncated != config.get("vocab_size", truncated)):
            raise CheckpointError(f"{path}: a vLLM Medusa with a truncated vocabulary (token_map, "
                                  f"truncated_vocab_size={truncated}) is not supported yet: drafts cover the target's "
                                  f"whole vocabulary")
        layout = _normalise(state)
        if config.get("original_lm_head") and 0 in layout:  # vLLM: lm_heads.0 is every head's LM head
            for entry in layout.values():
                entry["lm_head"] = layout[0]["lm_head"]
        heads = sorted(layout)
        if not heads:
            raise CheckpointError(f"{path}: no Medusa heads found (looked for FasterDecoding, Medusa-2, ModelOpt and "
                                  f"vLLM key layouts)")
        if heads != list(range(len(heads))):
            missing = sorted(set(range(max(heads) + 1)) - set(heads))
            raise CheckpointError(f"{path}: Medusa heads {missing} are missing (found heads {heads}); heads are "
                                  f"numbered from 0 without gaps: the file is incomplete")
        _check_alike(layout, path)
        first = layout[0]
        hidden = (first["blocks"][0][0] if first["blocks"] else first["lm_head"])[1].shape[-1]
        own = first["lm_head"] is not None
        vocab = first["lm_head"][1].shape[0] if own else config.get("vocab_size") or 0
        if vocab == 0:
            raise CheckpointError(f"{path}: heads share the target's LM head (legacy layout) and config.json has no "
                                  f"vocab_size")
        layers = len(first["blocks"])
        vllm = config.get("model_type") == "medusa"  # its num_* fields are the heads'; elsewhere, the base model's
        declared_heads = config.get("medusa_num_heads", config.get("num_heads") if vllm else None)
        declared_layers = config.get("medusa_num_layers", config.get("num_hidden_layers") if vllm else None)
        for what, found, declared in (("heads", len(heads), declared_heads),
                                      ("layers a head", layers, declared_layers)):
            if declared is not None and declared != found:  # FasterDecoding's uploaded configs claim 5 heads
                log.warning("%s: config.json says %s %s, the weights hold %s: the weights decide", path, declared,
                            what, found)
        wrong = [f"{key}: checkpoint {tuple(w.shape)} != expected {shape}" for h in heads
                 for (key, w), shape in _with_shapes(layout[h], hidden, vocab) if tuple(w.shape) != shape]
        if wrong:
            raise CheckpointError(f"{path}: not a loadable Medusa checkpoint: {'; '.join(wrong)}")
        bias = first["blocks"][0][1] is not None if first["blocks"] else True
        module = cls(hidden, vocab, len(heads), layers, own_lm_head=own, bias=bias)
        with torch.no_grad():
            for h in heads:
                for block, (w, b) in zip(module.blocks[h], layout[h]["blocks"]):
                    block.linear.weight.copy_(w[1])
                    if b is not None:
                        block.linear.bias.copy_(b[1])
                if module.lm_heads is not None:
                    module.lm_heads[h].weight.copy_(layout[h]["lm_head"][1])
        return module.eval()

    def save_pretrained(self, path: str | Path, base_model_name_or_path: str = "", dtype: torch.dtype | None = None,
                        max_shard_bytes: int | None = None, layout: str = "fasterdecoding") -> None:
        """Write the heads in ``layout`` (one of LAYOUTS, see the module docstring)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: one of {', '.join(map(repr, LAYOUTS))}")
        if layout == "vllm":
            return self._save_vllm(path, dtype, max_shard_bytes)
        state = self._block_state("{h}.{l}.linear")
        for h in range(self.num_heads):
            if self.lm_heads is not None:
                state[f"{h}.{self.num_layers}.weight"] = self.lm_heads[h].weight
        config = dict(medusa_num_heads=self.num_heads, medusa_num_layers=self.num_layers, hidden_size=self.hidden_size,
                      vocab_size=self.vocab_size, base_model_name_or_path=base_model_name_or_path, version="2")
        weights = "medusa_lm_head.pt" if layout == "fasterdecoding_pt" else "medusa_lm_head.safetensors"
        write_checkpoint(path, state, config, weights=weights, dtype=dtype, max_shard_bytes=max_shard_bytes)

    def _block_state(self, prefix: str) -> dict:
        """The residual blocks' weights (and biases) under ``prefix`` (``{h}``: head, ``{l}``: layer)."""
        state = {}
        for h, blocks in enumerate(self.blocks):
            for l, block in enumerate(blocks):
                name = prefix.format(h=h, l=l)
                state[f"{name}.weight"] = block.linear.weight
                if block.linear.bias is not None:
                    state[f"{name}.bias"] = block.linear.bias
        return state

    def _save_vllm(self, path, dtype, max_shard_bytes) -> None:
        """vLLM's ``Medusa``: blocks.{h}.layers.{l}.{weight,bias}, lm_heads.{h}.weight (one, with
        original_lm_head, when the heads share the target's)."""
        state = self._block_state("blocks.{h}.layers.{l}")
        shared = self.lm_heads is None
        if shared:
            if self._shared_head.module is None:
                raise ValueError("layout='vllm' stores the LM head the heads share (the target's): bind the heads "
                                 "first (specgraph.compile(model, draft) or draft.bind(model))")
            state["lm_heads.0.weight"] = self._shared_head.module.weight
        else:
            state.update({f"lm_heads.{h}.weight": head.weight for h, head in enumerate(self.lm_heads)})
        config = dict(architectures=["MedusaModel"], model_type="medusa", hidden_size=self.hidden_size,
                      vocab_size=self.vocab_size, num_heads=self.num_heads, num_hidden_layers=self.num_layers,
                      truncated_vocab_size=self.vocab_size, original_lm_head=shared,
                      medusa_fc_bias=self.blocks[0][0].linear.bias is not None)
        write_checkpoint(path, state, config, dtype=dtype, max_shard_bytes=max_shard_bytes)


_FASTER = re.compile(r"^(?:medusa_head\.|medusa_heads\.)?(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")
_VLLM_BLOCK = re.compile(r"^(?:medusa_heads\.)?blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^(?:medusa_heads\.)?lm_heads\.(\d+)\.weight$")


def _normalise(state: dict) -> dict[int, dict]:
    """Any supported layout -> {head: {"blocks": [((key, W), (key, b) | None), ...], "lm_head": (key, W) | None}}
    (each tensor with its checkpoint key, for messages)."""
    raw: dict[int, dict] = {}
    for key, value in state.items():
        if m := _FASTER.match(key):
            h, l, is_block, kind = int(m[1]), int(m[2]), bool(m[3]), m[4]
            entry = raw.setdefault(h, {"blocks": {}, "lm": {}})
            (entry["blocks"] if is_block else entry["lm"]).setdefault(l, {})[kind] = (key, value)
        elif m := _VLLM_BLOCK.match(key):
            raw.setdefault(int(m[1]), {"blocks": {}, "lm": {}})["blocks"].setdefault(int(m[2]), {})[m[3]] = (key, value)
        elif m := _VLLM_HEAD.match(key):
            raw.setdefault(int(m[1]), {"blocks": {}, "lm": {}})["lm"][-1] = {"weight": (key, value)}
    out = {}
    for h, entry in raw.items():
        blocks = [(entry["blocks"][l].get("weight"), entry["blocks"][l].get("bias")) for l in sorted(entry["blocks"])]
        heads = [x["weight"] for x in entry["lm"].values() if "weight" in x]
        out[h] = {"blocks": blocks, "lm_head": heads[0] if heads else None}
    return out


def _as_head(key: str, head: int) -> str:
    """Head 0's checkpoint key as head ``head`` would spell it (the first number in a key is its head)."""
    parts = key.split(".")
    first = next(i for i, part in enumerate(parts) if part.isdigit())
    return ".".join(parts[:first] + [str(head)] + parts[first + 1:])


def _check_alike(layout: dict[int, dict], path) -> None:
    """Every head built like head 0 (its depth, LM head, biases): what differs is named by head and key."""
    first, problems = layout[0], []
    for h in sorted(layout)[1:]:
        entry = layout[h]
        if len(entry["blocks"]) != len(first["blocks"]):
            problems.append(f"head {h} has {len(entry['blocks'])} residual blocks, head 0 {len(first['blocks'])}")
        if entry["lm_head"] is None and first["lm_head"] is not None:
            problems.append(f"head {h} has no LM head weight {_as_head(first['lm_head'][0], h)}")
        elif entry["lm_head"] is not None and first["lm_head"] is None:
            problems.append(f"head {h} has an LM head weight {entry['lm_head'][0]}, head 0 none")
    for h in sorted(layout):
        for l, (w, b) in enumerate(layout[h]["blocks"]):
            like = first["blocks"][0] if first["blocks"] else (w, b)
            if w is None:
                problems.append(f"head {h} block {l} has a bias {b[0]} but no weight")
            elif b is None and like[1] is not None:
                problems.append(f"head {h} block {l} has no bias {w[0].rsplit('.', 1)[0]}.bias (head 0 has)")
            elif b is not None and like[1] is None:
                problems.append(f"head {h} block {l} has a bias {b[0]}, head 0 block 0 none")
    if problems:
        raise CheckpointError(f"{path}: Medusa heads differ: {'; '.join(problems)}; every head has the same blocks, "
                              f"LM head and biases: the file is incomplete or of another layout")


def _with_shapes(entry: dict, hidden: int, vocab: int):
    """((key, tensor), expected shape) of one head's tensors."""
    for w, b in entry["blocks"]:
        yield w, (hidden, hidden)
        if b is not None:
            yield b, (hidden,)
    if entry["lm_head"] is not None:
        yield entry["lm_head"], (vocab, hidden)


def _paths(tree) -> tuple[tuple[int, ...], ...]:
    return tree.choices if isinstance(tree, StaticTree) else tuple((0,) * d for d in range(1, tree.depth + 1))


def tree_index(tree, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N-1] each node's head (its depth - 1) and [N-1] its rank among that head's top-k."""
    paths = _paths(tree)
    return (torch.tensor([len(p) - 1 for p in paths], device=device),
            torch.tensor([p[-1] for p in paths], device=device))


class MedusaSession(DraftSession):
    """Per generate call: the target's final hidden state at each row's last committed token."""

    taps = Medusa.taps

    def __init__(self, draft: Medusa, tree, batch: int, device):
        self.draft, self.tree = draft, tree
        self.hidden = torch.zeros(batch, draft.hidden_size, dtype=next(draft.parameters()).dtype, device=device)
        # built once here, read by the compiled propose (made inside it, they would be graph constants)
        self.index, self.parent_index = tree_index(tree, device), spec_parents(tree, device)
        # the target's cache_len: the position of each row's root
        self.length = torch.zeros(batch, dtype=torch.int64, device=device)
        self.coupling = None  # sampled calls: (keys, temperature) of the target's seeded draws (couple)

    def couple(self, keys: torch.Tensor, temperature: torch.Tensor) -> bool:
        self.coupling = (keys, temperature)
        return True

    def prefill(self, prompts, features) -> None:
        for row, prompt in enumerate(prompts):
            if len(prompt) > 1:  # a 1-token prompt has nothing prefilled: its first tree is a guess
                self.hidden[row] = features[row, len(prompt) - 2]
        self.length.copy_(torch.tensor([len(p) - 1 for p in prompts], device=self.length.device))

    def propose(self, roots: torch.Tensor) -> Tree:
        coupling = None if self.coupling is None else (*self.coupling, self.length)
        drafts = self.draft.propose_tree(self.hidden, self.tree, self.index, coupling)
        return Tree.from_spec(self.tree, torch.cat([roots.view(-1, 1), drafts.to(torch.int64)], 1), self.parent_index)

    def commit(self, tree, acc, features, accept_len) -> None:
        last = acc.path.gather(1, (accept_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        rows = torch.arange(len(last), device=last.device)
        self.hidden = torch.where((accept_len > 0).unsqueeze(1), features[rows, last], self.hidden)
        self.length = self.length + accept_len
