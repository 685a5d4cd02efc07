"""build_store, checkpoints and the command line on a device other than the model's
(issue 23, item 4), with the meta device standing in for a GPU."""

from __future__ import annotations

import contextlib
import importlib
import io
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.cli import commands, main
from tracinfunc.grads.transforms import explain_loss_error

build_module = importlib.import_module("tracinfunc.build.torch")
META = torch.device("meta")
SPEC = str(Path(__file__).resolve().parent / "data" / "tiny_spec.py")


class _Stop(Exception):
    pass


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).eval()


@pytest.mark.parametrize("with_buffers", [True, False])
def test_build_store_checks_the_first_batch_with_buffers_on_the_target_device(monkeypatch,
                                                                             with_buffers):
    # A CPU model with BatchNorm and device="cuda" crashed in the first-batch check: its
    # loss kept the module's CPU running statistics.
    model = _batchnorm_model()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model)
    if not with_buffers:  # a checkpoint without buffers: the module's own must move too
        ckpt = tif.Checkpoint(params=dict(ckpt.params))
    seen = {}

    def spy(loss, params, batch, **where):  # where: the call, for error messages
        seen["buffers"] = {value.device for value in loss.buffers.values()}
        seen["params"] = {value.device for value in params.values()}
        seen["batch"] = {leaf.device for leaf in batch}
        raise _Stop

    monkeypatch.setattr(build_module, "_check_loss", spy)
    data = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    with pytest.raises(_Stop):
        tif.build_store(loss, [ckpt], data, projection=tif.Projection(dim=8), device=META,
                        progress=False)
    assert seen == {"buffers": {META}, "params": {META}, "batch": {META}}


def test_a_device_mismatch_is_not_reported_as_train_mode():
    # torch's message names running_mean when a BatchNorm buffer is left on the CPU; it was
    # then misreported as TrainModeError ("put the model in eval mode").
    error = RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        "cuda:0 and cpu! (when checking argument for argument running_mean in method "
        "wrapper_CUDA__native_batch_norm)")
    explained = explain_loss_error(error)
    assert isinstance(explained, tif.errors.LossFunctionError)
    assert not isinstance(explained, tif.errors.TrainModeError)
    assert "one device" in str(explained)


def test_checkpoint_load_maps_to_the_models_device(tmp_path, monkeypatch):
    model = _batchnorm_model()
    path = tmp_path / "w.pt"
    torch.save(model.state_dict(), path)
    seen = []
    real_load = torch.load

    def load(*args, map_location=None, **kwargs):
        seen.append(map_location)
        return real_load(*args, map_location="cpu", **kwargs)

    monkeypatch.setattr(torch, "load", load)
    on_gpu = types.SimpleNamespace(  # what Checkpoint.load asks of a model on the second GPU
        parameters=lambda: iter([_on("cuda:1")]), buffers=lambda: iter([]),
        named_parameters=model.named_parameters, named_buffers=model.named_buffers)
    tif.Checkpoint.load(path, on_gpu)  # a model on the second GPU
    tif.Checkpoint.load(path, model, device=META)
    tif.Checkpoint.load(path, model.to(META))  # shapes only: weights go to real memory
    assert seen == [torch.device("cuda:1"), META, torch.device("cpu")]


def _on(device: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=torch.device(device))


def test_adapter_checkpoint_puts_parameters_on_the_models_device(monkeypatch):
    model = nn.Linear(3, 2)
    saved = {name: value.detach().clone() for name, value in model.named_parameters()}
    assert tif.adapter_checkpoint(saved, model).params["weight"].device.type == "cpu"
    with pytest.raises(tif.errors.InvalidArgumentError, match="meta device"):
        tif.adapter_checkpoint(saved, model, device=META)  # moved there, then refused
    adapters = importlib.import_module("tracinfunc.lm.adapters")
    monkeypatch.setattr(adapters, "module_device", lambda module: META)  # "the model's GPU"
    with pytest.raises(tif.errors.InvalidArgumentError, match="meta device"):
        tif.adapter_checkpoint(saved, model)


def _run(*args: str) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, stderr.getvalue()


def test_cli_build_takes_a_device(monkeypatch, tmp_path):
    seen = []

    def fake_build(*args, device=None, **kwargs):
        seen.append(device)
        raise _Stop

    monkeypatch.setattr(commands, "build_store", fake_build)
    _run("build", "--spec", f"{SPEC}:make", "--out", str(tmp_path / "g.zarr"), "--device",
         "cpu", "--quiet")
    assert seen == [torch.device("cpu")]
    code, stderr = _run("build", "--spec", f"{SPEC}:make", "--out", str(tmp_path / "h.zarr"),
                        "--device", "gpu7")
    assert code == 2 and "expected a torch device" in stderr


@pytest.mark.parametrize("how", ["device=", "the model's device"])
def test_load_recorded_checkpoints_puts_every_tensor_on_the_target_device(tmp_path, monkeypatch,
                                                                         how):
    # Issue 23 item 4: recorded checkpoints were loaded with map_location="cpu" and the
    # frozen parameters taken from the model as they were, so a GPU model got CPU
    # checkpoints (saved and frozen tensors alike).
    model = _batchnorm_model()
    trained = model[-1]  # the rest is frozen: referenced in the manifest, taken from model
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    recorder = tif.training.CheckpointRecorder(tmp_path, model, optimizer, every=1)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    recorder.step()
    recording = importlib.import_module("tracinfunc.training.contents")
    seen = []

    def from_state_dict(state, module, *, lr, name):
        seen.append({key: value.device for key, value in state.items()})
        raise _Stop

    monkeypatch.setattr(recording.Checkpoint, "from_state_dict", from_state_dict)
    if how == "device=":
        load = lambda: tif.load_recorded_checkpoints(tmp_path, model, device=META)  # noqa: E731
    else:
        training = importlib.import_module("tracinfunc.training.recorder")
        monkeypatch.setattr(training, "module_device", lambda module: META)  # "its GPU"
        load = lambda: tif.load_recorded_checkpoints(tmp_path, model)  # noqa: E731
    with pytest.raises(_Stop):
        load()
    frozen = {name for name, _ in model.named_parameters() if not name.startswith("3.")}
    assert frozen <= set(seen[0]) and {"3.weight", "3.bias"} <= set(seen[0])
    assert set(seen[0].values()) == {META}
