"""Import-time stand-in for torchvision in the CPU test environment (.venv-sglang).

Why: the only torch on this machine is ``torch 2.13.0+cpu``; PyPI's torchvision wheels are
built against the CUDA torch and fail on import with it (``_C.so`` links
``libtorch_cuda.so``; then ``RuntimeError: operator torchvision::nms does not exist``).
SGLang 0.5.23 imports ``torchvision.transforms`` at module level in its multimodal configs
(``sglang.srt.multimodal.internvl_utils``, ``sglang.srt.configs.deepseek_ocr``) and
transformers 5.19 imports ``torchvision.io``/``transforms`` in ``image_utils`` when it
finds torchvision; the scheduler module imports both, yet uses torchvision only to
preprocess images, which the contract tests never do.

Every ``torchvision.*`` submodule and name resolves at import time; any *use* (a call)
raises ``RuntimeError``, so nothing can silently depend on it. ``InterpolationMode`` is a
real enum because transformers builds a mapping from it at import time. Installed only by
ci/setup_sglang_cpu.sh into .venv-sglang, never with quiesce.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.28.0"  # the release paired with torch 2.13 (transformers compares it)


class _Unavailable:
    """A name that exists for imports and raises when used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> _Unavailable:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{self._name}: torchvision is an import-time stand-in in this test "
                           "environment (no CPU build of torchvision for torch 2.13.0+cpu)")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StandinModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        if item == "InterpolationMode":
            return InterpolationMode
        return _Unavailable(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.{name}")


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
