"""The fused kernels run here on CPU tensors, in Triton's interpreter: ``TRITON_INTERPRET=1`` must be set when
``bayesify.kernels.scale`` defines them (``triton.jit`` chooses the interpreter at definition), so the fixture
imports a fresh copy of that module under the variable and removes it afterwards (a later import, on a GPU,
compiles them); the CPU is let into the devices the dispatch accepts for the fixture's tests only."""

from __future__ import annotations

import sys

import pytest

from bayesify import kernels

_MODULE = "bayesify.kernels.scale"


@pytest.fixture
def interpreted():
    pytest.importorskip("triton")
    saved = sys.modules.pop(_MODULE, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv(kernels.SWITCH, "1")  # off by default (see bayesify/kernels): these tests are about the kernels
        mp.setattr(kernels, "_DEVICES", {"cuda", "cpu"})
        kernels._triton.cache_clear()
        import bayesify.kernels.scale as scale

        assert type(scale._scale_shift_fwd).__name__ == "InterpretedFunction"
        try:
            yield scale
        finally:
            sys.modules.pop(_MODULE, None)
            if saved is not None:
                sys.modules[_MODULE] = saved
                kernels.scale = saved
            else:
                del kernels.scale
            kernels._triton.cache_clear()
