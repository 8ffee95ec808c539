"""What the method groups share: the free-form object, the request of a method without arguments."""

from __future__ import annotations

from typing import Any, TypedDict

#: A JSON (or msgpack) object whose fields are free-form: checked field by field where it is
#: read, or passed on as it came.
JsonObject = dict[str, Any]


class EmptyRequest(TypedDict):
    pass
