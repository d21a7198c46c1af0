"""compile(verify="typical"): Medusa's lossy typical acceptance, opt-in, against an oracle written
from FasterDecoding/Medusa's ``evaluate_posterior`` (medusa/model/utils.py, commit e2a5d20c04,
``sampling='typical'``: candidate probability > min(posterior_threshold, posterior_alpha *
exp(-entropy)), entropy = -sum p log(p + 1e-5), p = softmax(logits / T); accept length = cumprod)."""
from __future__ import annotations

import math

import pytest
import torch

import specgraph
from specgraph import Chain, CompileError, StaticTree
from specgraph.drafts import NGram
from specgraph.kernels.verify import verify_typical
from specgraph.trees import Tree
from test_capture import tiny_model
from test_generate import _small_vocab_model, hf_greedy

TEMPERATURE, THRESHOLD, ALPHA = 0.8, 0.09, 0.3


def medusa_accepts(logits_rows: list[torch.Tensor], drafted: list[int], temperature: float,
                   threshold: float, alpha: float) -> tuple[int, float]:
    """Medusa's rule on one candidate path: logits_rows[i] is the target at the context before
    drafted[i]. Returns (accepted drafts, the smallest |p - threshold| of the deciding tests)."""
    accepted, margin = 0, math.inf
    for logits, token in zip(logits_rows, drafted):
        p = torch.softmax(logits.double() / temperature, -1)
        entropy = -(p * torch.log(p + 1e-5)).sum()
        bar = min(threshold, math.exp(-entropy.item()) * alpha)
        margin = min(margin, abs(p[token].item() - bar))
        if not p[token].item() > bar:
            break
        accepted += 1
    return accepted, margin


def test_typical_is_refused_unless_asked_for():
    model = tiny_model("llama")
    with pytest.raises(CompileError, match=r"verify='lossy': 'exact' .* or 'typical'"):
        specgraph.compile(model, NGram(), tree=Chain(2), verify="lossy")
    with pytest.raises(CompileError, match=r"typical=\(0.1, 0.3\) has no effect with verify='exact': pass verify='typical'"):
        specgraph.compile(model, NGram(), tree=Chain(2), typical=(0.1, 0.3))
    with pytest.raises(CompileError, match=r"typical=\(2, 0.3\): \(posterior_threshold in \[0, 1\]"):
        specgraph.compile(model, NGram(), tree=Chain(2), verify="typical", typical=(2, 0.3))
    with pytest.raises(CompileError, match="verify='typical' with synthetic_accept"):
        specgraph.compile(model, NGram(), tree=Chain(2), verify="typical", synthetic_accept=2)
    spec = specgraph.compile(model, NGram(), tree=Chain(2))  # the default is exact, silently
    assert spec.config.verify == "exact" and spec.config.typical is None


@pytest.mark.parametrize("seed", range(4))
def test_tree_verdict_is_medusas_over_every_candidate_path(seed):
    """Every root-to-leaf path of a static tree is one Medusa candidate; the accepted depth is the
    best candidate's accept length and the accepted path's tokens pass the rule."""
    g = torch.Generator().manual_seed(seed)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]
    spec = StaticTree(choices)
    rows, vocab = 64, 6
    tokens = torch.randint(0, vocab, (rows, spec.num_nodes), generator=g)
    tree = Tree.from_spec(spec, tokens)
    logits = torch.randn(rows, spec.num_nodes, vocab, generator=g) * 2.0
    probs = torch.softmax(logits / TEMPERATURE, -1)
    acc = verify_typical(tree.tokens, tree.parents, tree.mask, probs, tree.max_depth, THRESHOLD, ALPHA, generator=g)
    node_of = {(): 0, **{tuple(c): i + 1 for i, c in enumerate(sorted(map(tuple, choices)))}}
    leaves = [p for p in node_of if p and not any(q[:len(p)] == p and len(q) > len(p) for q in node_of)]
    for b in range(rows):
        best = 0
        for leaf in leaves:
            nodes = [node_of[leaf[:i]] for i in range(len(leaf) + 1)]  # root first
            n, _ = medusa_accepts([logits[b, j] for j in nodes[:-1]], [int(tokens[b, j]) for j in nodes[1:]],
                                  TEMPERATURE, THRESHOLD, ALPHA)
            best = max(best, n)
        assert acc.accept_len[b].item() == best + 1, b
        path = acc.path[b, : best + 1].tolist()
        n, _ = medusa_accepts([logits[b, j] for j in path[:-1]], [int(tokens[b, j]) for j in path[1:]],
                              TEMPERATURE, THRESHOLD, ALPHA)
        assert n == best and acc.emitted[b, :best].tolist() == [int(tokens[b, j]) for j in path[1:]]
        assert probs[b, path[-1], acc.bonus[b]] > 0  # the bonus is the target's sample at the accepted node


def test_typical_generate_follows_medusas_rule_and_accepts_more_than_exact():
    """End to end (Chain(3), n-gram drafts, whose proposals the host reference replays): each step's
    accepted count is Medusa's on the target's own logits; greedy stays token-exact; sampling accepts
    more than exact rejection sampling on the same prompts."""
    model = _small_vocab_model()
    rows, new, k = 48, 24, 3
    g = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(3, 12, (4,), generator=g).tolist() * 3)[:10] for _ in range(rows)]
    ids = torch.tensor(prompts)
    with pytest.warns(UserWarning, match="LOSSY"):
        typical = specgraph.compile(model, NGram(), tree=Chain(k), max_batch=rows, max_cache_len=64, verify="typical",
                                    typical=(THRESHOLD, ALPHA))
    exact = specgraph.compile(model, NGram(), tree=Chain(k), max_batch=rows, max_cache_len=64)
    greedy = typical.generate(ids[:2], max_new_tokens=new, eos_token_id=None)
    for row in range(2):
        assert greedy[row, 10:].tolist() == hf_greedy(model, prompts[row], max_new_tokens=new, eos_token_id=None)

    sample = dict(do_sample=True, temperature=TEMPERATURE, top_k=0, max_new_tokens=new, eos_token_id=None,
                  return_dict_in_generate=True)
    torch.manual_seed(0)
    out = typical.generate(ids, **sample)
    checked = 0
    for b in range(rows):
        produced = out.sequences[b, 10:].tolist()
        seq = list(prompts[b]) + produced[:1]  # the first token is the prefill's; steps start after it
        for step in out.accept_lens:
            if len(seq) - 10 >= new:
                break
            drafts = NGram().propose(seq, k)
            with torch.no_grad():
                logits = model(torch.tensor([seq + drafts])).logits[0, len(seq) - 1:]
            want, margin = medusa_accepts(list(logits[:k]), drafts, TEMPERATURE, THRESHOLD, ALPHA)
            emitted = produced[len(seq) - 10: len(seq) - 10 + step[b]]
            if margin > 1e-4:  # a probability within rounding of the bar could go either way
                assert step[b] == want + 1, (b, seq, drafts, step[b], want)
                checked += 1
            assert emitted[: step[b] - 1] == drafts[: step[b] - 1][: len(emitted)]
            seq += emitted
    assert checked > rows * 3
    torch.manual_seed(0)
    lossless = exact.generate(ids, **sample)
    tau = lambda o: sum(map(sum, o.accept_lens)) / sum(sum(x > 0 for x in s) for s in o.accept_lens)  # noqa: E731
    assert tau(out) > tau(lossless) + 0.2, (tau(out), tau(lossless))
