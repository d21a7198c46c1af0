"""How much of a cold process's first token is Triton compiling specgraph's kernels, and how much threads would save.

    python3 benchmarks/investigations/triton_cold_compile.py [--threads 16] [--out FILE.json]

One new process with empty inductor, Triton and specgraph caches (cold), the default draft and tree on CUDA with
``backend="cudagraphs"``: the uncompiled step a fast start serves its first calls with, without the background
compile beside it (so every kernel before the first token is one of specgraph's own Triton kernels or an aten
one, and nothing else compiles while the sources are compiled again). It times each Triton JIT compile before the first token
(``JITFunction._do_compile``), then compiles the same sources again into two fresh Triton caches: one after
another, and on a pool of ``--threads`` threads (Triton's ``AsyncCompileMode``). LLVM's code generation and
ptxas run without the GIL, the MLIR passes and LLVM's optimizer with it, so the pool's gain is measured, not
assumed. Prints one JSON object (per-kernel compile seconds; serial and threaded totals).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
start = time.time()
threads = int(sys.argv[1])
import torch
import specgraph
from specgraph.models import load_default_draft, load_gguf
from specgraph.train.evaluate import prompt_set
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

compiles = []  # (kernel name, seconds, the compile's inputs to replay)
do_compile = JITFunction._do_compile


def timed(self, *args):  # (key, signature, device, constexprs, options, attrs, warmup) in triton 3.6 and 3.7
    begin = time.perf_counter()
    kernel = do_compile(self, *args)
    _, signature, device, constexprs, options, attrs = args[:6]
    target = next(x for x in self.device_caches[device] if type(x).__name__ == "GPUTarget")
    compiles.append((self.fn.__name__, time.perf_counter() - begin,
                     (self.ASTSource(self, signature, constexprs, attrs), target, options.__dict__)))
    return kernel


JITFunction._do_compile = timed
imported = time.time() - start
model, tok = load_gguf()
model = model.to("cuda", torch.bfloat16)
row = tok(tok.apply_chat_template([{"role": "user", "content": prompt_set("mt-bench", 1)[0]["turns"][0]}],
                                  tokenize=False, add_generation_prompt=True)).input_ids
loaded = time.time() - start
with specgraph.config.patch(cache=sys.argv[2]):  # the captures' own folder: cold
    # the step a fast start serves before inductor is done: recorded uncompiled, no background compile beside it
    spec = specgraph.compile(model, load_default_draft(), backend="cudagraphs")
    spec.generate(torch.tensor([row], device="cuda"), max_new_tokens=1)
torch.cuda.synchronize()
first_token = time.time() - start
JITFunction._do_compile = do_compile
sources = [c[2] for c in compiles]


def recompile(parallel: bool) -> float:
    # a fresh cache folder: every source compiles again, nothing is read from disk
    knobs.cache.dir = tempfile.mkdtemp(prefix="triton-again-")
    begin = time.perf_counter()
    if parallel:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda s: triton.compile(s[0], target=s[1], options=s[2]), sources))
    else:
        for src, target, options in sources:
            triton.compile(src, target=target, options=options)
    return time.perf_counter() - begin


serial = recompile(False)
threaded = recompile(True)
print(json.dumps({"import_s": imported, "load_s": loaded - imported, "first_token_s": first_token,
                  "compiles": [[name, round(s, 4)] for name, s, _ in compiles],
                  "compile_s": sum(s for _, s, _ in compiles), "serial_again_s": serial,
                  "threaded_again_s": threaded, "threads": threads}), flush=True)
import os
os._exit(0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.threads), f"{cache}/specgraph"], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    by_kernel: dict[str, list[float]] = {}
    for name, seconds in result["compiles"]:
        by_kernel.setdefault(name, []).append(seconds)
    print(f"first token {result['first_token_s']:.1f} s (import {result['import_s']:.1f}, load {result['load_s']:.1f}); "
          f"{len(result['compiles'])} Triton compiles, {result['compile_s']:.1f} s")
    for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:40s} {len(times):3d} compiles {sum(times):6.2f} s")
    print(f"the same sources again: {result['serial_again_s']:.1f} s one after another, "
          f"{result['threaded_again_s']:.1f} s on {result['threads']} threads")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
