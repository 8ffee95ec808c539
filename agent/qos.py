"""Run a rank's thread at macOS's user-interactive QoS class.

On Apple silicon, macOS picks a thread's cores (performance or efficiency) and its place
against other work by its quality-of-service class; ``nice()`` does not change the
class, so macOS ignores it for this. The class is set with
``pthread_set_qos_class_self_np`` (libSystem) and covers the calling thread only (threads
it starts later begin at the default class), so a rank calls it first, on the thread that
drives MLX. Elsewhere there are no QoS classes and this is a
no-op that says so. Stdlib only: this runs in the node's Python (3.10 or later).
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any, TypedDict


class QosPlan(TypedDict):
    qos: str | None  # the class a rank gets, or None where there are none
    reason: str


class QosOutcome(QosPlan):
    applied: bool


#: QOS_CLASS_USER_INTERACTIVE from <sys/qos.h>.
QOS_CLASS_USER_INTERACTIVE = 0x21
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"
QOS_NAME = "user-interactive"


def qos_for_platform(system: str) -> QosPlan:
    """What a rank on ``system`` (``platform.system()`` or coord's ``"macOS"``) will get, for the plan."""
    if system in ("Darwin", "macOS"):
        return {"qos": QOS_NAME, "reason": "pthread_set_qos_class_self_np(QOS_CLASS_USER_INTERACTIVE) on the "
                                           "rank's main thread"}
    return {"qos": None, "reason": f"QoS classes are macOS-only; no-op on {system or 'this OS'}"}


def set_user_interactive_qos(libc: Any = None, system: str | None = None) -> QosOutcome:
    """Put the calling thread in the user-interactive QoS class.

    Returns ``{"applied": bool, "qos": "user-interactive" | None, "reason": str}``.
    ``libc`` (default: libSystem) and ``system`` (default: ``platform.system()``) are
    for tests.
    """
    system = system if system is not None else platform.system()
    expected = qos_for_platform(system)
    if expected["qos"] is None:
        return {"applied": False, **expected}
    try:
        library = libc if libc is not None else ctypes.CDLL(LIBSYSTEM, use_errno=True)
        set_qos = library.pthread_set_qos_class_self_np
    except (OSError, AttributeError) as error:
        return {"applied": False, "qos": None, "reason": f"pthread_set_qos_class_self_np unavailable: {error}"}
    set_qos.argtypes = [ctypes.c_uint, ctypes.c_int]
    set_qos.restype = ctypes.c_int
    # The function returns an errno value itself (0 on success), not -1 with errno set.
    code = set_qos(QOS_CLASS_USER_INTERACTIVE, 0)
    if code != 0:
        return {"applied": False, "qos": None,
                "reason": f"pthread_set_qos_class_self_np failed: {os.strerror(code)} (error {code})"}
    return {"applied": True, **expected}
