"""The generate loop (greedy, host-driven for now).

Per row, the cache holds every committed token but the last, which is the
root of the next tree. One iteration: draft a chain from each row's
sequence -> one captured verify step over [root, drafts] -> greedy verify ->
compact the KV cache -> advance ``cache_len`` -> append the emitted tokens.
Prefill writes each prompt but its last token in chain chunks of the
prefill bucket (their logits are pruned away: the first verify step's root
row yields the first new token).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.verify import sampling_probs, verify_greedy, verify_sample
from ..passes import HiddenTaps
from ..trees import Tree

PREFILL_NODES = 32


@dataclass
class GenerateResult:
    sequences: list[list[int]]  # per row: the generated tokens (eos included, nothing after it)
    accept_lens: list[list[int]] = field(default_factory=list)  # per step, per row: tokens committed


def _chain_mask(n: int, device) -> torch.Tensor:
    return torch.tensor([(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(n)], device=device)


@torch.no_grad()
def prefill(capture, prompts: list[list[int]], device) -> torch.Tensor:
    """Write every prompt but its last token into the batch's cache. returns cache_len [B]."""
    b = len(prompts)
    # a chunk is a chain, so it must be shallower than the narrowest sliding window
    chunk = min([PREFILL_NODES] + [w for w in capture.info.layer_windows if w > 0])
    step = capture.step(b, chunk, logits_rows=(chunk - 1, chunk))
    chain = _chain_mask(chunk, device).expand(b, -1)
    lengths = [len(p) - 1 for p in prompts]
    for start in range(0, max(lengths), chunk):
        ids = torch.tensor([(p[:-1] + [0] * chunk)[start:start + chunk] for p in prompts], device=device)
        # rows whose prompt ended write padding past their length: those slots are overwritten before being read
        cache_len = torch.full((b,), start, device=device)
        step(ids, start + torch.arange(chunk, device=device).expand(b, -1), cache_len, chain)
    return torch.tensor(lengths, device=device)


@dataclass(frozen=True)
class Sampling:
    """Per-batch sampling parameters (transformers' warper semantics)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@torch.no_grad()
def speculative_generate(capture, draft, tree, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_ids: set[int], max_length: int, sampling: Sampling | None = None,
                    stopping_criteria=None, streamer=None) -> GenerateResult:
    """Speculative decoding of ``prompts`` over ``tree`` (a Chain or StaticTree):
    greedy (token-exact), or with ``sampling`` exact in distribution (the drafts
    are deterministic, so each node draws its own target sample and a draft is
    accepted iff it equals its parent's draw).

    ``stopping_criteria`` (transformers' StoppingCriteriaList) is asked after
    every accepted token, as plain decoding would (scores are not available:
    None is passed); ``streamer`` receives each row-0 token as it is accepted.
    """
    device = capture.kv_device
    b, n = len(prompts), tree.num_nodes
    cache_len = prefill(capture, prompts, device)
    topology = Tree.from_spec(tree, torch.zeros(b, n, dtype=torch.long, device=device))
    reads_hidden = getattr(draft, "reads_hidden", False)
    step = capture.step(b, n, taps=HiddenTaps(final=True) if reads_hidden else None)
    positions_in_tree = topology.depth
    sequences = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in range(b)]
    done = [max_new_tokens <= 0] * b
    result = GenerateResult(generated)
    hidden = None  # [B, H]: the target's final hidden state at each row's last accepted node
    rows = torch.arange(b, device=device)
    while not all(done):
        roots = torch.tensor([seq[-1] for seq in sequences], device=device).unsqueeze(1)
        if not reads_hidden:
            drafts = torch.tensor([draft.propose(seq, n - 1) for seq in sequences], device=device)
        elif hidden is None:  # nothing to read yet: the first step's drafts are placeholders
            drafts = roots.expand(b, n - 1)
        else:
            drafts = draft.propose_tree(hidden, tree)
        tokens = torch.cat([roots, drafts.to(torch.long)], 1)
        out = step(tokens, cache_len.unsqueeze(1) + positions_in_tree, cache_len, topology.mask)
        logits, taps = out if reads_hidden else (out, None)
        if sampling is None:
            acc = verify_greedy(tokens, topology.parents, topology.mask, logits.argmax(-1), tree.max_depth)
        else:
            probs = sampling_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            acc = verify_sample(tokens, topology.parents, topology.mask, probs, tree.max_depth)
        if reads_hidden:
            last = acc.path.gather(1, (acc.accept_len - 1).unsqueeze(1)).squeeze(1)
            hidden = taps[0][rows, last]
        active = torch.tensor([not d for d in done], device=device)
        accept_len = torch.where(active, acc.accept_len, 0)
        torch.ops.specgraph.compact_kv(capture.kv(b), cache_len, acc.path, accept_len)
        cache_len = cache_len + accept_len
        emitted, lens = acc.emitted.tolist(), accept_len.tolist()  # the one host read per step
        result.accept_lens.append(lens)
        for row in range(b):
            if done[row]:
                continue
            for token in emitted[row][: lens[row]]:
                generated[row].append(token)
                sequences[row].append(token)
                if streamer is not None:
                    streamer.put(torch.tensor([token]))
                stop = token in eos_token_ids or len(generated[row]) >= max_new_tokens
                if not stop and stopping_criteria is not None:
                    stop = bool(stopping_criteria(torch.tensor([sequences[row]]), None).any())
                if stop:
                    done[row] = True
                    break
        assert all(d or int(c) + n <= max_length for d, c in zip(done, cache_len.tolist())), "cache overflow"
    if streamer is not None:
        streamer.end()
    return result
