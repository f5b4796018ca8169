"""Status codes, exception classes, messages that name op / argument / expectation, recent_error_message."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import twophase
from twophase import Status, TensorDesc, ops
from twophase.op import Op, OpDef, Plan


def test_status_codes_have_the_documented_values():
    assert Status.SUCCESS == 0
    assert Status.ERR_PARAM_NULLPTR == 161001
    assert Status.ERR_PARAM_INVALID == 161002
    assert Status.ERR_RUNTIME_ERROR == 361001
    assert Status.ERR_INNER_TILING == 561002
    assert Status.ERR_INNER_KERNEL_NOT_FOUND == 561003


def test_status_leading_digit_tells_whose_fault_it_is():
    assert all(str(int(s))[0] == "1" for s in Status if s.name.startswith("ERR_PARAM"))
    assert all(str(int(s))[0] == "3" for s in Status if s.name.startswith("ERR_RUNTIME"))
    assert all(str(int(s))[0] == "5" for s in Status if s.name.startswith("ERR_INNER"))


def test_exception_classes_carry_their_default_status_and_builtin_bases():
    assert twophase.ParamError().status is Status.ERR_PARAM_INVALID
    assert isinstance(twophase.ParamError(), ValueError)
    assert twophase.RuntimeFailure().status is Status.ERR_RUNTIME_ERROR
    assert isinstance(twophase.OutOfMemoryError(), MemoryError)
    assert isinstance(twophase.InvalidStateError(), RuntimeError)
    assert issubclass(twophase.WorkspaceTooSmallError, twophase.ParamError)
    for cls in (twophase.ParamError, twophase.RuntimeFailure, twophase.InternalError, twophase.KernelError):
        assert issubclass(cls, twophase.TwoPhaseError)


def test_message_names_status_op_argument_expected_and_got():
    e = twophase.ParamError("bad", op="softmax", arg="dim", expected="a dim in [-2, 2)", got=5)
    assert str(e) == "[161002] softmax: argument 'dim': bad expected a dim in [-2, 2), got 5"
    assert (e.op, e.arg, e.got) == ("softmax", "dim", 5)


@pytest.mark.parametrize(
    "call, op, arg, expected",
    [
        (lambda: ops.add.get_workspace_size(TensorDesc((2, 3)), TensorDesc((4,))), "add", "other", "broadcast"),
        (lambda: ops.add.get_workspace_size(TensorDesc((2,)), TensorDesc((2,), "bool")), "add", "other", "dtype"),
        (lambda: ops.softmax.get_workspace_size(TensorDesc((2, 3), "int32")), "softmax", "x", "dtype"),
        (lambda: ops.softmax.get_workspace_size(TensorDesc((2, 3)), dim=2), "softmax", "dim", "[-2, 2)"),
        (lambda: ops.reduce_sum.get_workspace_size(TensorDesc((2, 3)), dims=(0, 0)), "reduce_sum", "dims", "distinct"),
        (
            lambda: ops.reduce_sum.get_workspace_size(TensorDesc((2, 3)), dims=(0,), out=TensorDesc((2,))),
            "reduce_sum",
            "out",
            "shape (3,)",
        ),
        (
            lambda: ops.softmax.get_workspace_size(TensorDesc((2, 3)), axis=1),
            "softmax",
            "axis",
            "one of the attributes",
        ),
        (lambda: ops.softmax.get_workspace_size(TensorDesc((2, 3)), dim="x"), "softmax", "dim", "an int"),
    ],
)
def test_parameter_error_message_names_op_argument_and_expectation(call, op, arg, expected):
    with pytest.raises(twophase.ParamError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"[{int(Status.ERR_PARAM_INVALID)}] {op}:")
    assert f"argument '{arg}'" in msg
    assert expected in msg


def test_missing_required_input_reports_nullptr_status():
    with pytest.raises(twophase.ParamError) as info:
        ops.add.get_workspace_size(None, TensorDesc((2,)))
    assert info.value.status is Status.ERR_PARAM_NULLPTR
    assert "argument 'x'" in str(info.value)


def test_negative_workspace_from_select_is_a_tiling_error():
    spec = OpDef(
        name="bad_tiling",
        inputs=("x",),
        infer=lambda ins, a: (ins[0],),
        select=lambda ins, outs, a, lim: Plan("broken", None, -1),
        kernels={},
    )
    with pytest.raises(twophase.InternalError) as info:
        Op(spec).get_workspace_size(TensorDesc((2,)))
    assert info.value.status is Status.ERR_INNER_TILING
    assert "bad_tiling" in str(info.value)


def test_missing_kernel_for_device_is_kernel_not_found(dev):
    spec = OpDef(
        name="no_cpu_kernel",
        inputs=("x",),
        infer=lambda ins, a: (ins[0],),
        select=lambda ins, outs, a, lim: Plan("only_cuda", None, 0),
        kernels={"cuda": lambda *a: None},
    )
    x = dev.empty((3,))
    with pytest.raises(twophase.InternalError) as info:
        Op(spec).get_workspace_size(x, out=dev.empty((3,)))
    assert info.value.status is Status.ERR_INNER_KERNEL_NOT_FOUND
    assert "no_cpu_kernel" in str(info.value) and "cpu" in str(info.value)


def test_recent_error_message_returns_then_clears():
    twophase.recent_error_message()
    with pytest.raises(twophase.ParamError) as info:
        ops.softmax.get_workspace_size(TensorDesc((2, 3)), dim=7)
    assert twophase.recent_error_message() == str(info.value)
    assert twophase.recent_error_message() == ""


def test_recent_error_message_is_per_thread():
    twophase.recent_error_message()
    seen = {}

    def other():
        try:
            ops.softmax.get_workspace_size(TensorDesc((2,), "int64"))
        except twophase.ParamError as e:
            seen["raised"] = str(e)
        seen["other"] = twophase.recent_error_message()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["other"] == seen["raised"] and "softmax" in seen["other"]
    assert twophase.recent_error_message() == ""


def test_kernel_failure_on_worker_sets_recent_message_of_synchronizing_thread(stream):
    twophase.recent_error_message()

    def boom():
        raise np.linalg.LinAlgError("singular")

    stream.launch_callback(boom)
    with pytest.raises(twophase.KernelError) as info:
        stream.synchronize()
    assert twophase.recent_error_message() == str(info.value)
    assert "singular" in str(info.value)
