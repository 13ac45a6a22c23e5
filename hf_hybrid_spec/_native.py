"""Optional C speed-ups, compiled on first use and loaded through ctypes.

The package ships as pure Python (one wheel for every platform). Where a C compiler is present, a module's C source
(shipped beside it) is compiled once into a per-user cache, keyed by the source's hash and the platform, and loaded
with `ctypes.PyDLL`: its functions run holding the GIL, so Python threads see each call as one atomic step. Without
a compiler, or with `HF_HYBRID_SPEC_NATIVE=0`, callers fall back to their Python implementations (same results,
slower); `logging` at INFO says which was taken.

Environment: `HF_HYBRID_SPEC_NATIVE=0` disables the speed-ups; `HF_HYBRID_SPEC_CACHE` moves the cache (default
`$XDG_CACHE_HOME/hf_hybrid_spec` or `~/.cache/hf_hybrid_spec`); `CC` picks the compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """Whether the speed-ups may be used (`HF_HYBRID_SPEC_NATIVE` not set to 0 / false / no / off)."""
    return os.environ.get("HF_HYBRID_SPEC_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dir() -> Path:
    root = os.environ.get("HF_HYBRID_SPEC_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_hybrid_spec"


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    parts = cc.split()
    if parts and shutil.which(parts[0]):
        return parts
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _build(source: Path, target: Path, cc: list[str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a temporary name, then renamed: processes compiling at once each install a whole library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*cc, "-O2", "-std=c99", "-shared", "-fPIC", "-o", tmp, str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path) -> ctypes.CDLL | None:
    """The library built from C file `source` (compiled on first use, then cached), or None where that cannot be
    done (disabled, no compiler, the build failed: logged at INFO). Thread-safe; one attempt per process."""
    key = str(source)
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        lib = None
        if not enabled():
            logger.info("%s: native speed-ups disabled (HF_HYBRID_SPEC_NATIVE=0); using Python", source.name)
        elif sys.platform == "win32":
            logger.info("%s: native speed-ups are built on POSIX systems only; using Python", source.name)
        else:
            lib = _load(source)
        _LOADED[key] = lib
        return lib


def _load(source: Path) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        logger.info("%s: no C compiler found (set CC); using the Python implementation", source.name)
        return None
    text = source.read_bytes()
    tag = hashlib.sha256(text + " ".join(cc).encode() + platform.machine().encode()).hexdigest()[:16]
    target = _cache_dir() / "native" / f"{source.stem}-{tag}.so"
    try:
        if not target.exists():
            try:
                _build(source, target, cc)
            except OSError:  # a cache that cannot be written: build into a temporary folder instead
                target = Path(tempfile.gettempdir()) / f"hf_hybrid_spec-{os.getuid()}" / target.name
                if not target.exists():
                    _build(source, target, cc)
        lib = ctypes.PyDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.info("%s: could not build the native speed-up (%s); using the Python implementation", source.name,
                    error)
        return None
    logger.debug("%s: native speed-up loaded from %s", source.name, target)
    return lib
