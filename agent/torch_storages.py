"""The storages a torch.save ``data.pkl`` names, each with its dtype and a tensor's name, read from the
pickle's opcodes: nothing in it is ever unpickled (a pickle can run any code it names).

torch.save writes each tensor's storage as a persistent id, ``('storage', torch.FloatStorage, key,
location, numel)``, its bytes in the zip's ``data/<key>``. Walking the opcodes with ``pickletools.genops``
over a model of the pickle machine gives each one: its stack between marks and its memo, with plain
values (strings, numbers) as they are, dictionaries and lists as empty ones that its SETITEM and APPEND
fill, a call (REDUCE, NEWOBJ) as an empty dictionary that a BUILD may fill with the object's state, or
as the storage it was given (``_rebuild_tensor_v2(storage, ...)`` is the tensor of that storage), and
anything else as nothing in particular (what ``pickletools`` says each opcode pops and pushes keeps the
stack in step). No callable is ever looked up, let alone called. The object built so names each tensor
by the keys that lead to it (``model.layers.0.weight``; an optimizer's ``state.0.exp_avg``).

A storage of a class that names no dtype (``UntypedStorage``: float8 and the unsigned types beyond
uint8, whose dtype torch gives in a later argument) is not read. Stdlib only.
"""

from __future__ import annotations

import io
import pickletools
from dataclasses import dataclass

#: torch's storage classes of floating types (complex ones are pairs of floats), by class name.
FLOAT_STORAGES = {"DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
                  "ComplexDoubleStorage": "F64", "ComplexFloatStorage": "F32"}
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Storage:
    key: str  # its record is data/<key>
    dtype: str  # a safetensors dtype code: F64, F32, F16, BF16
    tensor: str = ""  # the keys that lead to a tensor of it, dotted; "" when none was found


@dataclass(frozen=True)
class _Global:
    name: str  # "module name", as GLOBAL gives it


@dataclass(frozen=True)
class _StorageRef:
    key: str


class _Opaque:
    """Anything on the stack that is none of the above."""


_OPAQUE = _Opaque()
_ATOMS = {"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING", "STRING",
          "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4", "BINFLOAT", "FLOAT"}
_MEMO_PUT = {"BINPUT", "LONG_BINPUT", "PUT"}
_MEMO_GET = {"BINGET", "LONG_BINGET", "GET"}
_TUPLE_N = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_CALLS = {"REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3}


class _Machine:
    """The pickle machine's stack as lists between marks, and its memo."""

    def __init__(self) -> None:
        self.levels: list[list[object]] = [[]]
        self.memo: dict[int, object] = {}
        self.storages: dict[str, str] = {}  # key -> dtype code
        self.result: object = None

    def push(self, item: object) -> None:
        self.levels[-1].append(item)

    def pop(self) -> object:
        top = self.levels[-1]
        return top.pop() if top else _OPAQUE  # a stack the model lost track of: nothing to see, no crash

    def top(self) -> object:
        return self.levels[-1][-1] if self.levels[-1] else _OPAQUE

    def pop_mark(self) -> list[object]:
        return self.levels.pop() if len(self.levels) > 1 else []

    def step(self, opcode: pickletools.OpcodeInfo, arg: object) -> None:
        name = opcode.name
        if name in _ATOMS:
            self.push(arg)
        elif name == "MARK":
            self.levels.append([])
        elif name == "GLOBAL":
            self.push(_Global(str(arg)))
        elif name == "STACK_GLOBAL":
            attribute, module = self.pop(), self.pop()
            self.push(_Global(f"{module} {attribute}"))
        elif name in _MEMO_PUT or name == "MEMOIZE":
            self.memo[arg if isinstance(arg, int) else len(self.memo)] = self.top()
        elif name in _MEMO_GET and isinstance(arg, int):
            self.push(self.memo.get(arg, _OPAQUE))
        elif name == "TUPLE":
            self.push(tuple(self.pop_mark()))
        elif name in _TUPLE_N:
            items = [self.pop() for _ in range(_TUPLE_N[name])]
            self.push(tuple(reversed(items)))
        elif name == "BINPERSID":
            self.push(self._persistent_id(self.pop()))
        elif name == "STOP":
            self.result = self.pop()
        elif not self._containers(name):
            self._generic(opcode)

    def _containers(self, name: str) -> bool:
        """The opcodes that build the dictionaries and lists that name the tensors. False: not one of them."""
        if name in ("EMPTY_DICT", "EMPTY_LIST"):
            self.push({} if name == "EMPTY_DICT" else [])
        elif name in ("DICT", "LIST"):
            items = self.pop_mark()
            self.push(_pairs_into({}, items) if name == "DICT" else items)
        elif name == "SETITEM":
            value, key = self.pop(), self.pop()
            _pairs_into(self.top(), [key, value])
        elif name == "SETITEMS":
            items = self.pop_mark()
            _pairs_into(self.top(), items)
        elif name in ("APPEND", "APPENDS"):
            items = [self.pop()] if name == "APPEND" else self.pop_mark()
            target = self.top()
            if isinstance(target, list):
                target.extend(items)
        elif name in _CALLS:
            arguments = [self.pop() for _ in range(_CALLS[name])][:-1]  # the callable is never looked at
            given = [item for argument in arguments if isinstance(argument, tuple) for item in argument]
            self.push(next((item for item in given if isinstance(item, _StorageRef)), {}))
        elif name == "BUILD":
            state = self.pop()
            state = state[0] if isinstance(state, tuple) and state else state  # (dict, slots)
            target = self.top()
            if isinstance(target, dict) and isinstance(state, dict):
                target.update(state)
        else:
            return False
        return True

    def _generic(self, opcode: pickletools.OpcodeInfo) -> None:
        """Any other opcode, by what pickletools says it pops (up to a mark, and items below it) and pushes."""
        before = opcode.stack_before
        if pickletools.markobject in before:
            self.pop_mark()
            before = before[:before.index(pickletools.markobject)]
        for _ in before:
            self.pop()
        for _ in opcode.stack_after:
            self.push(_OPAQUE)

    def _persistent_id(self, pid: object) -> object:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[1], _Global)
                and isinstance(pid[2], str)):
            return _OPAQUE
        dtype = FLOAT_STORAGES.get(pid[1].name.rsplit(" ", 1)[-1].rsplit(".", 1)[-1])
        if dtype is None:
            return _OPAQUE
        self.storages.setdefault(pid[2], dtype)
        return _StorageRef(pid[2])


def _pairs_into(target: object, items: list[object]) -> object:
    if isinstance(target, dict):
        for key, value in zip(items[::2], items[1::2], strict=False):
            if isinstance(key, (str, int, float)):
                target[key] = value
    return target


def _tensor_names(root: object) -> dict[str, str]:
    """Storage key -> the keys (and list indexes) that lead from the pickled object to a tensor of it."""
    names: dict[str, str] = {}
    seen: set[int] = set()
    todo: list[tuple[object, str, int]] = [(root, "", 0)]
    while todo:
        item, path, depth = todo.pop()
        if isinstance(item, _StorageRef):
            names.setdefault(item.key, path)
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen and depth < _MAX_DEPTH:
            seen.add(id(item))
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, value in reversed(list(pairs)):  # a stack: reversed, so the first key is named first
                todo.append((value, f"{path}.{key}" if path else str(key), depth + 1))
    return names


def float_storages(data: bytes) -> dict[str, Storage] | None:
    """Storage key -> the storage, for each storage of a floating type that ``data`` (a ``data.pkl``)
    names; None when it is not a pickle."""
    machine = _Machine()
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            machine.step(opcode, arg)
    except (ValueError, EOFError, UnicodeDecodeError):
        return None
    names = _tensor_names(machine.result)
    return {key: Storage(key, dtype, names.get(key, "")) for key, dtype in machine.storages.items()}
