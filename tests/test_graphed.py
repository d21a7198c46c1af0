"""runtime/graphed.py: the decode step over static buffers. On the CPU, the state handling
(reassigned session state copied back in place, host-side reassignments copied in, static
outputs fed back for free, clear errors); on the GPU, the hand-recorded CUDA graph is
token-exact with HF greedy, is recorded once per bucket, and samples afresh on every replay."""
import dataclasses

import pytest
import torch

import specgraph
from specgraph.drafts import Eagle3, NGram
from specgraph.runtime.graphed import GraphedCall, StaticStep
from specgraph.runtime.step import StepOut
from specgraph.trees import Chain, Tree
from test_capture import tiny_model
from test_generate import generated_rows, left_pad, prompts


class Session:
    """A stand-in draft session: ``length`` reassigned by the step, ``table`` mutated in place."""

    def __init__(self, device: str = "cpu"):
        self.length = torch.zeros(2, dtype=torch.int64, device=device)
        self.table = torch.zeros(2, 4, device=device)

    def state_owners(self) -> list[object]:  # DraftSession's default
        return [self]


def make_step(session):
    def fn(tree, cache_len, active):
        accept = torch.where(active, tree.depth[:, -1] + 1, 0)
        session.length = session.length + accept  # reassigned, as sessions do
        session.table.add_(1.0)  # mutated in place
        next_tree = dataclasses.replace(tree, tokens=tree.tokens + 1)
        return StepOut(tree.tokens[:, :2].clone(), accept, cache_len + accept, next_tree,
                       path_rank=tree.rank[:, :2] + tree.tokens[:, :1])  # a value per step: carried out
    return fn


def test_state_is_carried_in_place_and_host_changes_are_copied_in():
    session = Session()
    step = StaticStep(make_step(session), session, cuda_graph=False)
    tree = Tree.from_spec(Chain(3), torch.arange(8).view(2, 4))
    length_buffer = session.length
    out = step(tree, torch.tensor([5, 7]), torch.tensor([True, False]))
    assert out.accept_len.tolist() == [4, 0] and out.cache_len.tolist() == [9, 7]
    # a plain step function: its next tree's tokens, cache_len and length copied after it (the tree's other
    # tensors are the static ones, handed back by dataclasses.replace: not copied)
    assert step.copies_after_step == 3
    assert session.length is length_buffer and session.length.tolist() == [4, 0]  # same buffer, new value
    assert out.next_tree.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    cache_len, tree_buffer = out.cache_len, out.next_tree
    out = step(out.next_tree, out.cache_len, torch.tensor([True, True]))  # fed back: the same buffers
    assert out.cache_len is cache_len and out.next_tree is tree_buffer
    assert out.cache_len.tolist() == [13, 11] and session.length.tolist() == [8, 4]
    assert out.emitted.tolist() == [[1, 2], [5, 6]] and session.table[0, 0] == 2.0
    assert out.path_rank.tolist() == [[0, 1], [4, 5]]  # Tree.rank (-1, 0 on a chain) + this step's first token
    assert out.next_tree.rank.tolist() == [[-1, 0, 1, 2]] * 2  # the tree's ranks travel with it
    session.length = torch.tensor([100, 200])  # a host-side reassignment (prefill): copied in
    out = step(tree, torch.tensor([0, 0]), torch.tensor([True, True]))
    assert session.length is length_buffer and session.length.tolist() == [104, 204]
    assert out.emitted.tolist() == [[0, 1], [4, 5]]  # a new first tree was copied in


class Joined:
    """A session made of two (as LookupSession is): its state lives in them, not in itself."""

    def __init__(self):
        self.inner, self.other = Session(), Session()

    def state_owners(self) -> list[object]:
        return self.inner.state_owners() + self.other.state_owners()


@pytest.mark.parametrize("cuda_graph", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_the_state_of_a_joined_session_is_carried(cuda_graph):
    """Each part's reassigned state goes back into its static buffer after every step; with a CUDA graph,
    state left out of ``state_owners`` would stay frozen at the recording (negative control: the count
    of replays that advanced it)."""
    if cuda_graph and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = "cuda" if cuda_graph else "cpu"
    joined = Joined()
    for part in (joined.inner, joined.other):
        part.length, part.table = part.length.to(device), part.table.to(device)
    throwaway = make_step(Session(device))  # only its StepOut is used

    def fn(tree, cache_len, active):
        for part in (joined.inner, joined.other):
            part.length = part.length + torch.where(active, 1, 0)
        return throwaway(tree, cache_len, active)

    step = StaticStep(fn, joined, cuda_graph=cuda_graph)
    tree = Tree.from_spec(Chain(3), torch.arange(8, device=device).view(2, 4))
    for _ in range(4):  # warm-up, record, two replays
        step(tree, torch.tensor([5, 7], device=device), torch.tensor([True, False], device=device))
    assert joined.inner.length.tolist() == [4, 0] and joined.other.length.tolist() == [4, 0]


def test_a_mismatched_input_is_refused_by_name():
    session = Session()
    step = StaticStep(make_step(session), session, cuda_graph=False)
    tree = Tree.from_spec(Chain(3), torch.arange(8).view(2, 4))
    step(tree, torch.tensor([5, 7]), torch.tensor([True, True]))
    session.length = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"session\.length: the decode step was recorded for \(2,\)"):
        step(tree, torch.tensor([5, 7]), torch.tensor([True, True]))
    session.length = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="tree.max_depth: the decode step was recorded for 3, got 1"):
        step(Tree.from_spec(Chain(1), torch.arange(4).view(2, 2)), torch.tensor([5, 7]), torch.tensor([True, True]))
    with pytest.raises(RuntimeError, match=r"tree.tokens: the decode step was recorded for \(2, 4\)"):
        step(Tree.from_spec(Chain(3), torch.arange(12).view(3, 4)), torch.tensor([5, 7]), torch.tensor([True, True]))


def test_a_graphed_call_runs_on_its_static_buffers():
    seen = []

    def fn(x, y):
        seen.append((x.data_ptr(), y.data_ptr()))
        return x + y

    call = GraphedCall(fn, cuda_graph=False, name="the test call")
    first = call(torch.ones(2, 3), torch.arange(3.0).expand(2, -1))  # an expanded input: a dense buffer
    second = call(torch.zeros(2, 3), torch.full((2, 3), 5.0))
    assert seen[0] == seen[1]  # the same buffers, the new values copied in
    assert first.tolist() == [[1.0, 2.0, 3.0]] * 2 and second.tolist() == [[5.0] * 3] * 2
    with pytest.raises(RuntimeError, match=r"input 1: the test call was recorded for \(2, 3\) torch.float32, got"):
        call(torch.ones(2, 3), torch.ones(3, 3))
    with pytest.raises(RuntimeError, match="the test call was recorded for 2 inputs, got 1"):
        call(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="input 0: the test call was recorded with a tensor there"):
        call(None, torch.ones(2, 3))
    passes_none = GraphedCall(lambda nothing, x: x * 2 if nothing is None else x, cuda_graph=False)
    assert passes_none(None, torch.ones(2)).tolist() == [2.0, 2.0] and passes_none(None, torch.zeros(2)).sum() == 0


def _graphed_steps(spec):
    return [bucket.run for bucket in spec.capture.decode_steps.values() if isinstance(bucket.run, StaticStep)]


def _compile_on_cuda(kind, chain, dynamic, batch, max_length):
    """A tiny Llama on CUDA with an n-gram draft over ``Chain(chain)`` or EAGLE-3 over ``DynamicTree(*dynamic)``
    (``eagle3+lookup``: with a 6-token lookup branch beside it)."""
    model = tiny_model("llama").cuda()
    torch.manual_seed(0)
    if kind == "ngram":
        draft, tree = NGram(), Chain(chain)
    else:
        draft, tree = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)).cuda(), specgraph.DynamicTree(*dynamic)
        if kind == "eagle3+lookup":  # a prompt-lookup branch beside the tree
            tree = specgraph.WithLookup(tree, 6)
    return model, specgraph.compile(model, draft, tree=tree, max_batch=batch, max_cache_len=max_length,
                                    backend="inductor")


def _assert_matches_hf(model, spec, rows, new_tokens):
    ids, mask = left_pad(rows)
    out = spec.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new_tokens, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        one = torch.tensor([row], device="cuda")  # the oracle: HF greedy on the same device
        want = model.generate(one, attention_mask=torch.ones_like(one), do_sample=False, max_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=0)[0, len(row):]
        assert got == want.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,batch,skip,skip_fast", [
    ("eagle3", 1, "", ""), ("eagle3", 2, "", ""), ("eagle3", 2, "", "topk,fuse_projections"), ("ngram", 2, "", ""),
    ("ngram", 2, "fold_norms_rows", ""), ("eagle3+lookup", 2, "", "")])
def test_recorded_step_is_token_exact_on_cuda(kind, batch, skip, skip_fast, settings):
    """Greedy generate through the recorded step graph equals HF's greedy on the GPU (ngram: the verify step
    of 2 x 5 rows takes fold_norms_rows' kernels; with skip, without them; EAGLE-3 with the draft fast paths,
    specgraph::topk's kernel and the fused draft products inside the graph, and without them)."""
    settings(cuda_graphs=True, skip_passes=skip, skip_fast_paths=skip_fast)
    model, spec = _compile_on_cuda(kind, 4, (4, 3, 10), batch, 160)
    rows = prompts(3, [11, 30][:batch])
    for call in range(2):  # the second call reuses the recorded graph with new prompts copied in
        rows = [r[::-1] for r in rows] if call else rows
        _assert_matches_hf(model, spec, rows, 40)
    (step,) = _graphed_steps(spec)
    assert step.recordings == 1 and step.graph is not None
    if kind == "ngram" and not skip:  # the verify step (2 sequences x 5 nodes) took the folds
        counters = [dict(s.pass_results)["fold_norms_rows"].counters for s in spec.capture._steps.values()]
        assert any(c["norms_folded"] > 0 and c["silu_mul_folded"] > 0 for c in counters), counters


@pytest.mark.gpu
def test_recorded_sampling_draws_afresh_each_replay(settings):
    """The graph's random draws follow the generator: the same seed repeats a sample, another seed
    draws anew (a graph that baked its recording's random state in would repeat it)."""
    settings(cuda_graphs=True)
    model = tiny_model("llama").cuda()
    spec = specgraph.compile(model, NGram(), tree=Chain(3), max_batch=1, max_cache_len=200, backend="inductor")
    ids = torch.tensor([prompts(5, [12])[0]], device="cuda")

    def sample(seed):
        torch.manual_seed(seed)
        return spec.generate(ids, do_sample=True, temperature=2.0, max_new_tokens=64, eos_token_id=None)[0, 12:]

    first, again, other = sample(1), sample(1), sample(2)
    assert _graphed_steps(spec)[0].recordings == 1
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["eagle3", "ngram"])
def test_recorded_prefill_is_token_exact_on_cuda(kind, settings):
    """What a call runs before its first step, as CUDA graphs: the prefill bucket, the draft's pass
    over the prompt and the first propose. Prompts of several chunks and new lengths replay one
    recording each (the session state they read is written in place), token-exact."""
    settings(cuda_graphs=True)
    model, spec = _compile_on_cuda(kind, 3, (3, 2, 6), 2, 320)
    for seed, lengths in enumerate(([150, 70], [40, 201], [131, 131])):  # 1 to 4 chunks of 64
        _assert_matches_hf(model, spec, prompts(30 + seed, lengths), 16)
    (call,) = spec.capture.prefills.values()
    assert call.recordings == 1 and call.graph is not None
    (bucket,) = spec.capture.decode_steps.values()
    assert bucket.propose.recordings == 1  # the first propose of a call, recorded once
    if kind == "eagle3":  # the draft's own pass over the prompt (chunks of 32) is recorded once too
        assert bucket.session._prefill_chain.recordings == 1


@pytest.mark.gpu
def test_a_graph_that_draws_replays_while_another_thread_records():
    """A recording marks the default CUDA generator as capturing for every thread; a replay that draws
    random numbers (unseeded sampling served beside the fast start's worker) waits for it instead of
    raising "Offset increment outside graph capture", and still draws afresh."""
    import threading
    import time

    from specgraph.runtime.graphed import _run_recorded

    class Owner:
        graph = outputs = None
        recordings = 0

    base = torch.zeros(4096, device="cuda")
    drawer, slow = Owner(), Owner()
    draw = lambda: torch.rand(4096, device="cuda") + base  # noqa: E731
    _run_recorded(drawer, draw, True)
    first = _run_recorded(drawer, draw, False).clone()
    recording = threading.Event()

    def slow_body():
        recording.set()
        time.sleep(0.5)  # the other thread replays meanwhile
        return base * 2

    worker = threading.Thread(target=lambda: _run_recorded(slow, slow_body, False))
    worker.start()
    recording.wait()
    second = _run_recorded(drawer, draw, False).clone()
    worker.join()
    assert slow.recordings == 1 and drawer.recordings == 1
    assert not torch.equal(first, second)
