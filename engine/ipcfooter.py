"""A bounds-checked look into an Arrow IPC file's footer, before pyarrow decodes any of it.

Why: a compressed record batch states its own unpacked size, so a small file from a host could make the
reader allocate gigabytes; engine.table_files.parse_table calls `refuse_compressed` first. Every read here is
bounds-checked: struct.error when out of range, IpcRefused for a file that is not what kdbench writes.
"""

from __future__ import annotations

import struct


class IpcRefused(ValueError):
    """An Arrow IPC file refused before decoding; the message says why (the caller names the file)."""


class _FlatTable:
    """Just enough of a flatbuffers table reader to find one field; every read is bounds-checked
    (struct.error when out of range, which engine.table_files.parse_table reports as an unreadable file)."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vt = pos - self._at("<i", pos)
        self.vt_len = self._at("<H", self.vt)

    def _at(self, fmt: str, off: int) -> int:
        if off < 0 or off + struct.calcsize(fmt) > len(self.buf):
            raise struct.error("flatbuffer offset out of range")
        return struct.unpack_from(fmt, self.buf, off)[0]

    def _field(self, i: int) -> int:
        o = 4 + 2 * i
        return self._at("<H", self.vt + o) if o + 2 <= self.vt_len else 0

    def scalar(self, i: int, fmt: str) -> int:
        off = self._field(i)
        return self._at(fmt, self.pos + off) if off else 0

    def table(self, i: int) -> "_FlatTable | None":
        off = self._field(i)
        if not off:
            return None
        p = self.pos + off
        return _FlatTable(self.buf, p + self._at("<I", p))

    def vector(self, i: int) -> tuple[int, int]:
        """(position of the first element, element count); (0, 0) when absent."""
        off = self._field(i)
        if not off:
            return 0, 0
        p = self.pos + off
        v = p + self._at("<I", p)
        return v + 4, self._at("<I", v)


_MAGIC = b"ARROW1"
_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # MessageHeader union tags (Message.fbs)


def refuse_compressed(data: bytes) -> None:
    """Walk the file footer's dictionary and record-batch blocks (what the reader will decode) and
    refuse any whose RecordBatch carries a BodyCompression (Message.fbs field 3)."""
    if len(data) < 18 or data[:6] != _MAGIC or data[-6:] != _MAGIC:
        raise IpcRefused(f"not an Arrow IPC file (no ARROW1 magic at both ends)")
    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    start = len(data) - 10 - footer_len
    if footer_len <= 0 or start < 8:
        raise IpcRefused(f"bad Arrow footer length {footer_len}")
    footer_buf = data[start:len(data) - 10]
    footer = _FlatTable(footer_buf, struct.unpack_from("<I", footer_buf, 0)[0])
    for field in (2, 3):  # Footer.dictionaries, Footer.recordBatches: vectors of Block structs
        first, count = footer.vector(field)
        for k in range(count):
            at = first + 24 * k  # Block: offset int64, metaDataLength int32 (+4 pad), bodyLength int64
            if at + 24 > len(footer_buf):
                raise IpcRefused(f"Arrow footer block out of range")
            offset, meta_len = struct.unpack_from("<qi", footer_buf, at)
            if offset < 8 or meta_len < 8 or offset + meta_len > start:
                raise IpcRefused(f"Arrow block outside the file")
            meta = data[offset:offset + meta_len]
            skip = 8 if meta[:4] == b"\xff\xff\xff\xff" else 4  # continuation marker, then int32 length
            body = meta[skip:]
            message = _FlatTable(body, struct.unpack_from("<I", body, 0)[0])
            kind, header = message.scalar(1, "<B"), message.table(2)
            if kind == _DICTIONARY_BATCH and header is not None:
                header = header.table(1)  # DictionaryBatch.data
            elif kind != _RECORD_BATCH:
                raise IpcRefused(f"Arrow block holds message type {kind}, not a batch")
            if header is not None and header.table(3) is not None:
                raise IpcRefused("compressed Arrow record batches are refused (kdbench writes them uncompressed)")
