"""Byte sizes as people write them: parsing "70GiB" and printing "1.50 GiB" (one rule for every package).

``parse_bytes`` accepts a whole number of bytes (returned as given) or a string: a decimal number
(as Python's ``float`` reads it: "1e9", "1.5", " 8 ") followed by an optional unit, any case, with or
without a space: B; kB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024). The bytes
are ``int(number * unit)``. Anything else raises ByteSizeError (a ValueError) naming the text.

``format_bytes`` prints the largest binary unit not above the value (KiB up to ``largest``) with
``digits`` decimals, or whole bytes below 1 KiB.
"""

from __future__ import annotations

import math

#: unit -> bytes; longer names first, so that "kib" is not read as "b"
BYTE_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
              "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
#: binary units of format_bytes, largest first
_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


class ByteSizeError(ValueError):
    """A text that is not a byte size; the message gives examples of one."""


def parse_bytes(size: int | str) -> int:
    """Bytes of ``size`` (module docstring): ``"70GiB"`` -> 75161927680, ``"1e9"`` -> 10**9, ``7`` -> 7."""
    if isinstance(size, int):
        return size
    text = size.strip().lower() if isinstance(size, str) else ""
    number, scale = text, 1
    for unit, unit_bytes in BYTE_UNITS.items():
        if text.endswith(unit):
            number, scale = text[: -len(unit)], unit_bytes
            break
    try:
        value = float(number.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ByteSizeError(f"memory {size!r} is not a size like 70GiB, 512MiB, 80GB or 1e9")
    return int(value * scale)


def format_bytes(n: float, *, digits: int = 2, plain_unit: str = "B", largest: str = "GiB", unit: str | None = None,
                 grouping: bool = False) -> str:
    """``n`` bytes as text: "1.50 GiB" (``digits`` decimals, binary units up to ``largest``), or whole
    bytes below 1 KiB ("512 B"; ``plain_unit`` names them). ``unit`` ("MiB"): always in that unit, at any
    size ("0.4 MiB"); ``grouping``: thousands separated by commas ("1,024.0 MiB")."""
    if unit is not None:
        size = dict(_BINARY)[unit]
        return f"{n / size:{',' if grouping else ''}.{digits}f} {unit}"
    units = _BINARY[[u for u, _ in _BINARY].index(largest):]
    for unit, size in units:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} {plain_unit}"
