"""On the GPU, the sampling rules the CPU suite proves: seeded speculative sampling emits plain seeded
sampling's tokens with the whole step compiled by inductor and replayed as a CUDA graph (every draft kind,
batch 1 and 3; a wrong seed as the negative control), and block verification on CUDA accepts what the
CPU reference accepts for the same inputs and coins, and its full sampler follows the target (chi-square)."""
import copy

import pytest
import torch

import specgraph
from test_seeded_sampling import drafts, rows_for, seeded, small_model
from test_verify_block import chain_inputs, model_tables
from test_verify_sampling import run
from specgraph.kernels.verify import Acceptance
from specgraph.kernels.verify_block import verify_block

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_cuda():
    return copy.deepcopy(small_model()).cuda()  # a copy: the CPU tests share small_model()'s instance


@pytest.mark.parametrize("batch", [1, 3])
def test_seeded_speculative_equals_plain_sampling_compiled_and_graphed(model_cuda, batch):
    plain = specgraph.compile(model_cuda, None, max_batch=3, max_cache_len=128, backend="inductor")
    for name, (draft, tree) in drafts(model_cuda).items():
        draft = draft.cuda() if isinstance(draft, torch.nn.Module) else draft
        spec = specgraph.compile(model_cuda, draft, tree=tree, max_batch=3, max_cache_len=128, backend="inductor")
        for trial in range(2):
            rows, seed = rows_for(20 * batch + trial, batch), 500 * trial + batch
            want, _ = seeded(plain, rows, seed)
            got, _ = seeded(spec, rows, seed)
            assert torch.equal(got, want), (name, trial)
        assert not torch.equal(seeded(spec, rows, seed + 1)[0], got), name  # the seed matters


@pytest.mark.parametrize("seed", range(3))
def test_block_verification_on_cuda_accepts_what_the_cpu_does(seed):
    depth = 3
    target, draft = model_tables(500 + seed, depth, 1.5), model_tables(600 + seed, depth, 1.5)
    _, tokens, target_probs, draft_probs, q = chain_inputs(target, draft, depth)
    g = torch.Generator().manual_seed(seed)
    rows = torch.multinomial(q, 4096, replacement=True, generator=g)
    coins = torch.rand(rows.shape[0], depth, generator=g)
    cpu = verify_block(tokens[rows], target_probs[rows], depth, draft_probs[rows], coins=coins)
    gpu = verify_block(tokens[rows].cuda(), target_probs[rows].float().cuda(), depth, draft_probs[rows].float().cuda(),
                       coins=coins.cuda())
    # the accepted length is a function of the coins and the block weights (float32 on the GPU: a coin within
    # rounding of a weight may flip, rarely)
    same = (gpu.accept_len.cpu() == cpu.accept_len).float().mean()
    assert same > 0.999, same
    assert (gpu.accept_len.float().mean().cpu() - cpu.accept_len.float().mean()).abs() < 0.01


def _block_on_cuda(tokens, parents, mask, target_probs, max_depth, draft_probs=None, generator=None):
    """verify_block on CUDA tensors (its coins and correction from a CUDA generator seeded from ``generator``)."""
    cuda = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=generator)))
    acc = verify_block(tokens.cuda(), target_probs.float().cuda(), max_depth,
                       None if draft_probs is None else draft_probs.float().cuda(), generator=cuda)
    return Acceptance(*(x.cpu() for x in acc))


@pytest.mark.parametrize("mode", ["iid", "topk"])
def test_block_verifications_full_sampler_follows_the_target_on_cuda(mode):
    p, acc = run("chain", mode, verifier=_block_on_cuda)
    assert p > 0.01, f"chi-square p = {p:.2e}"
    assert acc.accept_len.float().mean() > 1.2
