"""Whether a buffer of little-endian floats holds a NaN or an infinity, at the cost of one byte copy.

A float is not finite exactly when its exponent bits are all set. Those bits sit in the element's top
two bytes (in its top byte alone for float16 and the 8-bit floats), so a buffer is tested without
decoding a single element: the top byte of every element is taken with one strided slice
(``block[size - 1::size]``) and searched (``in``, a memchr) for each byte value that has its share of
the exponent bits all set (0x7F and 0xFF for float32). Real weights never come near the top of the
exponent range, so that search finds nothing and the test ends there. Where it finds one (a NaN, an
infinity, or a huge finite value) each of the two bytes is mapped by ``bytes.translate`` to 1 where its
exponent bits are all set, and the two are ANDed as big integers, whose lowest set byte is the first
non-finite element; that one element alone is decoded, to tell NaN from infinity. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _table(mask: int) -> bytes:
    """A ``bytes.translate`` table: 1 for a byte whose ``mask`` bits are all set, else 0."""
    return bytes(1 if byte & mask == mask else 0 for byte in range(256))


def _any_table(mask: int) -> bytes:
    """A ``bytes.translate`` table: 1 for a byte with any of its ``mask`` bits set, else 0."""
    return bytes(1 if byte & mask else 0 for byte in range(256))


@dataclass(frozen=True)
class FloatLayout:
    """Where one float type keeps its exponent: ``size`` bytes an element, little-endian; the top
    byte's exponent bits (``top_mask``), and the next byte's (``next_mask``, 0 when the top byte
    holds them all); the mantissa's bits, to tell NaN (some set) from infinity (none), as a count
    and as (byte of the element, its mantissa bits) pairs."""

    name: str
    size: int
    top_mask: int
    next_mask: int
    mantissa_bits: int
    mantissa: tuple[tuple[int, int], ...] = ()
    has_infinity: bool = True
    top_table: bytes = field(init=False, repr=False)
    next_table: bytes = field(init=False, repr=False)
    top_values: tuple[int, ...] = field(init=False, repr=False)  # top bytes with its exponent bits all set
    mantissa_tables: tuple[tuple[int, bytes], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_table", _table(self.top_mask))
        object.__setattr__(self, "top_values", tuple(b for b in range(256) if b & self.top_mask == self.top_mask))
        object.__setattr__(self, "next_table", _table(self.next_mask) if self.next_mask else b"")
        object.__setattr__(self, "mantissa_tables", tuple((offset, _any_table(mask)) for offset, mask in self.mantissa))


_BYTES = 0xFF
F64 = FloatLayout("float64", 8, 0x7F, 0xF0, 52, ((6, 0x0F), *((i, _BYTES) for i in range(6))))
F32 = FloatLayout("float32", 4, 0x7F, 0x80, 23, ((2, 0x7F), (1, _BYTES), (0, _BYTES)))
BF16 = FloatLayout("bfloat16", 2, 0x7F, 0x80, 7, ((0, 0x7F),))
F16 = FloatLayout("float16", 2, 0x7C, 0, 10, ((1, 0x03), (0, _BYTES)))
F8_E5M2 = FloatLayout("float8_e5m2", 1, 0x7C, 0, 2, ((0, 0x03),))
# float8_e4m3fn has no infinity: its one NaN pattern (per sign) is every bit but the sign set.
F8_E4M3 = FloatLayout("float8_e4m3fn", 1, 0x7F, 0, 3, has_infinity=False)


@dataclass(frozen=True)
class Found:
    """The first non-finite element of a buffer: its index and what it is ("NaN", "inf" or "-inf")."""

    index: int
    value: str


def first_nonfinite(block: bytes | bytearray, layout: FloatLayout, end: int | None = None) -> Found | None:
    """The first element of ``block[:end]`` (a whole number of ``layout`` elements) that is NaN or infinite."""
    size = layout.size
    end = len(block) if end is None else end
    top = block[size - 1:end:size]
    if not any(value in top for value in layout.top_values):
        return None
    marked = top.translate(layout.top_table)
    if layout.next_mask:
        second = block[size - 2:end:size].translate(layout.next_table)
        both = int.from_bytes(marked, "little") & int.from_bytes(second, "little")
        if not both:
            return None  # huge finite values, no more
        first = ((both & -both).bit_length() - 1) // 8
    else:
        first = marked.find(1)
    return Found(first, _classify(bytes(block[first * size:(first + 1) * size]), layout))


def first_nan(block: bytes | bytearray, layout: FloatLayout, end: int | None = None) -> Found | None:
    """The first element of ``block[:end]`` that is NaN; infinities pass. A NaN is an all-set exponent
    with a mantissa that is not zero: where the exponent test finds elements, their mantissa bytes are
    marked too (one strided slice and ``translate`` each) and ANDed in, so a tensor that holds
    infinities on purpose (a mask buffer of ``-inf``) costs a few more slices, never a decode each."""
    size = layout.size
    end = len(block) if end is None else end
    top = block[size - 1:end:size]
    if not any(value in top for value in layout.top_values):
        return None
    marked = int.from_bytes(top.translate(layout.top_table), "little")
    if layout.next_mask:
        marked &= int.from_bytes(block[size - 2:end:size].translate(layout.next_table), "little")
    if marked and layout.has_infinity:
        mantissa = 0
        for offset, table in layout.mantissa_tables:
            mantissa |= int.from_bytes(block[offset:end:size].translate(table), "little")
        marked &= mantissa
    if not marked:
        return None  # huge finite values, or infinities: no NaN
    return Found(((marked & -marked).bit_length() - 1) // 8, "NaN")


def _classify(element: bytes, layout: FloatLayout) -> str:
    bits = int.from_bytes(element, "little")
    if not layout.has_infinity or bits & ((1 << layout.mantissa_bits) - 1):
        return "NaN"
    return "-inf" if bits >> (8 * layout.size - 1) else "inf"
