"""Checkpoints that survive a crash: atomic writes, RNG states, clear errors on bad files.

A checkpoint is a plain dict (nanoGPT style) saved with ``torch.save``:

    {"format": "bayesify-checkpoint", "version": 1, "model": ..., "optimizer": ..., "scheduler": ...,
     "scaler": ..., "step": ..., "epoch": ..., "batch": ..., "config": {...}, "rng": {...}}

:func:`save_checkpoint` writes it to a temporary file in the same directory, flushes and
``fsync``s it, then ``os.replace``s it over the old one (atomic on POSIX and Windows) and
``fsync``s the directory: a crash or a kill at any moment leaves either the old or the new
checkpoint, never a torn one. :func:`load_checkpoint` loads with ``weights_only=True`` (no
arbitrary code from the file), so everything in it is tensors and Python builtins; RNG states
are stored in that form by :func:`rng_state`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointError", "load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state"]

FORMAT = "bayesify-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or not a bayesify checkpoint."""


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Atomically write ``state`` to ``path`` (temp file in the same dir, fsync, ``os.replace``).

    The previous file at ``path``, if any, stays intact until the new one is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "version": VERSION, **state}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write never replaces the last good checkpoint
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    # make the rename itself durable (POSIX); not possible (nor needed) on Windows
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointError: the file is missing, truncated / corrupt, or not a bayesify checkpoint;
            the message names the file and what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"no checkpoint at {path}; train first (bayesify train ... --out {path.parent}), "
            "or point --out at the directory of an earlier run."
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # zip / unpickling errors of a torn or foreign file
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
            "it was left as it is. Restore it from a copy, or start a new run in another --out directory."
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a bayesify checkpoint (no format={FORMAT!r} entry); it was left as it is. "
            "Point --out at a directory written by bayesify train."
        )
    if state.get("version", 0) > VERSION:
        raise CheckpointError(
            f"checkpoint {path} has version {state['version']}, newer than this bayesify understands ({VERSION}); "
            "upgrade bayesify."
        )
    return state


def rng_state() -> dict[str, Any]:
    """The states of torch (CPU and every CUDA device), numpy and Python's ``random``.

    Stored as tensors and builtins only, so :func:`load_checkpoint` can use ``weights_only``.
    """
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    xla = _xla_rng()
    if xla is not None:
        state["xla"] = int(xla.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (missing devices are skipped)."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)
    if "xla" in state:
        xla = _xla_rng()
        if xla is not None:
            xla.set_rng_state(state["xla"])


def _xla_rng() -> Any:
    # torch_xla's model module, only if the run already imported it (never import it here)
    import sys

    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.core.xla_model as xm

    return xm
