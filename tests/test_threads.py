"""Calls from several threads (docs/api.md, "Threads"): SpecModels of one model take turns on its caches, and
after attach a fallback to HF's generate waits for another thread's capture. Oracle: the tiny model's own
``model.generate``."""
import threading
import warnings

import torch

import specgraph
from specgraph.drafts import NGram
from test_capture import tiny_model
from test_generate import hf_greedy, prompts


def test_two_threads_on_one_model_each_get_their_own_tokens():
    """Two SpecModels of one model share its caches: their calls take turns, none corrupts another."""
    model = tiny_model("llama")
    a = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128)
    b = specgraph.compile(model, NGram(), tree=specgraph.Chain(2), max_cache_len=128)
    rows = prompts(11, [5, 9, 7, 12])
    want = [hf_greedy(model, r, max_new_tokens=16, eos_token_id=None) for r in rows]
    got, errors = {}, []

    def work(spec, k):
        try:
            for _ in range(3):
                for i, r in enumerate(rows):
                    got[k, i] = spec.generate(torch.tensor([r]), max_new_tokens=16, eos_token_id=None)[0, len(r):].tolist()
                    assert got[k, i] == want[i]
        except Exception as err:  # reported below: an assert in a thread would be lost
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s, k)) for k, s in enumerate((a, b, a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(got[k, i] == want[i] for k in range(3) for i in range(len(rows)))


def test_attach_falls_back_beside_another_threads_capture():
    """After attach, a call the speculative path cannot take (num_beams=2) runs HF's generate on the
    model's own modules: not while another thread's first call captures them (torch.export swaps fake
    tensors in), so both threads get model.generate's tokens. A new model each round: its first
    speculative call captures."""
    errors = []
    for round_ in range(3):
        model = tiny_model("llama")
        ids = torch.tensor([prompts(40 + round_, [8])[0]])
        want = {beams: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=beams,
                                      do_sample=False, eos_token_id=None) for beams in (1, 2)}
        specgraph.attach(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128)

        def call(beams, model=model, ids=ids, want=want):
            try:
                for _ in range(3):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # the fallback's warning
                        out = model.generate(ids, max_new_tokens=8, num_beams=beams, eos_token_id=None)
                    if not torch.equal(out, want[beams]):
                        errors.append(f"num_beams={beams}: {out.tolist()} != {want[beams].tolist()}")
            except Exception as err:  # reported below: an assert in a thread would be lost
                errors.append(err)

        threads = [threading.Thread(target=call, args=(beams,)) for beams in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        specgraph.detach(model)
    assert not errors, errors
