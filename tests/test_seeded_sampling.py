"""Seeded sampling (kernels/gumbel.py): generate(..., do_sample=True, seed=S) emits exactly the tokens
plain sampling (draft=None, one token a step) emits with that seed, token for token, for any draft and
tree, batch 1 and 3; the sampler is exact in distribution (chi-square over streams and seeds); negative
controls (noise reused across positions, keyed by node) must fail. Also: which rule the sampled step
takes (seeded; unseeded with a coupled draft too; else block verification on chains, token-wise otherwise);
coupled drafts (their candidates ranked with the target's noise) and bad seeds refused by name."""
import pytest
import torch

import specgraph
from specgraph import Chain, DynamicTree, StaticTree, WithLookup
from specgraph.drafts import Eagle, Eagle3, Medusa, NGram
from specgraph.kernels import gumbel
from specgraph.kernels.gumbel import (coupled_scores, seeded_draws, seeded_exponentials, seeded_uniform_bits,
                                      stream_keys, uniform_bits_ref)
from specgraph.kernels.verify import sampling_probs
from test_generate import _small_vocab_model, left_pad

VOCAB = 12
STATIC = StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
PARAMS = dict(temperature=0.7, top_k=8, top_p=0.95)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = ((counts[keep].double() - expected[keep]) ** 2 / expected[keep]).sum()
    return torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64), stat / 2).item()


# ----------------------------------------------------------------------------- the noise and the sampler
def test_hash_matches_the_python_integer_reference():
    for seed in (0, 1, 2**32 + 5, 2**64 - 1):
        keys = stream_keys(seed, 3)
        positions = torch.tensor([[0, 7, 4096], [1, 2, 3], [2**31, 2**32 - 1, 10**6]])
        bits = seeded_uniform_bits(keys, positions, 300)
        for row in range(3):
            for p in range(3):
                for v in (0, 1, 150, 299):
                    assert int(bits[row, p, v]) == uniform_bits_ref(seed, row, int(positions[row, p]), v)


def test_inductor_generates_the_same_bits():
    """The hash under inductor's generated code (C++ here, Triton on CUDA) is the eager one, bit for bit:
    integer ops only, no overflow (one small graph; the whole step is compiled in the generate tests)."""
    keys, positions = stream_keys(2**40 + 3, 2), torch.tensor([[0, 5, 2**31 + 1], [7, 8, 9]])
    compiled = torch.compile(seeded_uniform_bits, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(keys, positions, 1000), seeded_uniform_bits(keys, positions, 1000))


PROBS = torch.tensor([0.4, 0.25, 0.0, 0.2, 0.1, 0.05])


def test_draws_follow_the_distribution_over_rows_positions_and_seeds():
    probs = PROBS.expand(20_000, 1, 6)
    over_rows = seeded_draws(probs, stream_keys(11, 20_000), torch.full((20_000, 1), 9))
    assert chi_square_p(torch.bincount(over_rows.flatten(), minlength=6), PROBS) > 0.01
    over_positions = seeded_draws(PROBS.expand(1, 20_000, 6), stream_keys(11, 1), torch.arange(20_000).view(1, -1))
    assert chi_square_p(torch.bincount(over_positions.flatten(), minlength=6), PROBS) > 0.01
    keys = torch.cat([stream_keys(seed, 1) for seed in range(4000)])  # row 0 of 4000 seeds
    over_seeds = seeded_draws(PROBS.expand(4000, 1, 6), keys, torch.zeros(4000, 1, dtype=torch.long))
    assert chi_square_p(torch.bincount(over_seeds.flatten(), minlength=6), PROBS) > 0.01


def _pairs_p(positions: torch.Tensor) -> float:
    """Chi-square p that the draws at two positions of 20,000 streams are independent draws of PROBS."""
    draws = seeded_draws(PROBS.expand(20_000, 2, 6), stream_keys(5, 20_000), positions.expand(20_000, 2))
    joint = torch.outer(PROBS, PROBS).flatten()
    return chi_square_p(torch.bincount(draws[:, 0] * 6 + draws[:, 1], minlength=36), joint)


def test_positions_are_independent_and_reused_noise_is_caught():
    assert _pairs_p(torch.tensor([[40, 41]])) > 0.01
    assert _pairs_p(torch.tensor([[40, 40]])) < 1e-6  # negative control: one noise vector for both


def test_a_temperature_filtered_target_is_sampled_exactly():
    logits = torch.randn(1, 1, 6, generator=torch.Generator().manual_seed(0)) * 2
    probs = sampling_probs(logits, 1.5, 4, 0.97)[0, 0]  # the processed distribution, zeros included
    assert 3 <= int((probs > 0).sum()) < 6
    draws = seeded_draws(probs.expand(20_000, 1, 6), stream_keys(3, 20_000), torch.full((20_000, 1), 2))
    assert chi_square_p(torch.bincount(draws.flatten(), minlength=6), probs) > 0.01


def test_exponentials_are_finite_and_positive():
    e = seeded_exponentials(stream_keys(0, 2), torch.arange(64).view(2, 32), 5000)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert abs(e.mean().item() - 1) < 0.01


# ----------------------------------------------------------------------------- coupled drafts
def _coupled_acceptance(target_logits, draft_logits, keys, positions, temperature, tokens=None, draft_positions=None):
    """The share of (row, position) where the draft's best coupled candidate (its noise at ``draft_positions``,
    default ``positions``) is the target's seeded draw."""
    draws = seeded_draws(torch.softmax(target_logits / temperature, -1), keys, positions)  # [B, P] target ids
    at = positions if draft_positions is None else draft_positions
    best = torch.stack([coupled_scores(draft_logits[:, i], keys, at[:, i], temperature, tokens).argmax(-1)
                        for i in range(positions.shape[1])], 1)
    best = best if tokens is None else tokens[best]
    return (best == draws).float().mean().item()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_a_draft_that_is_the_target_drafts_every_draw(temperature):
    """q = p: the coupled draft's best candidate is the target's seeded draw at every position, where the
    uncoupled best (argmax q) is accepted with probability p(argmax); noise of another position (negative
    control) loses that."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 5, 50, generator=g) * 2
    keys, positions = stream_keys(9, 64), 100 + torch.arange(5).expand(64, 5)
    assert _coupled_acceptance(logits, logits, keys, positions, temperature) == 1.0
    draws = seeded_draws(torch.softmax(logits / temperature, -1), keys, positions)
    assert (logits.argmax(-1) == draws).float().mean().item() < 0.9  # uncoupled
    assert _coupled_acceptance(logits, logits, keys, positions, temperature, draft_positions=positions + 1) < 0.9
    # a draft vocabulary (a subset of the target's ids, d2t): the same, where the target's mass lies inside it
    tokens = torch.arange(0, 50, 2)
    inside = torch.full_like(logits, -float("inf"))
    inside[..., tokens] = logits[..., tokens]
    assert _coupled_acceptance(inside, logits[..., tokens], keys, positions, temperature, tokens) == 1.0


def test_a_close_draft_is_accepted_at_least_as_the_coupling_bound_says():
    """q near p (total variation TV): P(accept) >= (1 - TV) / (1 + TV) (Daliri et al.), above the uncoupled p(argmax q)."""
    g = torch.Generator().manual_seed(2)
    target = torch.randn(4000, 1, 30, generator=g)
    draft = target + 0.5 * torch.randn(4000, 1, 30, generator=g)
    keys, positions = stream_keys(4, 4000), torch.full((4000, 1), 7)
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    tv = 0.5 * (p - q).abs().sum(-1).mean().item()
    coupled = _coupled_acceptance(target, draft, keys, positions, 1.0)
    uncoupled = p.gather(-1, q.argmax(-1, keepdim=True)).mean().item()  # point-mass draft: accepted w.p. p(argmax q)
    assert coupled >= (1 - tv) / (1 + tv) - 0.02 and coupled > uncoupled + 0.1, (coupled, uncoupled, tv)


# ----------------------------------------------------------------------------- end to end: speculative == plain
_MODEL = None


def small_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = _small_vocab_model()
    return _MODEL


def rows_for(seed: int, batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(batch):
        n = int(torch.randint(4, 20, (1,), generator=g))
        base = torch.randint(3, VOCAB, (3,), generator=g).tolist()
        rows.append((base * 10)[:n] if i % 2 == 0 else torch.randint(3, VOCAB, (n,), generator=g).tolist())
    return rows


def seeded(spec, rows, seed, max_new=24, **kw):
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, do_sample=True, seed=seed, max_new_tokens=max_new,
                        eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, **{**PARAMS, **kw})
    return out.sequences[:, ids.shape[1]:], out.accept_lens


def drafts(model):
    torch.manual_seed(0)
    return {
        "ngram-chain": (NGram(), Chain(4)),
        "medusa-chain": (Medusa(model.config.hidden_size, VOCAB, num_heads=3), Chain(3)),
        "medusa-static": (Medusa(model.config.hidden_size, VOCAB, num_heads=3), STATIC),
        "eagle-dynamic": (Eagle.for_target(model), DynamicTree(steps=3, topk=2, nodes=6)),
        "eagle3-dynamic": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), DynamicTree(steps=3, topk=3, nodes=8)),
        "eagle3-static": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), STATIC),
        "eagle3-dynamic+lookup": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)),
                                  WithLookup(DynamicTree(steps=3, topk=2, nodes=5), 4)),
    }


@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_equals_plain_sampling_token_for_token(batch):
    model = small_model()
    plain = specgraph.compile(model, None, max_batch=3, max_cache_len=128)
    accepted = {}
    for name, (draft, tree) in drafts(model).items():
        spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=128)
        accepted[name] = 0
        for trial in range(3 if batch == 1 else 2):
            rows, seed = rows_for(10 * batch + trial, batch), 1000 * trial + batch
            want, _ = seeded(plain, rows, seed)
            got, lens = seeded(spec, rows, seed)
            assert torch.equal(got, want), (name, trial)
            accepted[name] += sum(n > 1 for step in lens for n in step)
        another, _ = seeded(spec, rows, seed + 1)
        assert not torch.equal(another, got)  # the seed matters
    assert all(n > 0 for n in accepted.values()), accepted  # every draft had drafts accepted: verification mattered


def test_plain_seeded_sampling_is_the_independent_oracle():
    """The engine's plain seeded decoding against a loop over the HF model's own forward: at absolute
    position t, argmax_v p(v | prefix) / E(seed, row, t, v); and each row is its own stream (row r of a
    batch is independent of the other rows' prompts)."""
    model = small_model()
    plain = specgraph.compile(model, None, max_batch=3, max_cache_len=128)
    rows, seed = rows_for(7, 3), 42
    got, _ = seeded(plain, rows, seed, max_new=16)
    keys = stream_keys(seed, 3)
    for r, prompt in enumerate(rows):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                logits = model(torch.tensor([seq])).logits[:, -1:].float()
                probs = sampling_probs(logits, PARAMS["temperature"], PARAMS["top_k"], PARAMS["top_p"])
                seq.append(int(seeded_draws(probs, keys[r:r + 1], torch.tensor([[len(seq)]]))[0, 0]))
        assert got[r].tolist() == seq[len(prompt):], r
    alone, _ = seeded(plain, [rows[0], rows[2], rows[1]], seed, max_new=16)
    assert torch.equal(alone[0], got[0])  # row 0 keeps its stream; rows 1 and 2 swapped streams
    assert not torch.equal(alone[1], got[2]) or not torch.equal(alone[2], got[1])


def test_unseeded_plain_sampling_follows_the_target_and_each_call_draws_anew():
    """Plain decoding samples unseeded through the seeded draws with a seed per call: per position the same
    distribution as model.generate's sampling (two-sample chi-square); two calls differ, a repeated
    torch.manual_seed repeats a call; plain sampling at another temperature is told apart (control)."""
    from test_generate import _homogeneity_p, _marginals

    model = small_model()
    rows, positions, prompt = 2000, 3, [3, 4, 5, 3, 4]
    plain = specgraph.compile(model, None, max_batch=rows, max_cache_len=64)
    ids = torch.tensor([prompt] * rows)
    torch.manual_seed(5)
    ours = plain.generate(ids, do_sample=True, max_new_tokens=positions, eos_token_id=None, **PARAMS)
    torch.manual_seed(6)
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=positions,
                            eos_token_id=None, pad_token_id=0, **PARAMS)
    hot = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=positions,
                         eos_token_id=None, pad_token_id=0, **{**PARAMS, "temperature": 2.5})
    a, b, c = (_marginals(x, len(prompt), positions, VOCAB) for x in (ours, theirs, hot))
    assert min(_homogeneity_p(a[i], b[i]) for i in range(positions)) > 0.01 / positions
    assert min(_homogeneity_p(b[i], c[i]) for i in range(positions)) < 1e-3
    one = ids[:4]
    first = plain.generate(one, do_sample=True, max_new_tokens=8, eos_token_id=None, **PARAMS)
    assert not torch.equal(plain.generate(one, do_sample=True, max_new_tokens=8, eos_token_id=None, **PARAMS), first)
    torch.manual_seed(7)
    again = plain.generate(one, do_sample=True, max_new_tokens=8, eos_token_id=None, **PARAMS)
    torch.manual_seed(7)
    assert torch.equal(plain.generate(one, do_sample=True, max_new_tokens=8, eos_token_id=None, **PARAMS), again)


def _node_keyed(tokens, parents, mask, target_probs, max_depth, keys, base):
    """Negative control: noise keyed by node index, not position."""
    n = tokens.shape[1]
    positions = base.view(-1, 1) + 1 + torch.arange(n)
    draws = (target_probs / seeded_exponentials(keys, positions, target_probs.shape[-1])).argmax(-1)
    return gumbel.verify_draws(tokens, parents, mask, draws, max_depth)


def _position_reused(tokens, parents, mask, target_probs, max_depth, keys, base):
    """Negative control: one noise vector for every depth of the step."""
    positions = (base.view(-1, 1) + 1).expand(-1, tokens.shape[1])
    draws = (target_probs / seeded_exponentials(keys, positions, target_probs.shape[-1])).argmax(-1)
    return gumbel.verify_draws(tokens, parents, mask, draws, max_depth)


@pytest.mark.parametrize("wrong, tree_kind", [(_node_keyed, "eagle-dynamic"), (_position_reused, "ngram-chain")])
def test_equality_test_catches_wrong_noise_keys(wrong, tree_kind, monkeypatch):
    model = small_model()
    plain = specgraph.compile(model, None, max_batch=3, max_cache_len=128)
    draft, tree = drafts(model)[tree_kind]
    spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=128)
    cases = [(rows_for(50 + t, 3), 7 + t) for t in range(3)]
    want = [seeded(plain, rows, seed)[0] for rows, seed in cases]  # plain decoding: depth 0 only, unaffected
    assert all(torch.equal(seeded(spec, rows, seed)[0], w) for (rows, seed), w in zip(cases, want))
    monkeypatch.setattr("specgraph.runtime.step.verify_seeded", wrong)  # read by the (eager) step at each call
    assert any(not torch.equal(seeded(spec, rows, seed)[0], w) for (rows, seed), w in zip(cases, want))


@pytest.mark.parametrize("kind", ["ngram-chain", "eagle3-dynamic"])
def test_inductor_compiled_step_is_token_exact(aot_eager_compile, kind):
    """backend="inductor" (compiled through dynamo with fullgraph=True: no graph break, no host sync; the
    aot_eager fixture skips inductor's slow CPU codegen): the same tokens as eager plain sampling, a coupled
    draft's noise included."""
    model = small_model()
    plain = specgraph.compile(model, None, max_batch=3, max_cache_len=128)
    draft, tree = drafts(model)[kind]
    spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=128, backend="inductor")
    for trial in range(2):
        rows = rows_for(80 + trial, 3)
        assert torch.equal(seeded(spec, rows, trial)[0], seeded(plain, rows, trial)[0])


def test_fast_start_samples_plain_samplings_tokens_uncompiled_and_compiled(aot_eager_compile):
    """fast_start=True: the first call runs the uncompiled static step while the worker compiles, later ones the
    compiled step; seeded sampling emits plain sampling's tokens on both."""
    model = small_model()
    plain = specgraph.compile(model, None, max_batch=3, max_cache_len=128)
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_batch=3, max_cache_len=128, backend="inductor",
                             fast_start=True)
    rows = rows_for(90, 3)
    assert not spec.fast_start.ready
    assert torch.equal(seeded(spec, rows, 5)[0], seeded(plain, rows, 5)[0])  # served uncompiled
    assert spec.wait_compiled(timeout=600) and spec.fast_start.ready and not spec.fast_start.failed
    for seed in (5, 6):
        assert torch.equal(seeded(spec, rows, seed)[0], seeded(plain, rows, seed)[0])  # compiled


# ----------------------------------------------------------------------------- the rule the step takes; bad seeds
def test_the_sampled_step_picks_its_rule(monkeypatch):
    """Seeded, a draft that couples (EAGLE, Medusa) or plain decoding: the Gumbel-max rule; else (n-gram) block
    verification on a chain (token-wise on other trees: a draft of another kind)."""
    import specgraph.runtime.step as step

    calls = []
    for name in ("verify_seeded", "verify_block", "verify_sample"):
        real = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    model = small_model()
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    chain = specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64)
    tree = specgraph.compile(model, Eagle.for_target(model), tree=DynamicTree(steps=2, topk=2, nodes=4), max_cache_len=64)
    medusa = specgraph.compile(model, Medusa(model.config.hidden_size, VOCAB, num_heads=2), tree=STATIC.__class__(
        [[0], [1], [0, 0]]), max_cache_len=64)
    plain = specgraph.compile(model, None, max_cache_len=64)
    for spec, kw, want in [(plain, {}, "verify_seeded"), (chain, {}, "verify_block"),
                           (chain, {"seed": 1}, "verify_seeded"),
                           (tree, {}, "verify_seeded"), (tree, {"seed": 1}, "verify_seeded"),
                           (medusa, {}, "verify_seeded")]:
        calls.clear()
        spec.generate(ids, do_sample=True, max_new_tokens=4, eos_token_id=None, **kw)
        assert calls and set(calls) == {want}, (kw, calls)


def test_bad_seeds_are_refused_by_name():
    spec = specgraph.compile(small_model(), NGram(), tree=Chain(2), max_cache_len=64)
    ids = torch.tensor([[3, 4, 5]])
    for bad in ("3", -1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=r"seed=.*an int in \[0, 2\*\*64\)"):
            spec.generate(ids, do_sample=True, seed=bad, max_new_tokens=2)
    with pytest.raises(ValueError, match="do_sample=True"):
        spec.generate(ids, seed=3, max_new_tokens=2)
    with pytest.warns(UserWarning, match="LOSSY"):
        typical = specgraph.compile(small_model(), Medusa(32, VOCAB, num_heads=2), tree=Chain(2), max_cache_len=64,
                                    verify="typical")
    with pytest.raises(ValueError, match="verify='typical'"):
        typical.generate(ids, do_sample=True, seed=3, max_new_tokens=2)
