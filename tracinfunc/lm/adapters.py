"""LoRA / peft adapters: load a saved adapter file as a checkpoint of the live peft model.

peft's ``save_pretrained`` writes ``adapter_model.safetensors`` with names stripped of the
adapter name (``...lora_A.weight``, not ``...lora_A.default.weight``), while the live model's
parameters are ``base_model.model....lora_A.default.weight``. :func:`adapter_checkpoint` maps
one onto the other, so checkpoints saved during LoRA training become TracIn checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path

import torch
from torch import Tensor, nn

from tracinfunc._devices import module_device
from tracinfunc._shapes import check_loaded_shapes
from tracinfunc._validate import entry_point
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.errors import MissingDependencyError, MissingParametersError

__all__ = ["adapter_checkpoint", "adapter_state_dict"]


def adapter_state_dict(path: str | PathLike) -> dict[str, Tensor]:
    """The tensors of an adapter directory or ``.safetensors``/``.bin`` file, as saved."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "adapter_model.safetensors", path / "adapter_model.bin"]
        path = next((c for c in candidates if c.exists()), candidates[0])
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as error:
            raise MissingDependencyError(
                "adapter_state_dict: reading .safetensors needs the safetensors package; "
                "install it with pip install 'tracinfunc[hf]'."
            ) from error
        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


@entry_point("adapter_checkpoint")
def adapter_checkpoint(
    source: str | PathLike | Mapping[str, Tensor],
    model: nn.Module,
    *,
    adapter_name: str = "default",
    lr: float = 1.0,
    name: str | None = None,
    device: torch.device | str | None = None,
) -> Checkpoint:
    """A checkpoint of ``model``'s trainable adapter parameters from a saved adapter.

    Args:
        source: An adapter directory (``save_pretrained``), its file, or its state dict.
        model: The live peft model (``get_peft_model(base, config)``), whose trainable
            parameters are the adapters.
        adapter_name: The adapter the file holds (peft's default is ``"default"``).
        lr: As for :class:`~tracinfunc.Checkpoint`.
        name: As for :class:`~tracinfunc.Checkpoint`.
        device: Where the parameters go (default: ``model``'s device).

    Returns:
        A :class:`~tracinfunc.Checkpoint` holding exactly the trainable parameters of
        ``model``, under their live names.

    Raises:
        MissingParametersError: the file lacks adapters the model has (another model or
            another adapter configuration).
        InvalidArgumentError: an adapter's shape differs from the model's (another rank).
    """
    saved = adapter_state_dict(source) if not isinstance(source, Mapping) else dict(source)
    live = [key for key, value in model.named_parameters() if value.requires_grad]
    device = module_device(model) if device is None else torch.device(device)
    params, missing = {}, []
    for key in live:
        found = next((saved[c] for c in _saved_names(key, adapter_name) if c in saved), None)
        if found is None:
            missing.append(key)
        else:
            params[key] = found.detach().to(device, copy=True)
    if missing:
        raise MissingParametersError(
            f"adapter_checkpoint: the adapter file lacks {len(missing)} trainable parameters "
            f"of the model, e.g. {missing[:3]}; it has {sorted(saved)[:3]}. Load it into the "
            "peft model it was trained with (same LoraConfig and adapter_name)."
        )
    live_params = dict(model.named_parameters())
    check_loaded_shapes(((key, live_params[key], value) for key, value in params.items()),
                        hint="was the adapter saved with another LoraConfig (rank r, "
                             "target modules)? Load it into the peft model it was trained with.")
    return Checkpoint(params=params, lr=lr, name=name)


def _saved_names(live: str, adapter_name: str) -> list[str]:
    """Names a live parameter may have in an adapter file, most specific first."""
    bare = live.replace(f".{adapter_name}.", ".")
    if bare.endswith(f".{adapter_name}"):  # ParameterDict entries (lora_embedding_A.default)
        bare = bare[: -len(adapter_name) - 1]
    return [live, bare, bare.removeprefix("base_model.model."),
            live.removeprefix("base_model.model.")]
