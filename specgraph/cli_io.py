"""Where the ``specgraph`` command's inputs come from and its outputs go, checked before any work: a target
from a .gguf file, a HF directory or a hub id (one line when it cannot be loaded or reached); an ``--out``
folder that can be written; a training run's identity and how far it got. Nothing here imports torch at
import time: ``--help`` stays fast."""
from __future__ import annotations


def run_identity(model) -> str:
    """A short digest of a target (its config and a strided sample of every weight): a run resumed into the
    same --out must train against the same target."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        digest.update(name.encode() + flat[:: max(1, flat.numel() // 64)].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def hub_reachable(name: str) -> None:
    """A hub id (not a local path) needs the hub: when its host does not even resolve, say so at once
    (transformers would retry for half a minute first). Offline mode and a local cache are left to transformers."""
    import socket
    from pathlib import Path
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if Path(name).exists() or constants.HF_HUB_OFFLINE:
        return
    try:
        if try_to_load_from_cache(name, "config.json") is not None:
            return
    except ValueError:  # not a valid repository id: transformers' own error names it
        return
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"  # (HF_ENDPOINT, as huggingface_hub reads it)
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        raise SystemExit(f"specgraph: the target {name!r} is not a local path, and the hub ({host}) cannot be "
                         f"reached ({err.strerror or err}): download it where there is a network, or pass a local "
                         f"path") from None


def trained_to(out) -> int | None:
    """The last step a training run in ``out`` logged (its history.json), None if none."""
    import json

    try:
        history = json.loads((out / "history.json").read_text())
        return int(history[-1]["step"]) if history else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def writable_dir(path, flag: str):
    """``path`` as a directory that exists and can be written (made if missing), checked before any work."""
    from pathlib import Path

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specgraph-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise SystemExit(f"specgraph: {flag} {str(out)!r} cannot be written ({err.strerror or err}): pass a "
                         f"directory you can write") from None
    return out


def load_target(name: str | None, tokenizer: bool = True):
    """(model, tokenizer) from a .gguf file, a HF directory or hub id; None: the embedded SmolLM2.
    ``tokenizer=False``: the model alone (the tokenizer is None)."""
    from .models import load_gguf

    if name is None or name.endswith(".gguf"):
        model, tokenizer = load_gguf(name)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hub_reachable(name)

        try:
            model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa")
            tokenizer = AutoTokenizer.from_pretrained(name) if tokenizer else None
        except OSError as err:  # offline, no such repository or directory: one line naming the target
            raise SystemExit(f"specgraph: the target {name!r} is not a .gguf file or a model directory here, and "
                             f"transformers could not fetch it as a hub id ({str(err).splitlines()[0][:200]}); "
                             f"download it where there is a network, or pass a local path") from None
        except ValueError as err:  # a directory without a model config, or a tokenizer transformers cannot build
            raise SystemExit(f"specgraph: cannot load the target {name!r}: {str(err).splitlines()[0][:300]}") from None
    model.config._attn_implementation = "sdpa"
    return model, tokenizer
