"""repetition_penalty under speculation is transformers' RepetitionPenaltyLogitsProcessor at every
tree node, over the committed tokens and the node's own root path (not its siblings). Oracles:
the processor itself per node (plain torch), the tiny models' own ``model.generate`` (greedy:
token-exact; sampling: chi-square per position) and SmolLM2's. Negative controls: the same step
without the ancestors' tokens, and no penalty, are told apart from model.generate."""
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

import specgraph
import specgraph.runtime.step as step_module
from specgraph import Chain, DynamicTree, StaticTree, Tree
from specgraph.drafts import Eagle3, NGram
from specgraph.drafts.base import Draft, DraftSession
from specgraph.kernels.penalty import penalize, reset_seen, seen_buffer
from test_capture import tiny_model
from test_generate import _homogeneity_p, _marginals, _small_vocab_model, hf_greedy, left_pad, prompts

# the root's 12 children cover a 12-token vocabulary (every step accepts one drafted token, most often
# one not seen before), each with 4 children of its own (61 nodes), or a chain of 3 (49 nodes)
SPRAY = StaticTree([[i] for i in range(12)] + [[i, j] for i in range(12) for j in range(4)])
SPRAY_DEEP = StaticTree([[i] + [0] * d for i in range(12) for d in range(4)])


class Spray(Draft):
    """A test draft with no weights for static trees: node i drafts (its parent's token + 1 + its sibling
    rank) mod V, so trees reach tokens the sequence has not seen."""

    kind = "spray"

    def __init__(self, vocab: int):
        self.vocab = vocab

    def session(self, tree, batch, max_length, device):
        return _SpraySession(tree, batch, self.vocab, device)


class _SpraySession(DraftSession):
    def __init__(self, spec, batch, vocab, device):
        parents, ranks = spec.parents(), spec.ranks()
        offsets = [0] * spec.num_nodes
        for i in range(1, spec.num_nodes):
            offsets[i] = offsets[parents[i]] + 1 + ranks[i]
        self.spec, self.vocab, self.offsets = spec, vocab, torch.tensor(offsets, device=device)

    def caches(self):
        return []

    def prefill(self, prompts, features):
        pass

    def propose(self, roots):
        return Tree.from_spec(self.spec, (roots.view(-1, 1) + self.offsets) % self.vocab)

    def commit(self, tree, acc, features, accept_len):
        pass


def _without_ancestors(monkeypatch):
    """The negative control: every node penalised by the committed tokens alone (its root path dropped)."""
    monkeypatch.setattr(step_module, "penalize",
                        lambda logits, seen, tokens, mask, p: penalize(logits, seen, tokens, torch.ones_like(mask), p))


@pytest.mark.parametrize("penalty", [1.7, 0.6])
def test_every_node_is_penalised_as_transformers_penalises_its_sequence(penalty):
    g = torch.Generator().manual_seed(0)
    spec = StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [2, 0], [2, 0, 0], [2, 0, 0, 0]])
    b, n, v = 3, spec.num_nodes, 40
    tokens = torch.randint(0, v, (b, n), generator=g)  # repeats within a path and across siblings too
    tree = Tree.from_spec(spec, tokens)
    parents = tree.parents
    # each row's committed tokens; the last is the tree's root (the next step's input)
    history = [torch.randint(0, v, (length,), generator=g).tolist() + [int(tokens[row, 0])]
               for row, length in enumerate((0, 5, 9))]
    logits = torch.randn(b, n, v, generator=g) * 3
    seen = seen_buffer(b, v, "cpu")
    reset_seen(seen, history)
    got = penalize(logits, seen, tree.tokens, tree.mask, torch.tensor(penalty))
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(b):
        for node in range(n):
            path, i = [], node
            while i > 0:  # the node's ancestors and itself, the root left out (it is history's last)
                path.insert(0, int(tokens[row, i]))
                i = int(parents[row, i])
            sequence = torch.tensor([history[row] + path])
            want = processor(sequence, logits[row, node].unsqueeze(0).clone())[0]
            assert torch.allclose(got[row, node], want, rtol=0, atol=1e-6), (row, node)


def _compare_greedy(model, spec, rows, penalty, max_new=20):
    for row in rows:
        got = spec.generate(torch.tensor([row]), max_new_tokens=max_new, eos_token_id=None, repetition_penalty=penalty)
        if got[0, len(row):].tolist() != hf_greedy(model, row, max_new_tokens=max_new, eos_token_id=None,
                                                   repetition_penalty=penalty):
            return False
    ids, mask = left_pad(rows[:3])  # a batch: each row's padding is not a seen token (as in model.generate)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=None, repetition_penalty=penalty)
    want = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=max_new,
                          eos_token_id=None, repetition_penalty=penalty)
    return torch.equal(out, want)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
@pytest.mark.parametrize("kind", ["ngram-chain3", "eagle3-dynamic", "eagle3-chain2"])
def test_greedy_with_a_penalty_is_token_exact(kind, penalty):
    model = tiny_model("llama")
    draft, tree = {"ngram-chain3": lambda: (NGram(), Chain(3)),
                   "eagle3-dynamic": lambda: (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), DynamicTree(3, 3, 8)),
                   "eagle3-chain2": lambda: (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), Chain(2))}[kind]()
    spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=128)
    assert _compare_greedy(model, spec, prompts(5, [6, 13, 9]), penalty)
    plain = spec.generate(torch.tensor([prompts(5, [13])[0]]), max_new_tokens=20, eos_token_id=None)
    assert plain[0, 13:].tolist() == hf_greedy(model, prompts(5, [13])[0], max_new_tokens=20, eos_token_id=None)


@pytest.mark.parametrize("tree", [SPRAY, SPRAY_DEEP], ids=["spray-61", "spray-deep-49"])
def test_greedy_penalises_each_node_by_its_own_path(tree, monkeypatch):
    """A 12-token vocabulary and a draft that reaches unseen tokens: drafted tokens are accepted on
    most steps, so a node's ancestors matter; without them the output leaves model.generate's."""
    model = _small_vocab_model()
    spec = specgraph.compile(model, Spray(12), tree=tree, max_batch=3, max_cache_len=96)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 12, (int(n),), generator=g).tolist() for n in torch.randint(1, 5, (12,), generator=g)]
    out = spec.generate(torch.tensor([rows[0]]), max_new_tokens=12, eos_token_id=None, repetition_penalty=2.0,
                        return_dict_in_generate=True)
    assert max(max(step) for step in out.accept_lens) > 1
    for penalty in (2.0, 0.3):
        assert _compare_greedy(model, spec, rows, penalty, max_new=12), penalty
    _without_ancestors(monkeypatch)
    assert not all(_compare_greedy(model, spec, rows, penalty, max_new=12) for penalty in (2.0, 0.3))


def _statistics(sequences: torch.Tensor, start: int, positions: int) -> list[torch.Tensor]:
    """Per position, the token counts; and per row, how often a token repeats the one before it (counts of
    0 .. positions - 1): a node's own token is what a penalty without the node's path misses."""
    repeats = (sequences[:, start + 1:start + positions] == sequences[:, start:start + positions - 1]).sum(1)
    return [*_marginals(sequences, start, positions, 12), torch.bincount(repeats, minlength=positions).double()]


def test_sampling_with_a_penalty_matches_model_generate_in_distribution(monkeypatch):
    model = _small_vocab_model()
    rows, positions, prompt, penalty = 2000, 4, [5, 6], 6.0
    spec = specgraph.compile(model, Spray(12), tree=SPRAY, max_batch=rows, max_cache_len=72)
    ids = torch.tensor([prompt] * rows)
    kw = dict(do_sample=True, max_new_tokens=positions, eos_token_id=None, top_k=0)
    spec.generate(ids, repetition_penalty=1.5, **kw)  # the bucket is reused below with the penalty set in place
    torch.manual_seed(10)
    out = spec.generate(ids, repetition_penalty=penalty, return_dict_in_generate=True, **kw)
    assert len(spec.capture.decode_steps) == 1 and max(max(step) for step in out.accept_lens) > 1
    torch.manual_seed(11)
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, repetition_penalty=penalty, **kw)
    theirs = _statistics(hf, len(prompt), positions)
    for i, (a, b) in enumerate(zip(_statistics(out.sequences, len(prompt), positions), theirs)):
        assert _homogeneity_p(a, b) > 0.01, (i, a, b)
    # negative controls: without the penalty, and with it but without each node's ancestors
    torch.manual_seed(12)
    unpenalised = _statistics(spec.generate(ids, **kw), len(prompt), positions)
    assert min(_homogeneity_p(a, b) for a, b in zip(unpenalised, theirs)) < 1e-3
    _without_ancestors(monkeypatch)
    torch.manual_seed(13)
    wrong = _statistics(spec.generate(ids, repetition_penalty=penalty, **kw), len(prompt), positions)
    assert min(_homogeneity_p(a, b) for a, b in zip(wrong, theirs)) < 1e-3


@pytest.mark.parametrize("bad", [0.0, -1.2, float("nan"), float("inf"), "1.2", True])
def test_a_penalty_transformers_refuses_is_refused(bad):
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(2), max_cache_len=64)
    with pytest.raises(ValueError, match="repetition_penalty=.*a finite number > 0"):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, repetition_penalty=bad)


@pytest.mark.model
@pytest.mark.slow  # the real model and head (~30 s); the tiny targets' greedy and sampled tests above are CI's
def test_smollm2_greedy_with_a_penalty_is_token_exact():
    from specgraph.models import load_default_draft, load_gguf

    model, tokenizer = load_gguf()
    spec = specgraph.compile(model, load_default_draft(), tree=DynamicTree(3, 4, 8), max_cache_len=128)
    for text in ("The capital of France is", "List three colours: red,"):
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = spec.generate(ids, max_new_tokens=16, repetition_penalty=1.3, return_dict_in_generate=True)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              repetition_penalty=1.3)
        assert torch.equal(out.sequences, want), text


def test_the_compiled_step_takes_a_new_penalty_and_hands_back_scores(aot_eager_compile):
    """The whole step through torch.compile (fullgraph, aot_eager): the seen buffer updated in place, the
    penalty read from a tensor (a new value compiles nothing), the scores gathered at the accepted path."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=128)
    row = prompts(5, [6, 13])[1]
    ids = torch.tensor([row])
    for penalty in (1.3, 0.7):
        out = spec.generate(ids, max_new_tokens=16, eos_token_id=None, repetition_penalty=penalty,
                            return_dict_in_generate=True, output_scores=True)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                              max_new_tokens=16, eos_token_id=None, repetition_penalty=penalty,
                              return_dict_in_generate=True, output_scores=True)
        assert torch.equal(out.sequences, want.sequences), penalty
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(out.scores, want.scores))
    assert len(spec.capture.decode_steps) == 1
