"""Reading and writing draft checkpoints: state dicts from safetensors / torch files, config.json."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import CheckpointError


def read_checkpoint(path: str | Path, weight_files: tuple[str, ...], what: str) -> tuple[dict, dict]:
    """(state dict, config dict) of a checkpoint directory (or one weight file).

    Reads the first of ``weight_files`` present plus any ``model-*.safetensors``
    shards; config.json next to the weights (empty dict when absent).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r}: a {what} checkpoint directory, weight file or hub id (a str or Path)")
    path = Path(path)
    if not path.exists():
        path = _from_hub(str(path), what)
    files = [path] if path.is_file() else [path / f for f in weight_files if (path / f).is_file()][:1]
    if not path.is_file():
        files += sorted(path.glob("model-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no {what} weights (looked for {', '.join(weight_files)}, model-*.safetensors)")
    state = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state.update(load_file(str(file)))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as err:  # a truncated or corrupted file: say which
            raise unreadable(file, what, err) from err
    config_file = (path if path.is_dir() else path.parent) / "config.json"
    return state, read_config(config_file) if config_file.is_file() else {}


def unreadable(file, what: str, err: Exception) -> CheckpointError:
    """The error for a weights file that cannot be read (truncated, corrupted, not a weights file)."""
    return CheckpointError(f"{file}: cannot read {what} weights ({type(err).__name__}: {err}); the file is "
                           f"damaged or not a weights file: download or save it again")


def read_config(config_file: Path) -> dict:
    """A config.json as a dict; one that is not a JSON object is refused, naming the file."""
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: a JSON object of settings expected, not a {type(config).__name__}")
    return config


INT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "draft_vocab_size", "target_hidden_size", "head_dim")


def check_fields(config: dict, path, required: tuple[str, ...] = ("hidden_size",)) -> None:
    """The config's sizes and EAGLE-3 aux layer ids as integers, each bad one named with its file (a head's shapes
    come from them: a missing ``hidden_size`` would silently be LlamaConfig's 4096; a string one fails deep in
    transformers)."""
    bad = [f"{k}={config[k]!r}" for k in INT_FIELDS if config.get(k) is not None and
           (isinstance(config[k], bool) or not isinstance(config[k], int))]
    nested = config.get("eagle_config")
    for key, ids in (("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")),
                     ("eagle_config.eagle_aux_hidden_state_layer_ids",
                      nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None)):
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            bad.append(f"{key}={ids!r}")
    if nested is not None and not isinstance(nested, dict):
        bad.append(f"eagle_config={nested!r} (an object)")
    missing = [f"{k} missing" for k in required if k not in config]
    if bad or missing:
        ids = " (aux layer ids a list of integers)" if any(x.startswith("eagle") for x in bad) else ""
        raise CheckpointError(f"{path}/config.json: {', '.join(bad + missing)}: sizes are whole numbers{ids}")


def _from_hub(name: str, what: str) -> Path:
    """A hub id ("org/name") -> its local snapshot (config and weights only), through huggingface_hub."""
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "~")):
        raise FileNotFoundError(f"{what} checkpoint {name!r} does not exist (a local directory or file, or a hub "
                                f"id like 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as err:  # offline, unknown repository, no access: one clear message
        raise FileNotFoundError(f"{what} checkpoint {name!r}: not a local path, and the hub id could not be fetched "
                                f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); download it where "
                                f"there is a network, or pass the local directory") from err


def write_checkpoint(path: str | Path, state: dict, config: dict, weights: str = "model.safetensors",
                     dtype: torch.dtype | None = None, max_shard_bytes: int | None = None) -> None:
    """Safetensors (a torch file when ``weights`` ends in .pt / .bin) + config.json. ``dtype`` casts floating tensors (e.g. bf16 to ship a head);
    ``max_shard_bytes`` splits the weights into ``model-0000i-of-0000n.safetensors`` shards with
    transformers' ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r}: a floating torch dtype the weights are cast to, e.g. torch.bfloat16")
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool)
                                        or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: a whole number of bytes >= 1 (None: one file)")
    tensors = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
               for k, v in state.items()}
    shards: list[dict] = [{}]
    for key, value in tensors.items():
        size = value.numel() * value.element_size()
        if max_shard_bytes and shards[-1] and sum(t.numel() * t.element_size() for t in shards[-1].values()) + size \
                > max_shard_bytes:
            shards.append({})
        shards[-1][key] = value
    if weights.endswith((".pt", ".bin")):  # a torch state dict (FasterDecoding's medusa_lm_head.pt): one file
        if len(shards) > 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes}: {weights} is one torch file; shards are safetensors")
        torch.save(shards[0], path / weights)
    elif len(shards) == 1:
        save_file(shards[0], str(path / weights))
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name))
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_config(make, file):
    """``make()`` (a transformers config built from a config.json's fields); a value transformers refuses is
    named with ``file``."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return make()
    except (StrictDataclassError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: {type(err).__name__}: {' '.join(str(err).split())[:300]}") from err


def llama_config(fields: dict, path):
    """A head's ``LlamaConfig`` from its config.json fields; a value transformers refuses is named with the file."""
    from transformers import LlamaConfig

    return build_config(lambda: LlamaConfig(**fields), f"{path}/config.json")


def check_keys(state: dict, module_state: dict, optional: set[str], what: str, path) -> None:
    """Every weight the module needs is in ``state`` with its shape; nothing unknown is left over."""
    problems = []
    missing = sorted(k for k in module_state if k not in state and k not in optional)
    if missing:
        problems.append(f"missing weights {missing} (never randomly initialised)")
    unknown = sorted(k for k in state if k not in module_state)
    if unknown:
        problems.append(f"unexpected weights {unknown[:8]}{' …' if len(unknown) > 8 else ''} (a different layout "
                        f"or variant?)")
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} != expected {tuple(v.shape)}"
              for k, v in module_state.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    problems += shapes
    if problems:
        raise CheckpointError(f"{path}: not a loadable {what} checkpoint: " + "; ".join(problems))
