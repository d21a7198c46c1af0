"""Time to first token in a fresh process, cold and warm (issue: a fast start).

    python3 benchmarks/first_token.py [--tiny] [--device cuda|cpu] [--backend auto] [--runs 2] [--warmup]
                                      [--fast-start on|off] [--out FILE.json]

Each run is a new Python process that imports specgraph, loads the target (the embedded SmolLM2 in bf16
on CUDA, in fp32 on the CPU with ``--device cpu``, or with ``--tiny`` a 4-layer random Llama on the CPU), compiles it with the default draft and
settings (``specgraph.compile(model, load_default_draft())``: backend "auto"; NGram with ``--tiny``)
and generates one token of an MT-bench prompt; it reports the seconds from process start to that token
(when a streamer gets it) and to the call's return (a fast start records the call's graphs before it returns),
how much of it the captures took (torch.export and the passes, per bucket), and how many of inductor's
FX-graph and AOTAutograd cache lookups hit, how many buckets came from specgraph's capture cache
(capture_cache.py) and how many compiled frames from its compiled-frame cache (compiled_cache.py). The
first run uses empty inductor, Triton and specgraph cache folders (cold); the later ones reuse them (warm: what a second process on the same machine sees). ``--warmup`` adds ``spec.warmup()`` before the first call (the time moves, it does not vanish).
``--calls N`` (with ``--plain`` for plain decoding, the baseline): after the first token, N calls of
``--max-new-tokens`` on the next MT-bench prompts, timed together (what a fresh process's first calls give),
then the same N once everything is compiled (its steady state).
``--profile FILE``: a cProfile of the cold run's ``compile`` and first token (cumulative and own time) in FILE.
``--fast-start on|off``: ``compile(..., fast_start=True/False)``; by default compile's own (on with backend
"auto" on CUDA: the first calls uncompiled while inductor compiles in the background). With a fast start the
process also reports when the background compile finished and its first compiled token.
``--bytecode kept``: the processes read Python's bytecode from a folder of the run's (``PYTHONPYCACHEPREFIX``,
``PYTHONDONTWRITEBYTECODE`` unset), which an import-only process writes first, as ``pip install`` does; by default
(``as-is``) they inherit this environment's setting (an image that keeps no bytecode compiles each module's
source in every process).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, logging, sys, time
start = float(sys.argv[1]); tiny = sys.argv[2] == "1"; warm = sys.argv[3] == "1"; backend = sys.argv[4]
capture_dir, device, fast = sys.argv[5], sys.argv[6], {"on": True, "off": False}.get(sys.argv[7])
calls, new_tokens, plain = int(sys.argv[8]), int(sys.argv[9]), sys.argv[10] == "1"
profile_to = sys.argv[11]  # "": no profile; else where the cold run's profile of compile + first token goes
import torch
import specgraph
from torch._dynamo.utils import counters
captures = []  # seconds of each bucket's capture (torch.export and the passes), from specgraph's log
loaded = []  # the same for buckets loaded from specgraph's capture cache (capture_cache.py)
refused = []  # the compiled-frame cache's warnings (a frame not compiled ahead of time, not kept, unreadable)
frames = []  # seconds of each compiled frame loaded from specgraph's compiled-frame cache (compiled_cache.py)
class Captured(logging.Handler):
    def emit(self, record):
        if record.name == "specgraph.compiled_cache":
            if "loaded from the compiled-frame cache" in record.msg:
                frames.append(record.args[-1])
            elif record.levelno >= logging.WARNING:  # a frame not kept or not loaded: say why
                refused.append(record.getMessage()[:600])
        elif record.msg.endswith(" in %.1f s"):
            (loaded if record.args[0].startswith("loaded") else captures).append(record.args[1])
for name in ("specgraph.capture", "specgraph.compiled_cache"):
    logging.getLogger(name).addHandler(Captured())
    logging.getLogger(name).setLevel(logging.INFO)
marks = {"import": time.time() - start}
if tiny:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model, draft = transformers.LlamaForCausalLM(config).eval(), specgraph.drafts.NGram()
    rows = [[(i + j % 4) % 500 + 1 for j in range(32)] for i in range(calls + 1)]
else:
    from specgraph.models import load_default_draft, load_gguf
    from specgraph.train.evaluate import prompt_set
    model, tok = load_gguf()
    model = model.to("cuda", torch.bfloat16) if device == "cuda" else model  # the CPU: fp32, as loaded
    draft = load_default_draft()
    rows = [tok(tok.apply_chat_template([{"role": "user", "content": p["turns"][0]}], tokenize=False,
                                        add_generation_prompt=True)).input_ids for p in prompt_set("mt-bench", calls + 1)]
ids, device = [rows[0]], next(model.parameters()).device
draft = None if plain else draft


def timed_calls():
    # the next `calls` prompts, `new_tokens` each (to eos): seconds, tokens, compiled at the call's start
    done = []
    for row in rows[1:]:
        compiled = spec.fast_start is None or bool(spec.fast_start.ready)
        begin = time.perf_counter()
        out = spec.generate(torch.tensor([row], device=device), max_new_tokens=new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        done.append({"s": time.perf_counter() - begin, "tokens": out.shape[1] - len(row), "compiled": compiled})
    return done


marks["load"] = time.time() - start
with specgraph.config.patch(cache=capture_dir):  # the captures' own folder: cold in the first run
    if profile_to:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    spec = specgraph.compile(model, draft, backend=backend, fast_start=fast)
    if warm:
        spec.warmup()
    marks["compile"] = time.time() - start
    class FirstStreamed:  # a streamer: when the first generated token reached it (the prompt comes first)
        def __init__(self):
            self.puts = 0
        def put(self, tokens):
            self.puts += 1
            if self.puts == 2:
                marks["first_token"] = time.time() - start
        def end(self):
            pass
    out = spec.generate(torch.tensor(ids, device=device), max_new_tokens=1, streamer=FirstStreamed())
    marks["first_call"] = time.time() - start  # what follows the token in the call (a fast start records graphs)
    if profile_to:
        import io, pstats
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        open(profile_to, "w").write(text.getvalue())
    first_calls = timed_calls()
    if spec.fast_start is not None:  # the background compile: when it was done, and the first token of a compiled call
        spec.wait_compiled()
        marks["compiled"] = time.time() - start
        spec.generate(torch.tensor(ids, device=device), max_new_tokens=1)
        marks["compiled_token"] = time.time() - start
    steady_calls = timed_calls()  # compiled (after the first calls' compile, or the background one)
print(json.dumps({"marks": marks, "backend": spec.config.backend, "tree": str(spec.config.tree),
                  "capture_s": captures, "capture_loaded_s": loaded, "frames_loaded_s": frames,
                  "frames_refused": refused, "first_calls": first_calls, "steady_calls": steady_calls,
                  "dont_write_bytecode": sys.flags.dont_write_bytecode,
                  "inductor": dict(counters["inductor"]),
                  "aot_autograd": dict(counters["aot_autograd"])}))
"""


def child_env(cache: str, bytecode: str) -> dict:
    """The processes' environment: inductor's and Triton's kernel caches under the run's folder (the first
    process starts from nothing); with ``bytecode="kept"`` Python's bytecode under it too, written and read."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=str(Path(cache) / "triton"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          os.environ.get("PYTHONPATH")])))
    if bytecode == "kept":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(cache) / "pycache")
    return env


def write_bytecode(cache: str) -> float:
    """What ``pip install`` leaves: the imports' bytecode, written by a process that only imports. Seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama, specgraph"],
                   env=child_env(cache, "kept"), check=True)
    return time.perf_counter() - start


def run_once(cache: str, tiny: bool, warmup: bool, backend: str, device: str, fast_start: str = "default",
             calls: int = 0, new_tokens: int = 256, plain: bool = False, profile: Path | None = None,
             bytecode: str = "as-is") -> dict:
    env = child_env(cache, bytecode)
    done = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), str(int(tiny)), str(int(warmup)), backend,
                           str(Path(cache) / "specgraph"), device, fast_start, str(calls), str(new_tokens),
                           str(int(plain)), str(profile or "")],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU (checks the script)")
    parser.add_argument("--runs", type=int, default=2, help="processes: the first cold, the rest warm")
    parser.add_argument("--warmup", action="store_true", help="call spec.warmup() before the first generate")
    parser.add_argument("--backend", default="auto", choices=["auto", "eager", "inductor", "cudagraphs"],
                        help="compile's backend (auto, the default: inductor on CUDA, eager on the CPU)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="where SmolLM2 runs: cuda (bf16, the default) or cpu (fp32); --tiny is always the CPU")
    parser.add_argument("--fast-start", default="default", choices=["default", "on", "off"],
                        help="compile(..., fast_start=True/False): uncompiled calls while inductor compiles in the "
                             "background (default: compile's own, on with backend auto on CUDA)")
    parser.add_argument("--calls", type=int, default=0,
                        help="after the first token, N generate calls on the next MT-bench prompts (timed together), "
                             "then the same N again once compiled")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per call of --calls")
    parser.add_argument("--plain", action="store_true", help="compile(model, None): plain decoding, the baseline")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write a cProfile of the cold run's compile and first token to this text file")
    parser.add_argument("--bytecode", default="as-is", choices=["as-is", "kept"],
                        help="kept: Python's bytecode written first (as pip install does) and read by every process; "
                             "as-is: this environment's setting")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        if args.bytecode == "kept":
            print(f"bytecode written in {write_bytecode(cache):.1f} s (an import-only process)", flush=True)
        for i in range(args.runs):
            r = run_once(cache, args.tiny, args.warmup, args.backend, args.device, args.fast_start, args.calls,
                         args.max_new_tokens, args.plain, args.profile if i == 0 else None, args.bytecode)
            r["run"] = "cold" if i == 0 else "warm"
            # inductor's autotuning results kept for the next process (a warm run that benchmarks again missed them)
            r["autotune_results_kept"] = sum(1 for _ in Path(cache).rglob("*.best_config"))
            rows.append(r)
            m = r["marks"]
            hits = r["inductor"].get("fxgraph_cache_hit", 0)
            misses = r["inductor"].get("fxgraph_cache_miss", 0)
            print(f"{r['run']:>5} ({r['backend']}): first token {m['first_token']:6.1f} s, the call back at "
                  f"{m.get('first_call', m['first_token']):.1f} s  (import {m['import']:.1f}, "
                  f"load {m['load'] - m['import']:.1f}, compile {m['compile'] - m['load']:.1f}, generate "
                  f"{m['first_token'] - m['compile']:.1f}; captures {sum(r['capture_s']):.1f}, "
                  f"{len(r['capture_loaded_s'])} loaded in {sum(r['capture_loaded_s']):.1f}; compiled frames: "
                  f"{len(r['frames_loaded_s'])} loaded in {sum(r['frames_loaded_s']):.1f}); FX-graph cache "
                  f"{hits} hits / {misses} misses; {r['tree']}", flush=True)
            if "compiled" in m:
                print(f"       background compile done at {m['compiled']:.1f} s, a compiled token at "
                      f"{m['compiled_token']:.1f} s", flush=True)
            for name in ("first_calls", "steady_calls") if args.calls else ():
                done = r[name]
                r[name + "_tok_s"] = sum(c["tokens"] for c in done) / sum(c["s"] for c in done)
                print(f"       {name.replace('_', ' ')}: {len(done)} calls, {r[name + '_tok_s']:.1f} tok/s "
                      f"({sum(c['compiled'] for c in done)} began compiled)", flush=True)
            for line in r["frames_refused"]:
                print(f"       compiled-frame cache: {line}", flush=True)
    if args.out:
        import torch

        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
        commit = git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "-uno") else "")
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__,
                                        "command": "python3 benchmarks/first_token.py " + " ".join(sys.argv[1:]),
                                        "device": args.device, "bytecode": args.bytecode, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
