import contextlib
import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=300, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads (by default every
# worker takes them all: on the 2-core CI machine, 2 workers x 2 threads oversubscribe it)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (minutes each on CI's 2 cores; the GPU machine's 16 run them)")


def pytest_collection_modifyitems(config, items):
    skips = []
    if not torch.cuda.is_available():
        skips.append(("gpu", pytest.mark.skip(reason="needs a CUDA device")))
    if not config.getoption("--slow"):
        skips.append(("slow", pytest.mark.skip(reason="slow: run with --slow (the GPU machine runs them)")))
    for item in items:
        for marker, skip in skips:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture
def cuda():
    return torch.device("cuda")


@pytest.fixture(scope="session")
def smollm2_cuda():
    """(SmolLM2-135M-Instruct in fp32 on the GPU, its tokenizer); skips where the GGUF is not loadable."""
    from specgraph.models import load_gguf

    try:
        model, tokenizer = load_gguf(dtype=torch.float32)
    except (FileNotFoundError, ImportError) as err:
        pytest.skip(f"SmolLM2 GGUF not loadable here: {err}")
    return model.cuda().eval(), tokenizer


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """torch.compile with the aot_eager backend wherever specgraph asks for inductor: dynamo's tracing,
    guards and recompiles (fullgraph: no graph break, no host sync) and AOTAutograd's functionalization
    stay the same, inductor's CPU code generation (~20 s a graph on a 2-core CI machine) goes. For tests
    of what dynamo decides (one compile across prompt lengths); inductor itself on the whole step is
    test_generate_backends.py's test_inductor_backend_is_token_exact and the GPU tests."""
    real = torch.compile

    def compile_aot_eager(model=None, **kwargs):
        kwargs.update(backend="aot_eager", mode=None)
        return real(model, **kwargs) if model is not None else real(**kwargs)

    monkeypatch.setattr(torch, "compile", compile_aot_eager)


@pytest.fixture
def settings():
    """``settings(debug=True, ...)``: ``specgraph.config.patch`` for the rest of the test (the
    environment is read once, so tests change settings through the config, never the environment)."""
    from specgraph import config

    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(config.patch(**overrides))


@pytest.fixture(scope="session", autouse=True)
def check_graph_after_every_pass(tmp_path_factory):
    """Every test's captures check the graph invariants after every pass (passes/invariants.py), and
    are captured afresh (tests that patch a pass must see it run; test_capture_cache.py turns the cache on).
    specgraph's cache (step costs, compiled frames, converted models) is this run's own, shared by its xdist
    workers: what an earlier run left in ``~/.cache/specgraph`` (a persisted step cost) changes what runs."""
    from specgraph import config

    base = tmp_path_factory.getbasetemp()
    cache = base.parent / "specgraph-cache" if os.environ.get("PYTEST_XDIST_WORKER") else base / "specgraph-cache"
    before = os.environ.get("SPECGRAPH_CACHE")
    os.environ["SPECGRAPH_CACHE"] = str(cache)  # the same for the processes tests start
    with config.patch(check_graph=True, capture_cache=False, cache=cache):
        yield
    if before is None:
        os.environ.pop("SPECGRAPH_CACHE")
    else:
        os.environ["SPECGRAPH_CACHE"] = before
