"""Build, cache and register the plan-verification graph pass (kernels/cpu/verify_pass.cc).

MindSpore 2.10 loads C++ graph passes with ``mindspore.graph.register_custom_pass(pass_name,
plugin_so_path, device, pass_type)`` (experimental API; its signature changed between 2.8 and
2.9). The plugin is compiled against the headers the wheel ships (``mindspore/include``) and
linked with ``mindspore_core``, ``mindspore_common`` and ``mindspore_backend_common``; it needs
``-D_GLIBCXX_USE_CXX11_ABI=0 -DENABLE_FAST_HASH_TABLE=1`` (without the hash-table define the link
fails on ``Primitive::Primitive``). A build takes ~15-40 s on 2 cores; the library is cached with
the aot kernels (``ms_efficient.moe.kernels.build_kernel_library``: ``$MS_EFFICIENT_KERNEL_CACHE``
or ``~/.cache/ms_efficient/kernels``) under a name hashing the source, the flags and the
MindSpore version, so later processes load it at once.

A registered pass stays registered for the process and runs on every compile (``@jit``
functions included); MindSpore has no unregister. So :func:`ensure_registered` registers once
per process, and the pass writes a record only while ``MS_EFFICIENT_VERIFY_RECORD`` names a
file (:func:`recording`); other compiles pay one ``getenv``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["PASS_NAME", "RECORD_ENV", "PLUGIN_SOURCE", "VerifyUnavailable", "plugin_flags",
           "build_plugin", "ensure_registered", "verify_available", "recording"]

logger = logging.getLogger(__name__)

PASS_NAME = "ms_efficient_verify"              # the name the plugin's CreatePass answers to
RECORD_ENV = "MS_EFFICIENT_VERIFY_RECORD"      # file the pass writes its record to
PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "verify_pass.cc"
_INCLUDE_DIRS = ("", "mindspore/core/include", "mindspore/ccsrc", "mindspore/ops/include",
                 "mindspore/ops", "third_party", "third_party/robin_hood_hashing")
_LIBS = ("mindspore_core", "mindspore_common", "mindspore_backend_common")


class VerifyUnavailable(RuntimeError):
    """The verification pass cannot run here (no C++ compiler, no MindSpore headers, a failed
    build or a refused registration); the message says which and what to install."""


def plugin_flags() -> tuple:
    """(compile flags, link flags) for the plugin against the installed MindSpore wheel.
    The MindSpore version is a define, so the cached library is per version."""
    import mindspore

    root = Path(mindspore.__file__).resolve().parent
    include = root / "include"
    if not (include / "mindspore" / "include" / "custom_pass_api.h").is_file():
        raise VerifyUnavailable(f"MindSpore {mindspore.__version__} at {root} ships no "
                                f"custom-pass headers (include/mindspore/include/"
                                f"custom_pass_api.h); the verification pass needs MindSpore "
                                f">= 2.9.")
    compile_flags = ("-D_GLIBCXX_USE_CXX11_ABI=0", "-DENABLE_FAST_HASH_TABLE=1",
                     f'-DMS_EFFICIENT_MINDSPORE_VERSION="{mindspore.__version__}"',
                     *(f"-I{include / d}" if d else f"-I{include}" for d in _INCLUDE_DIRS))
    link_flags = (f"-L{root / 'lib'}", *(f"-l{lib}" for lib in _LIBS),
                  f"-Wl,-rpath,{root / 'lib'}", "-Wl,--no-undefined")
    return compile_flags, link_flags


def build_plugin(cache_dir: Optional[str] = None, compiler: str = "g++") -> str:
    """Path of the built plugin .so (built on first use, then cached; see module docs).
    Raises VerifyUnavailable when there is no compiler or the build fails."""
    from ms_efficient.moe.kernels import KernelBuildError, build_kernel_library

    compile_flags, link_flags = plugin_flags()
    try:
        return build_kernel_library(PLUGIN_SOURCE, cache_dir=cache_dir, compiler=compiler,
                                    compile_flags=compile_flags, link_flags=link_flags)
    except KernelBuildError as err:
        raise VerifyUnavailable(f"the plan-verification pass could not be built: {err}") from err


def verify_available(compiler: str = "g++") -> bool:
    """True when the pass can be built here (a C++ compiler on PATH and MindSpore's headers)
    or is registered already. Never builds."""
    if ensure_registered.cache_info().currsize:
        return True
    try:
        plugin_flags()
    except VerifyUnavailable:
        return False
    return shutil.which(compiler) is not None


@functools.lru_cache(maxsize=None)
def ensure_registered() -> str:
    """Build (or load from the cache) and register the pass once per process, for every
    device (``device="all"``); returns the plugin path. Raises VerifyUnavailable when it
    cannot be built or MindSpore refuses it."""
    from mindspore import graph

    inherited = os.environ.pop(RECORD_ENV, None)
    if inherited:
        # Only ``recording`` sets the variable, and it runs after this registration: a value
        # here came from a parent process that was recording when it started this one, and
        # names a file that is not ours (its folder may already be gone).
        logger.warning("ignoring %s=%s inherited from the parent process", RECORD_ENV,
                       inherited)
    path = build_plugin()
    if not graph.register_custom_pass(PASS_NAME, path, device="all",
                                      pass_type=graph.CustomPassType.FULL_GRAPH):
        raise VerifyUnavailable(f"mindspore.graph.register_custom_pass refused {PASS_NAME!r} "
                                f"from {path} (see MindSpore's log for the reason).")
    logger.info("registered the plan-verification pass %s from %s", PASS_NAME, path)
    return path


@contextlib.contextmanager
def recording(path: str) -> Iterator[str]:
    """While inside, every compile writes the pass's record to ``path`` (the last compile's
    record wins). The previous value of ``MS_EFFICIENT_VERIFY_RECORD`` is restored on exit."""
    old = os.environ.get(RECORD_ENV)
    os.environ[RECORD_ENV] = str(path)
    try:
        yield str(path)
    finally:
        if old is None:
            os.environ.pop(RECORD_ENV, None)
        else:
            os.environ[RECORD_ENV] = old
