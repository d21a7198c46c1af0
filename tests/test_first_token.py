"""The first token comes from the prefill (runtime/first_token.py): the prefill writes each whole prompt and
keeps the logits at each row's last token, whatever the rows' lengths against the chunk, and a call streams
its first token before the decode step's bucket is built."""
import pytest
import torch

import specgraph
from specgraph import Chain
from specgraph.capture import Capture
from specgraph.drafts import NGram
from specgraph.passes import HiddenTaps
from specgraph.runtime.generate import PREFILL_NODES, prefill
from test_capture import tiny_model
from test_generate import hf_greedy, prompts


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_keeps_the_last_tokens_logits_and_every_tokens_state(arch):
    """Rows shorter than a chunk, exactly one, and past one or two, in one batch: the kept logits are HF's at each
    row's last token, the final-norm states HF's at every token (float32, the oracle: HF's own forward)."""
    model = tiny_model(arch)
    capture = Capture(model, 256)
    chunk = min([PREFILL_NODES, 256] + [w for w in capture.info.layer_windows if w > 0])
    lengths = [1, 5, chunk, chunk + 6, 2 * chunk + 9]
    rows = prompts(3, lengths)
    filled = prefill(capture, rows, torch.device("cpu"), HiddenTaps(final=True), whole=True)
    assert filled.cache_len.tolist() == lengths and filled.logits.shape[:2] == (len(rows), 1)
    assert filled.features.shape[:2] == (len(rows), max(lengths))
    for r, row in enumerate(rows):
        with torch.no_grad():
            want = model(torch.tensor([row]), output_hidden_states=True)
        torch.testing.assert_close(filled.logits[r, 0], want.logits[0, -1], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(filled.features[r, :len(row)], want.hidden_states[-1][0], atol=2e-4, rtol=2e-4)


def test_prefill_without_the_last_token_writes_one_less_and_keeps_no_logits():
    model = tiny_model("llama")
    rows = prompts(4, [1, 9, 70])
    filled = prefill(Capture(model, 256), rows, torch.device("cpu"))
    assert filled.cache_len.tolist() == [0, 8, 69] and filled.logits is None and filled.features is None


def test_the_first_token_is_streamed_before_a_decode_step_is_built():
    """A one-token call builds no decode step at all; a longer one streams its first token, HF greedy's, while
    none is built yet, then builds the bucket and goes on token-exact."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128)
    row = prompts(5, [12])[0]
    want = hf_greedy(model, row, max_new_tokens=9, eos_token_id=None)

    class Streamer:
        def __init__(self):
            self.tokens, self.steps_built = [], []

        def put(self, tokens):
            self.tokens.append(tokens.reshape(-1).tolist())
            self.steps_built.append(len(spec.capture.decode_steps))

        def end(self):
            pass

    one = spec.generate(torch.tensor([row]), max_new_tokens=1, eos_token_id=None, return_dict_in_generate=True)
    assert one.sequences[0, len(row):].tolist() == want[:1] and not spec.capture.decode_steps
    assert one.accept_lens == [] and one.acceptance.steps == 0 and one.acceptance.tokens == 0
    streamer = Streamer()
    out = spec.generate(torch.tensor([row]), max_new_tokens=9, eos_token_id=None, streamer=streamer,
                        return_dict_in_generate=True)
    assert out.sequences[0, len(row):].tolist() == want
    assert streamer.tokens[1] == want[:1] and streamer.steps_built[1] == 0  # (put 0: the prompt)
    assert len(spec.capture.decode_steps) == 1 and out.acceptance.tokens == 8
    assert out.acceptance.tau == pytest.approx(8 / len(out.accept_lens))


def test_a_call_whose_rows_all_end_at_the_first_token_builds_no_step():
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_batch=2, max_cache_len=128)
    rows = prompts(6, [7, 7])
    firsts = [hf_greedy(model, r, max_new_tokens=1, eos_token_id=None)[0] for r in rows]
    if firsts[0] != firsts[1]:  # eos: row 0's first token; row 1 goes on unless it also starts with it
        rows = [rows[0], rows[0]]
    out = spec.generate(torch.tensor(rows), max_new_tokens=8, eos_token_id=firsts[0], pad_token_id=0)
    assert out[:, 7:].tolist() == [[firsts[0]], [firsts[0]]] and not spec.capture.decode_steps


@pytest.mark.parametrize("policy", ["cost", "measured"])
def test_a_policy_learns_nothing_from_a_call_without_steps(policy):
    """A one-token call runs no step: the policy records nothing (no τ, no time) and the call is HF's."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy=policy)
    row = prompts(7, [10])[0]
    learnt = lambda: repr({k: v for k, v in vars(spec.policy).items() if k != "chosen"})  # noqa: E731 (choices count)
    before = learnt()
    out = spec.generate(torch.tensor([row]), max_new_tokens=1, eos_token_id=None)
    assert out[0, len(row):].tolist() == hf_greedy(model, row, max_new_tokens=1, eos_token_id=None)
    assert learnt() == before
