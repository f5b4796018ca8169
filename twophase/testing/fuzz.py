"""Phase-1 fuzzing: random descs and attributes into every registered op's ``get_workspace_size``; only project
exceptions may come out (never another exception type, a hang or a crash)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import TwoPhaseError
from ..executor import ExecState
from ..op import Op, get_op, registry
from ..tensor import DType, Format, TensorDesc

__all__ = ["fuzz_phase1", "FuzzResult", "random_desc", "random_attr"]

_DIMS = (0, 1, 1, 2, 3, 4, 5, 7, 13, 64, 1 << 20, 1 << 40, 1 << 62)
_FORMATS = tuple(Format)
_DTYPES = tuple(DType)
SLOW_S = 2.0  # a phase 1 slower than this is reported as a (near) hang


@dataclass
class FuzzResult:
    calls: int = 0
    accepted: int = 0
    rejected: int = 0  # project exceptions: the expected answer to bad input
    bad: list[str] = field(default_factory=list)  # other exceptions and slow calls
    slowest: float = 0.0


def random_desc(rng: np.random.Generator, like: TensorDesc | None = None) -> Any:
    """A desc: often plausible (near ``like``), sometimes wrong rank, huge dims, bad strides or another format;
    once in a while not a desc at all."""
    r = rng.random()
    if r < 0.03:
        return [None, 3, "x", 1.5, object(), (2, 3)][int(rng.integers(6))]
    if like is not None and r < 0.45:
        shape = list(like.shape)
        if shape and rng.random() < 0.5:
            shape[int(rng.integers(len(shape)))] = int(rng.choice(_DIMS))
        dtype = like.dtype if rng.random() < 0.7 else _DTYPES[int(rng.integers(len(_DTYPES)))]
    else:
        rank = int(rng.integers(0, 7))
        shape = [int(rng.choice(_DIMS[:9] if rng.random() < 0.8 else _DIMS)) for _ in range(rank)]
        dtype = _DTYPES[int(rng.integers(len(_DTYPES)))]
    strides = None
    offset = 0
    if rng.random() < 0.25:
        strides = [int(rng.choice((-3, -1, 0, 1, 2, 7, 1 << 33))) for _ in shape]
        offset = int(rng.choice((0, 5, 1 << 30)))
    fmt = Format.ND
    if rng.random() < 0.2:
        fmt = _FORMATS[int(rng.integers(len(_FORMATS)))]
    try:
        return TensorDesc(shape, dtype, strides, offset, fmt)
    except TwoPhaseError:
        return TensorDesc(shape, dtype)


def random_attr(rng: np.random.Generator, default: Any) -> Any:
    """An attribute value: the default, a nearby value, or something of the wrong kind entirely."""
    pool: list[Any] = [
        default,
        -1,
        0,
        1,
        2,
        3,
        -7,
        1 << 40,
        2.5,
        -0.0,
        float("nan"),
        float("inf"),
        True,
        None,
        "",
        "none",
        "tanh",
        (),
        (0,),
        (1, 1),
        (-1, 0),
        (0, 0, 0, 0),
        (1 << 40,),
        [1, 2],
        (1, "a"),
        ((1,),),
        DType.float32,
        "float16",
        {"a": 1},
        object(),
    ]
    return pool[int(rng.integers(len(pool)))]


def _call(op: Op, rng: np.random.Generator) -> tuple[Any, dict[str, Any]]:
    spec = op.spec
    base = random_desc(rng)
    like = base if isinstance(base, TensorDesc) else None
    n = len(spec.inputs)
    count = n if rng.random() < 0.9 else int(rng.integers(0, n + 2))
    inputs = [base] + [random_desc(rng, like) for _ in range(max(count - 1, 0))]
    inputs = inputs[:count]
    for i, name in enumerate(spec.inputs[:count]):
        if name.endswith("?") and rng.random() < 0.5:
            inputs[i] = None
    attrs = {a.name: random_attr(rng, a.default) for a in spec.attrs if rng.random() < 0.7}
    if rng.random() < 0.03:
        attrs["no_such_attribute"] = 1
    if rng.random() < 0.05:
        attrs["out"] = random_desc(rng, like)
    if rng.random() < 0.05:
        attrs["workspace_limit"] = int(rng.choice((0, 1, 512, -1)))
    return inputs, attrs


def fuzz_phase1(
    n: int, seed: int = 0, ops: Iterable[str] | None = None, progress: Callable[[], None] | None = None
) -> FuzzResult:
    """``n`` random phase-1 calls spread over ``ops`` (every registered op by default)."""
    names = sorted(ops) if ops is not None else sorted(registry)
    rng = np.random.default_rng(seed)
    res = FuzzResult()
    for i in range(n):
        op = get_op(names[i % len(names)])
        inputs, attrs = _call(op, rng)
        t0 = time.perf_counter()
        try:
            _, ex = op.get_workspace_size(*inputs, **attrs)
            res.accepted += 1
            if ex.state is ExecState.READY:
                ex.destroy()
        except TwoPhaseError:
            res.rejected += 1
        except Exception as exc:  # noqa: BLE001 - the point: anything else is a bug
            res.bad.append(f"{op.name}{tuple(inputs)!r} {attrs!r}: {type(exc).__name__}: {exc}")
        dt = time.perf_counter() - t0
        res.slowest = max(res.slowest, dt)
        if dt > SLOW_S:
            res.bad.append(f"{op.name}{tuple(inputs)!r} {attrs!r}: phase 1 took {dt:.1f} s")
        res.calls += 1
        if progress is not None:
            progress()
    return res
