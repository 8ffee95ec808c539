"""macOS QoS for ranks: user-interactive through pthread_set_qos_class_self_np on Darwin, a
no-op that says so elsewhere."""

from __future__ import annotations

import ctypes
import errno
import platform

import pytest

from agent.qos import QOS_CLASS_USER_INTERACTIVE, qos_for_platform, set_user_interactive_qos


class FakeLibSystem:
    """Stands in for libSystem: records the call and answers with ``code``."""

    def __init__(self, code: int):
        self.calls = []
        code_to_return = code

        def pthread_set_qos_class_self_np(qos_class, relative_priority):
            self.calls.append((qos_class, relative_priority))
            return code_to_return

        self.pthread_set_qos_class_self_np = pthread_set_qos_class_self_np


@pytest.mark.skipif(platform.system() == "Darwin", reason="the no-op is for other systems")
def test_elsewhere_it_is_a_no_op_that_says_so():
    assert set_user_interactive_qos() == {
        "applied": False, "qos": None, "reason": f"QoS classes are macOS-only; no-op on {platform.system()}",
    }


def test_on_linux_the_libc_is_never_touched():
    libc = FakeLibSystem(0)
    result = set_user_interactive_qos(libc, system="Linux")
    assert result == {"applied": False, "qos": None, "reason": "QoS classes are macOS-only; no-op on Linux"}
    assert libc.calls == []


def test_on_macos_the_calling_thread_gets_user_interactive():
    libc = FakeLibSystem(0)
    result = set_user_interactive_qos(libc, system="Darwin")
    assert libc.calls == [(QOS_CLASS_USER_INTERACTIVE, 0)] and QOS_CLASS_USER_INTERACTIVE == 0x21
    assert result["applied"] is True and result["qos"] == "user-interactive"
    assert "pthread_set_qos_class_self_np" in result["reason"]
    assert libc.pthread_set_qos_class_self_np.argtypes == [ctypes.c_uint, ctypes.c_int]


def test_a_refused_call_is_reported_with_its_error():
    result = set_user_interactive_qos(FakeLibSystem(errno.EPERM), system="Darwin")
    assert result["applied"] is False and result["qos"] is None
    assert result["reason"].startswith("pthread_set_qos_class_self_np failed: ")
    assert f"(error {errno.EPERM})" in result["reason"]


def test_a_libsystem_without_the_function_is_reported():
    result = set_user_interactive_qos(object(), system="Darwin")
    assert result["applied"] is False and "unavailable" in result["reason"]


@pytest.mark.parametrize("system, qos", [("Darwin", "user-interactive"), ("macOS", "user-interactive"),
                                         ("Linux", None)])
def test_the_plan_says_what_each_node_will_get(system, qos):
    assert qos_for_platform(system)["qos"] == qos
