"""engine.kernels dispatch: backend choice, the AIGW_KERNELS override (read once), lazy triton
import, shape handling."""

import subprocess
import sys

import pytest
import torch

import engine.kernels as kernels
from tests.engine.kernels._util import DEVICE


def test_backend_follows_device_and_the_forced_choice(monkeypatch):
    monkeypatch.setattr(kernels, "FORCED_BACKEND", None)
    assert kernels.kernel_backend("cpu") == "torch"
    assert kernels.kernel_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setattr(kernels, "FORCED_BACKEND", "torch")
    assert kernels.kernel_backend("cuda") == "torch"


def test_aigw_kernels_is_validated_when_read():
    assert kernels.backend_from_env({}) is None
    assert kernels.backend_from_env({"AIGW_KERNELS": "triton"}) == "triton"
    with pytest.raises(ValueError, match="AIGW_KERNELS"):
        kernels.backend_from_env({"AIGW_KERNELS": "cuda"})


def test_aigw_kernels_is_read_once_at_import_not_per_call():
    code = ("import os, torch; os.environ['AIGW_KERNELS'] = 'torch'; import engine.kernels as k;"
            "os.environ['AIGW_KERNELS'] = 'triton'; print(k.kernel_backend('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "torch"


def test_cpu_path_never_imports_triton():
    code = (
        "import sys, torch; import engine.kernels as k;"
        "x = torch.randn(2, 3, 8); k.rms_norm(x, torch.ones(8), 1e-6); k.silu_and_mul(x);"
        "print('triton' in sys.modules)"
    )
    env = {"AIGW_KERNELS": "torch", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_accepts_leading_dims_on_both_backends(backend, monkeypatch):
    monkeypatch.setattr(kernels, "FORCED_BACKEND", backend)
    x = torch.randn(2, 3, 16, device=DEVICE)
    res = torch.randn_like(x)
    w = torch.rand(16, device=DEVICE)
    normed, new_res = kernels.rms_norm(x, w, 1e-6, res)
    assert normed.shape == x.shape and torch.allclose(new_res, x + res, atol=1e-6)
    assert kernels.silu_and_mul(x).shape == (2, 3, 8)
    from engine.kernels.fp8 import quantize_weight_per_channel

    wq, ws = quantize_weight_per_channel(torch.randn(5, 16, device=DEVICE))
    assert kernels.fp8_linear(x, wq, ws).shape == (2, 3, 5)
