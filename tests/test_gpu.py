"""On a GPU: selection and verification launch no host sync and replay
inside a CUDA graph, with the same results as on the CPU."""
import pytest
import torch

from specgraph import DynamicTree, select_tree
from specgraph.kernels.verify import sampling_probs, verify_greedy, verify_sample
from specgraph.selection import expand_frontier, seed_frontier

pytestmark = pytest.mark.gpu


def step(seed_logprobs, later_logprobs, tokens, root, target_logits, spec):
    """One draft-select-verify round, as the step graph will run it."""
    b, k = seed_logprobs.shape
    frontier = seed_frontier(seed_logprobs, tokens[:, :k])
    steps = [frontier]
    for s in range(1, spec.steps):
        t = tokens[:, k + (s - 1) * k * k: k + s * k * k].view(b, k, k)
        frontier = expand_frontier(frontier, later_logprobs[:, s - 1], t, s)
        steps.append(frontier)
    cat = lambda name: torch.cat([getattr(f, name) for f in steps], 1)  # noqa: E731
    tree = select_tree(cat("scores"), cat("tokens"), cat("parents"), root, spec)
    node_logits = target_logits  # [B, N, V]: stands in for the target over the tree
    greedy = verify_greedy(tree.tokens, tree.parents, tree.mask, node_logits.argmax(-1), tree.max_depth)
    return tree, greedy


def make_inputs(device, spec, b=4, v=50):
    g = torch.Generator().manual_seed(0)
    k = spec.topk
    seed = torch.randn(b, k, generator=g).log_softmax(-1)
    later = torch.randn(b, spec.steps - 1, k, k, generator=g).log_softmax(-1)
    tokens = torch.randint(0, v, (b, spec.num_candidates), generator=g)
    root = torch.randint(0, v, (b,), generator=g)
    logits = torch.randn(b, spec.num_nodes, v, generator=g)
    return [x.to(device) for x in (seed, later, tokens, root, logits)]


def test_no_host_sync_and_cuda_graph_replay_match_cpu(cuda):
    spec = DynamicTree(steps=5, topk=4, nodes=16)
    cpu_tree, cpu_acc = step(*make_inputs("cpu", spec), spec)
    inputs = make_inputs(cuda, spec)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree, acc = step(*inputs, spec)  # warm-up; raises on any synchronising call
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tree, g_acc = step(*inputs, spec)
    for x in inputs:  # new values, same buffers: the replay must see them
        x.copy_(x.roll(1, 0))
    graph.replay()
    torch.cuda.synchronize()
    rolled_tree, rolled_acc = step(*[x.cpu() for x in inputs], spec)
    assert torch.equal(g_tree.tokens.cpu(), rolled_tree.tokens) and torch.equal(g_tree.mask.cpu(), rolled_tree.mask)
    assert torch.equal(g_acc.emitted.cpu(), rolled_acc.emitted)
    assert torch.equal(tree.tokens.cpu(), cpu_tree.tokens) and torch.equal(acc.path.cpu(), cpu_acc.path)


def test_sampled_verify_has_no_host_sync(cuda):
    spec = DynamicTree(steps=3, topk=3, nodes=10)
    seed, later, tokens, root, logits = make_inputs(cuda, spec)
    tree, _ = step(seed, later, tokens, root, logits, spec)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3], device=cuda)
    top_k, top_p = torch.tensor([0, 5, 10, 0], device=cuda), torch.tensor([1.0, 0.9, 0.8, 0.5], device=cuda)
    g = torch.Generator(device=cuda).manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        probs = sampling_probs(logits, temperature, top_k, top_p)
        a = verify_sample(tree.tokens, tree.parents, tree.mask, probs, tree.max_depth, generator=g)
        b = verify_sample(tree.tokens, tree.parents, tree.mask, probs, tree.max_depth, draft_probs=logits.softmax(-1), generator=g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (a.accept_len >= 1).all() and (b.accept_len >= 1).all()
