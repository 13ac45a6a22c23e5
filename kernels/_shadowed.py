"""When this folder is imported as the top-level package `kernels` (the repository root on the path), hand the name
over to Hugging Face's `kernels` library, which transformers (5.25 on) imports where it is installed; the ops here are
`hf_hybrid_spec.kernels`, from the installed package."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over() -> bool:
    """Load the `kernels` found on the path without the repository root into `sys.modules["kernels"]`, which the
    import in progress then returns; False (nothing changed) where there is none."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return False
    shadow = sys.modules.get("kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules["kernels"] = shadow
        raise
    return True
