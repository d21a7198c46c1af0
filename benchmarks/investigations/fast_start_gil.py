"""How fast a fresh process's first calls run while the fast start compiles beside them, per switch interval.

    python3 benchmarks/investigations/fast_start_gil.py INTERVAL_S[:plain] [INTERVAL_S[:plain] ...]

Each interval in a new process with empty inductor, Triton and specgraph caches (cold): compile the default
configuration (``:plain``: plain decoding), one token, then 10 MT-bench calls of 256 tokens timed together
while the worker compiles (``fast_start.SWITCH_INTERVAL_S`` set to the interval). Prints one JSON line a process.
"""
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, os, torch, json
import specgraph
from specgraph.runtime import fast_start
from specgraph.models import load_default_draft, load_gguf
from specgraph.train.evaluate import prompt_set
fast_start.SWITCH_INTERVAL_S = float(sys.argv[1])
model, tok = load_gguf()
model = model.to("cuda", torch.bfloat16)
rows = [tok(tok.apply_chat_template([{"role": "user", "content": p["turns"][0]}], tokenize=False,
            add_generation_prompt=True)).input_ids for p in prompt_set("mt-bench", 11)]
spec = specgraph.compile(model, None if sys.argv[2] == "plain" else load_default_draft())
spec.generate(torch.tensor([rows[0]], device="cuda"), max_new_tokens=1)
begin, tokens = time.perf_counter(), 0
for row in rows[1:]:
    out = spec.generate(torch.tensor([row], device="cuda"), max_new_tokens=256)
    tokens += out.shape[1] - len(row)
torch.cuda.synchronize()
print(json.dumps({"interval": float(sys.argv[1]), "draft": sys.argv[2], "tok_s": tokens / (time.perf_counter() - begin),
                  "compiled": bool(spec.fast_start.ready)}), flush=True)
os._exit(0)
"""

for arg in sys.argv[1:]:
    interval, _, draft = arg.partition(":")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton",
                   SPECGRAPH_CACHE=f"{cache}/specgraph")
        out = subprocess.run([sys.executable, "-c", CHILD, interval, draft or "default"], env=env,
                             capture_output=True, text=True)
        print([line for line in out.stdout.splitlines() if line.startswith("{")] or out.stderr[-2000:], flush=True)
