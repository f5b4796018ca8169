"""The operator library: every registered op is an attribute here (``twophase.ops.softmax``)."""

from typing import Any

from ..op import registry
from . import attention, conv, elementwise, linalg, normalization, pool, reduce, shape  # noqa: F401  (each registers its ops)

globals().update(registry)


def __getattr__(name: str) -> Any:
    try:
        return registry[name]
    except KeyError:
        raise AttributeError(f"twophase.ops has no op '{name}'") from None


def __dir__() -> list[str]:
    return sorted(set(registry) | set(globals()))
