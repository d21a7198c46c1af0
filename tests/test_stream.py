"""runtime.stream_generate (continuous batching of plain decoding): every prompt's answer is HF greedy's,
whichever slot it ran in, however often the slots were refilled, and with prompts added while it runs;
bad input is refused by name."""
from collections import deque

import pytest
import torch

import specgraph
from specgraph.drafts import NGram
from specgraph.runtime.generate import Sampling
from specgraph.runtime.stream import stream_generate
from test_capture import tiny_model
from test_generate import hf_greedy, prompts

MAX_NEW = 10
MAX_LENGTH = 96


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama")
    rows = prompts(3, [4, 9, 17, 6, 30, 2, 11, 23, 5, 14])
    full = [hf_greedy(model, p, max_new_tokens=MAX_NEW, eos_token_id=None) for p in rows]
    # an eos the answers reach at different points (or never): rows finish at different steps
    counts = torch.bincount(torch.tensor([t for f in full for t in f[1:]]))
    eos = int(counts.argmax())
    return model, rows, full, eos


def expected(full: list[int], eos: int | None) -> list[int]:
    return full[: full.index(eos) + 1] if eos is not None and eos in full else full


def stream(spec, queue, batch, eos, refill, sampling=None):
    draft, _ = spec.mode("tree", batch)
    return stream_generate(spec.capture, draft, queue, batch, MAX_NEW, {eos} if eos is not None else set(),
                           MAX_LENGTH, sampling, refill)


def schedule(lengths: list[int], batch: int, refill: int) -> dict:
    """The stream's policy replayed on answer lengths alone: every busy row emits a token a step; once
    ``refill`` rows are free (and prompts wait) that many are prefilled into them. Steps and refills."""
    waiting, busy = list(lengths[batch:]), list(lengths[:batch]) + [0] * max(0, batch - len(lengths))
    steps = refills = 0
    while any(busy):
        steps += 1
        busy = [n - 1 if n else 0 for n in busy]
        free = [s for s, n in enumerate(busy) if n == 0]
        while waiting and len(free) >= refill:
            for s in free[:refill]:
                busy[s] = waiting.pop(0) if waiting else 0
            free, refills = free[refill:], refills + 1
    return dict(steps=steps, refills=refills)


@pytest.mark.parametrize("batch, refill", [(4, 1), (4, 2), (3, 3)])
def test_every_prompt_gets_hf_greedys_answer_through_refilled_slots(target, batch, refill):
    model, rows, full, eos = target
    ends = [expected(f, eos) for f in full]
    assert len({len(e) for e in ends}) > 2  # the rows finish at different steps: slots are refilled mid-run
    spec = specgraph.compile(model, None, max_batch=batch, max_cache_len=MAX_LENGTH)
    draft, _ = spec.mode("tree", batch)
    stats = {}
    got = {key: (tokens, at_eos) for key, tokens, at_eos in stream_generate(
        spec.capture, draft, deque(enumerate(rows)), batch, MAX_NEW, {eos}, MAX_LENGTH, None, refill, stats)}
    assert sorted(got) == list(range(len(rows)))
    assert stats == schedule([len(e) for e in ends], batch, refill) and stats["refills"] >= 1
    for i, want in enumerate(ends):
        assert got[i] == (want, want[-1] == eos), i


@pytest.mark.parametrize("batch, refill", [(4, 1), (4, 2), (3, 3)])
def test_launching_the_next_step_before_the_host_reads_ends_with_the_last_row(target, settings, batch, refill):
    """With the next step launched before the host reads the last (``config.overlap``, CUDA's default), the
    stream still gives every answer and stops once every row has ended (it used to launch steps of empty
    rows forever: a hang on the GPU); at most one step more than without it per refill and at the end."""
    model, rows, full, eos = target
    settings(overlap=True)
    spec = specgraph.compile(model, None, max_batch=batch, max_cache_len=MAX_LENGTH)
    draft, _ = spec.mode("tree", batch)
    stats = {}
    got = dict((key, tokens) for key, tokens, _ in stream_generate(
        spec.capture, draft, deque(enumerate(rows)), batch, MAX_NEW, {eos}, MAX_LENGTH, None, refill, stats))
    assert got == {i: expected(f, eos) for i, f in enumerate(full)}
    least = schedule([len(expected(f, eos)) for f in full], batch, refill)
    assert least["steps"] <= stats["steps"] <= least["steps"] + least["refills"] + 1


def test_prompts_added_while_it_runs_are_answered_too(target):
    """The next turn of a conversation enters the queue when its answer comes back (what distill does)."""
    model, rows, _, eos = target
    spec = specgraph.compile(model, None, max_batch=2, max_cache_len=MAX_LENGTH)
    queue, seen = deque((i, p) for i, p in enumerate(rows[:3])), {}
    for key, tokens, _ in stream(spec, queue, 2, eos, 1):
        seen[key] = tokens
        if isinstance(key, int):
            queue.append((f"{key}+", rows[key] + tokens + [7]))
    assert len(seen) == 6
    for i in range(3):
        assert seen[i] == expected(hf_greedy(model, rows[i], max_new_tokens=MAX_NEW, eos_token_id=None), eos)
        follow = rows[i] + seen[i] + [7]
        assert seen[f"{i}+"] == expected(hf_greedy(model, follow, max_new_tokens=MAX_NEW, eos_token_id=None), eos)


def test_a_near_zero_temperature_samples_the_greedy_answers(target):
    """The sampled step through the same slots: at T = 1e-3 every draw is the argmax (the sharpened head's
    gaps are far above T), so any slot mix-up would show."""
    model, rows, full, eos = target
    spec = specgraph.compile(model, None, max_batch=3, max_cache_len=MAX_LENGTH)
    got = dict((k, t) for k, t, _ in stream(spec, deque(enumerate(rows)), 3, eos, 1, Sampling(temperature=1e-3)))
    assert got == {i: expected(f, eos) for i, f in enumerate(full)}


def test_bad_input_is_refused_by_name(target):
    model, rows, _, eos = target
    spec = specgraph.compile(model, None, max_batch=2, max_cache_len=MAX_LENGTH)
    with pytest.raises(ValueError, match="sampling.seed=5"):
        next(stream(spec, deque([(0, rows[0])]), 2, eos, 1, Sampling(temperature=1.0, seed=5)))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        next(stream_generate(spec.capture, spec.mode("tree", 2)[0], deque([(0, rows[0])]), 2, 0, {eos}, MAX_LENGTH))
    with pytest.raises(ValueError, match="refill=3"):
        next(stream(spec, deque([(0, rows[0])]), 2, eos, 3))
    with pytest.raises(ValueError, match="prompt 'long' of 90 tokens"):
        next(stream(spec, deque([("long", [5] * 90)]), 2, eos, 1))
    ngram = specgraph.compile(model, NGram(), max_batch=2, max_cache_len=MAX_LENGTH)
    with pytest.raises(TypeError, match="draft=NGram"):
        next(stream(ngram, deque([(0, rows[0])]), 2, eos, 1))
    assert list(stream(spec, deque(), 2, eos, 1)) == []  # nothing queued: nothing to do


def test_the_compiled_step_streams_the_same_answers(target):
    """backend="inductor": the whole step compiled over static buffers (StaticStep), which a refill writes
    in place (the path a GPU runs, there replayed as a CUDA graph)."""
    model, rows, full, eos = target
    spec = specgraph.compile(model, None, backend="inductor", max_batch=4, max_cache_len=MAX_LENGTH)
    got = dict((k, t) for k, t, _ in stream(spec, deque(enumerate(rows)), 4, eos, 2))
    assert got == {i: expected(f, eos) for i, f in enumerate(full)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_graphed_stream_streams_the_same_answers(target):
    """On CUDA: the inductor step replayed as a CUDA graph, the next step launched before the host reads
    the last (``ahead``), refills writing the graph's static buffers in place; fp32, so HF greedy's answers."""
    model, rows, full, eos = target
    cuda_model = tiny_model("llama").cuda()  # the same seed: the same weights as ``model``
    assert all(torch.equal(a.cpu(), b) for a, b in zip(cuda_model.state_dict().values(), model.state_dict().values()))
    spec = specgraph.compile(cuda_model, None, backend="inductor", max_batch=4, max_cache_len=MAX_LENGTH)
    stats = {}
    draft, _ = spec.mode("tree", 4)
    got = {k: t for k, t, _ in stream_generate(spec.capture, draft, deque(enumerate(rows)), 4, MAX_NEW, {eos},
                                                MAX_LENGTH, None, 2, stats)}
    assert got == {i: expected(f, eos) for i, f in enumerate(full)}
    assert stats["refills"] >= 1
