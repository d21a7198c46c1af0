"""Autoregressive feature drafts (EAGLE-1/2, EAGLE-3): the shared drafting machinery.

The draft keeps its own KV cache in the target's layout. Slot p holds the
pair (target feature f_p, token x_{p+1}), so the draft's committed length
equals the target's ``cache_len`` and the draft's output at the last
committed slot predicts the children of the next tree's root.

One generate step of a session:
  propose  grow the tree from that output: a Chain / StaticTree level by
           level (the nodes of one depth are the rows of one call), or an
           EAGLE-2 DynamicTree as ``steps - 1`` calls of ``topk`` lanes and
           ``select_tree``. Node rows live in the draft cache's window.
  commit   after verify, run the accepted path as a chain of pairs
           (f[path[i]], emitted[i]) at the committed end: D+1 rows per row of
           the batch, the rows past accept_len write window garbage that is
           never read as committed. Nothing needs compaction.
Scores are log-probabilities of the draft's own vocabulary; tokens are
mapped to the target's with ``to_target``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.bitmask import MAX_NODES
from ..kernels.gumbel import coupled_scores
from ..selection import expand_frontier, seed_frontier, select_tree, top_k, top_log_probs
from ..trees import DynamicTree, StaticTree, Tree, chain_mask, spec_parents
from .base import Draft, DraftSession

CHAIN_CHUNK = 32  # rows per call when the draft reads a prompt
_LOW63 = (1 << 63) - 1


class AutoregressiveDraft(nn.Module, Draft):
    """Base of drafts that run a decoder layer autoregressively over their own cache.

    Subclasses provide ``forward(tokens, features, from_target, positions, kv,
    cache_len, slots, tree_mask) -> hidden [B, R, H]``, ``draft_logits(hidden)``,
    ``to_target(draft_ids)``, ``kv_shape`` and ``taps``. ``slots`` is a [B, R]
    tensor of window slots or an int ``f`` for slots ``f .. f + R - 1``
    (``layer.slot_tensor``): the sessions pass an int wherever the rows are consecutive.
    """

    reads_hidden = True

    def tree_problems(self, tree) -> list[str]:
        if isinstance(tree, DynamicTree) and (tree.steps - 1) * tree.topk > MAX_NODES:
            return [f"tree={tree}: (steps-1)*topk = {(tree.steps - 1) * tree.topk} draft lanes > the "
                    f"{MAX_NODES}-slot draft window; lower steps or topk"]
        return []

    def session(self, tree, batch: int, max_length: int, device) -> "ARSession":
        return ARSession(self, tree, batch, max_length, device)

    def new_cache(self, batch: int, slots: int, device):
        """The draft's KV cache, passed back to ``forward`` as ``kv``: by default one
        ``[2 * layers, B, H_kv, slots, D]`` tensor (K of layer l at 2l, V at 2l+1)."""
        layers, h_kv, d = self.kv_shape
        dtype = next(self.parameters()).dtype
        return torch.zeros(2 * layers, batch, h_kv, slots, d, dtype=dtype, device=device)


class ARSession(DraftSession):
    """One generate call's draft state: the draft cache, its length, the last output."""

    def __init__(self, draft: AutoregressiveDraft, tree, batch: int, max_length: int, device):
        self.draft, self.tree, self.batch = draft, tree, batch
        self.kv = draft.new_cache(batch, max_length + MAX_NODES, device)
        self.taps = draft.taps
        # prefill writes these two in place (a recorded first propose reads them at fixed addresses)
        self.length = torch.zeros(batch, dtype=torch.int64, device=device)
        self.last = torch.zeros(batch, draft.config.hidden_size, dtype=next(draft.parameters()).dtype,
                                device=device)  # [B, H] draft output at the last committed pair
        self.device = device
        self.coupling = None  # sampled calls: (keys [B, 2], temperature) of the target's seeded draws (couple)
        if not isinstance(tree, DynamicTree):
            parents = tree.parents()
            self.parents = parents
            self.depth = [0] * len(parents)
            for i in range(1, len(parents)):
                self.depth[i] = self.depth[parents[i]] + 1
            ranks = tree.ranks() if isinstance(tree, StaticTree) else [-1] + [0] * (len(parents) - 1)
            self.topk = max(ranks[1:], default=0) + 1
            self.parent_index = spec_parents(tree, device)  # [N]; built here, read by the compiled propose
            topology = Tree.from_spec(tree, torch.zeros(batch, len(parents), dtype=torch.int64, device=device),
                                      self.parent_index)
            self.window_mask = (topology.mask >> 1) & _LOW63  # node i >= 1 sits at window slot i - 1
            self.levels = []  # per depth d: (expanding nodes, their parents, children, child's parent slot, rank)
            self.level_slots = []  # per depth d: the expanding nodes' window slots, an int where consecutive
            t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
            for d in range(max(self.depth)):
                expanding = sorted({parents[i] for i in range(1, len(parents)) if self.depth[i] == d + 1})
                children = [i for i in range(1, len(parents)) if self.depth[i] == d + 1]
                self.levels.append((t(expanding), t([parents[i] for i in expanding]), t(children),
                                    t([expanding.index(parents[i]) for i in children]), t([ranks[i] for i in children])))
                consecutive = expanding == list(range(expanding[0], expanding[0] + len(expanding)))
                self.level_slots.append(expanding[0] - 1 if consecutive else t(expanding) - 1)

    def _run(self, tokens, features, from_target, cache_len, slots, mask, depth):
        """One call; positions follow depth in the window: cache_len + depth."""
        positions = cache_len.view(-1, 1) + depth
        return self.draft(tokens, features, from_target, positions, self.kv, cache_len, slots, mask)

    def _chain(self, tokens, features, start):
        """Pairs as a chain at the committed end ``start [B]``: tokens [B, R], features [B, R, F]."""
        r = tokens.shape[1]
        idx = torch.arange(r, device=self.device).expand(self.batch, r)
        mask = chain_mask(r, self.device).expand(self.batch, r)
        return self._run(tokens, features, True, start, 0, mask, idx)  # window slots 0 .. r-1

    def compile_host_work(self, compile_fn) -> None:
        """Compile the draft passes prefill runs (``compile_fn(method) -> callable``): every prompt
        chunk is then CHAIN_CHUNK rows wide, one compiled shape (the padding past the prompt writes
        slots of the cache's spare 64 that later commits overwrite before they are read). The
        callable may be a recorded CUDA graph (``runtime.graphed.GraphedCall``): its output is read
        (copied into ``last``) before the next chunk runs, and it mutates only ``kv``, in place."""
        self._prefill_chain = compile_fn(self._chain)

    def couple(self, keys: torch.Tensor, temperature: torch.Tensor) -> bool:
        self.coupling = (keys, temperature)
        return True

    # ------------------------------------------------------------------ generate protocol
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], features: torch.Tensor) -> None:
        """features [B, T-1, F]: the target's features of every prefilled token."""
        lengths = [len(p) - 1 for p in prompts]
        self.last.zero_()
        chain = getattr(self, "_prefill_chain", None)
        for start in range(0, max(lengths), CHAIN_CHUNK):
            stop = min(start + CHAIN_CHUNK, max(lengths))
            width = CHAIN_CHUNK if chain is not None else stop - start
            tokens = torch.tensor([(p[1:] + [0] * (start + width))[start:start + width] for p in prompts],
                                  device=self.device)
            # a fresh [B, width, F] buffer, zero past the longest prompt: a slice of ``features`` would
            # carry the prompt's length in its strides, and the compiled pass would recompile per length
            feats = features.new_zeros(features.shape[0], width, features.shape[2])
            feats[:, :stop - start] = features[:, start:stop]
            begin = torch.full((self.batch,), start, device=self.device)
            out = (chain or self._chain)(tokens, feats, begin)  # [B, R, H]
            for row, n in enumerate(lengths):
                if start < n <= stop:
                    self.last[row] = out[row, n - 1 - start]
        self.length.copy_(torch.tensor(lengths, device=self.device))

    @torch.no_grad()
    def propose(self, roots: torch.Tensor) -> Tree:
        """roots [B] -> the next tree (tokens in the target's vocabulary)."""
        if isinstance(self.tree, DynamicTree):
            return self._propose_dynamic(roots)
        return self._propose_static(roots)

    @torch.no_grad()
    def commit(self, tree: Tree, acc, features: torch.Tensor, accept_len: torch.Tensor) -> None:
        """Extend the draft context by each row's accepted pairs (accept_len 0: row finished)."""
        path = acc.path.clamp(min=0)  # [B, D+1]; entries past accept_len (-1) become garbage rows
        feats = features.gather(1, path.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        out = self._chain(acc.emitted.to(torch.int64).clamp(min=0), feats, self.length)  # [B, D+1, H]
        last = out.gather(1, (accept_len - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)
        self.last = torch.where((accept_len > 0).view(-1, 1), last, self.last)
        self.length = self.length + accept_len

    # ------------------------------------------------------------------ tree growth
    def _scores(self, logits: torch.Tensor, depth: int) -> torch.Tensor:
        """logits [B, ..., V'] of candidates at ``depth`` -> their log-probabilities, or with a coupling the
        scores coupled with the target's draw at that depth's position (``coupled_scores``)."""
        if self.coupling is None:
            return torch.log_softmax(logits.float(), -1)
        keys, temperature = self.coupling
        ids = self.draft.to_target(torch.arange(logits.shape[-1], device=logits.device))
        return coupled_scores(logits, keys, self.length + depth, temperature, ids)

    def _top(self, hidden: torch.Tensor, k: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, ..., H] at ``depth`` - 1 -> (scores, target tokens) of the k best children, [B, ..., k]."""
        logits = self.draft.draft_logits(hidden)
        if self.coupling is None:  # the log-softmax with the top-k, in one launch on CUDA
            values, indices = top_log_probs(logits, k)
        else:
            values, indices = top_k(self._scores(logits, depth), k)
        return values, self.draft.to_target(indices)

    def _propose_static(self, roots: torch.Tensor) -> Tree:
        b, n = self.batch, len(self.parents)
        tokens = torch.zeros(b, n, dtype=torch.int64, device=self.device)
        tokens[:, 0] = roots
        hidden = self.last.new_zeros(b, n, self.last.shape[-1])
        hidden[:, 0] = self.last
        for d, (rows, parent_rows, children, slot, rank) in enumerate(self.levels):
            if d > 0:  # run this level's nodes (their tokens are known now) to get their outputs
                slots = self.level_slots[d]
                hidden[:, rows] = self._run(tokens[:, rows], hidden[:, parent_rows], False, self.length,
                                            slots if isinstance(slots, int) else slots.expand(b, -1),
                                            self.window_mask[:, rows],
                                            torch.full_like(rows, d - 1).expand(b, -1))
            # a fixed tree needs only the ranking: top k of the logits, no log-softmax over the vocabulary
            logits = self.draft.draft_logits(hidden[:, rows]).float()
            if self.coupling is not None:
                logits = self._scores(logits, d + 1)
            top = self.draft.to_target(top_k(logits, self.topk)[1])  # [B, P, k]
            tokens[:, children] = top[:, slot, rank]
        return Tree.from_spec(self.tree, tokens, self.parent_index)

    def _propose_dynamic(self, roots: torch.Tensor) -> Tree:
        return select_tree(*self.candidates(), roots, self.tree)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A DynamicTree's candidates before EAGLE-2's selection: (scores, tokens, parents), each [B, E]
        (``select_tree``'s inputs; a shared lookup branch adds its own before selecting)."""
        spec, b = self.tree, self.batch
        k = spec.topk
        logprobs, top = self._top(self.last, k, 1)  # [B, K]
        frontier = seed_frontier(logprobs, top)
        scores, tokens, parents = [frontier.scores], [frontier.tokens], [frontier.parents]
        lane_hidden = self.last.unsqueeze(1).expand(b, k, -1)  # the lanes' parents' outputs
        lane_mask = torch.zeros(b, k, dtype=torch.int64, device=self.device)
        lanes = torch.arange(k, device=self.device)
        for step in range(1, spec.steps):
            own = torch.ones_like(lanes) << ((step - 1) * k + lanes)  # window slot of lane j
            if step > 1:
                parent_lane = frontier.lane_rows // k  # [B, K]: which previous lane each lane came from
                lane_hidden = out.gather(1, parent_lane.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
                lane_mask = lane_mask.gather(1, parent_lane)
            lane_mask = lane_mask | own
            lane_tokens = frontier.tokens.gather(1, frontier.lane_rows)
            out = self._run(lane_tokens, lane_hidden, False, self.length, (step - 1) * k,  # lanes' window slots
                            lane_mask, torch.full((b, k), step - 1, device=self.device))
            logprobs, top = self._top(out, k, step + 1)  # [B, K, K]
            frontier = expand_frontier(frontier, logprobs, top, step)
            scores.append(frontier.scores)
            tokens.append(frontier.tokens)
            parents.append(frontier.parents)
        return torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
