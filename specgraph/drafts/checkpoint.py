"""Reading and writing draft checkpoints: state dicts from safetensors / torch files, config.json."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def read_checkpoint(path: str | Path, weight_files: tuple[str, ...], what: str) -> tuple[dict, dict]:
    """(state dict, config dict) of a checkpoint directory (or one weight file).

    Reads the first of ``weight_files`` present plus any ``model-*.safetensors``
    shards; config.json next to the weights (empty dict when absent).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} checkpoint {str(path)!r} does not exist")
    files = [path] if path.is_file() else [path / f for f in weight_files if (path / f).is_file()][:1]
    if not path.is_file():
        files += sorted(path.glob("model-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no {what} weights (looked for {', '.join(weight_files)}, model-*.safetensors)")
    state = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    config_file = (path if path.is_dir() else path.parent) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return state, config


def write_checkpoint(path: str | Path, state: dict, config: dict, weights: str = "model.safetensors") -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / weights))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


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
        raise ValueError(f"{path}: not a loadable {what} checkpoint: " + "; ".join(problems))
