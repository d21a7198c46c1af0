"""Share of the target's greedy MT-bench answer tokens inside the shipped EAGLE-3 head's draft vocabulary
(a token outside it can never be drafted, so this caps acceptance at every depth).

    python3 benchmarks/draft_vocab_coverage.py        # CPU is fine: 16 questions x 128 greedy tokens, ~3 min
"""
import torch
from tqdm import tqdm
from specgraph.models import load_gguf, load_default_draft
from specgraph.train.evaluate import mt_bench_questions
model, tok = load_gguf()
draft = load_default_draft()
t2d = draft.t2d
inside = total = 0
for q in tqdm(mt_bench_questions(16), desc="questions"):
    ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=True, add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)[0, ids.shape[1]:]
    inside += int(t2d[out].sum())
    total += out.numel()
print(f"{inside}/{total} = {inside/total:.4f} of greedy answer tokens are in the draft vocabulary (16 questions x <=128 tokens)")
