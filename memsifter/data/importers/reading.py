"""What every import format shares: reading a source file (gunzipped, capped), parsing JSON with
one-line errors that name file, list item, line and column, and checking turns.

Bounds: a source file is read up to ``MEMSIFTER_MAX_INPUT_BYTES`` (default 4 GiB) *after
decompression* (``.gz`` by extension or by magic bytes; counted while inflating, so a small file that
inflates without bound stops early with one line naming the file; streamed into one buffer, never held
twice), and a compressed file to at most 100 times its size (past 64 MiB: a decompression bomb, 3 MB
inflating to 3 GB, stops at 300 MB, :func:`_inflate_cap`); JSON nested deeper than the parser allows (orjson: 1024 levels) is one line naming the file,
never a RecursionError; an integer literal over Python's 4300-digit limit is one line naming file, item
and field; a turn (message) over ``MEMSIFTER_MAX_TURN_BYTES`` (default 1 MiB of UTF-8) stops the import
with one line naming file, item and field (:func:`check_turn_size`).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs
from tqdm import tqdm

from ...store import storage
from ...errors import InputError, StorageError
from ..model import check_role, check_text

try:  # ~3x faster on the 270 MB LongMemEval_S file; the stdlib is the fallback
    import orjson as _fastjson
except ImportError:  # pragma: no cover - depends on the installation
    _fastjson = None


def _progress(it=None, **kw):
    return tqdm(it, disable=None, mininterval=1.0, **kw)


def _too_large(uri: str, cap: int) -> InputError:
    return InputError(f"more than {cap} bytes after decompression: over the input size cap "
                      f"(MEMSIFTER_MAX_INPUT_BYTES={cap}); raise it if this file is meant to be that large",
                      file=uri)


# A compressed source inflates to at most this many times its size (real data: 3-4x; the bomb of issue
# 41, 3 MB -> 3 GB, 1000x) once past INFLATE_FREE bytes: bounded while streaming, before it is held.
INFLATE_RATIO = 100
INFLATE_FREE = 64 << 20


def _inflate_cap(packed: int, cap: int) -> int:
    """Bytes a compressed file of ``packed`` bytes may inflate to: ``INFLATE_RATIO`` times its size (at
    least ``INFLATE_FREE``), never more than ``cap``."""
    return min(cap, max(INFLATE_FREE, INFLATE_RATIO * packed))


def _inflates_too_much(uri: str, packed: int, limit: int) -> InputError:
    return InputError(f"a {packed}-byte compressed file inflating past {limit} bytes (more than {INFLATE_RATIO}x "
                      "its size, where real data inflates 3-10x): refused as a decompression bomb; decompress it "
                      "yourself if it is meant to be that large (MEMSIFTER_MAX_INPUT_BYTES bounds plain files)",
                      file=uri)


_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"


def _read_raw(uri: str) -> bytearray:
    """A source file's bytes, gunzipped, at most ``MEMSIFTER_MAX_INPUT_BYTES`` of them.

    Streamed: the file is read (decompressed by pyarrow by extension, ``.gz``/``.bz2``/``.zst``, then
    gunzipped when what it reads starts with the gzip magic bytes) in 1 MiB chunks into one buffer,
    which is all that is held; the cap is checked after each chunk, so a small file that inflates
    without bound stops early, and nothing is buffered twice (no list of chunks joined at the end, no
    compressed copy next to the decompressed one). A compressed file may inflate to
    :data:`INFLATE_RATIO` times its size at most (:func:`_inflate_cap`), also checked per chunk: a 3 MB
    file that inflates to 3 GB stops at 300 MB, not after 3 GB were read and parsed."""
    cap = int(storage.setting("MEMSIFTER_MAX_INPUT_BYTES"))
    fs, path = storage.resolve(uri)

    def _read() -> bytearray:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type == pafs.FileType.Directory:
            raise StorageError(f"{uri}: is a directory, expected a file")
        buf = bytearray()
        packed = info.size or 0   # unknown (0): only the cap bounds it
        inflating = path.endswith((".gz", ".bz2", ".zst", ".zstd", ".lz4", ".br"))   # pyarrow's by extension
        with fs.open_input_stream(path) as raw:   # pyarrow inflates *.gz/*.bz2/*.zst by extension
            first = raw.read(_CHUNK)
            while 0 < len(first) < 2:   # a stream may answer short reads: the magic needs 2 bytes
                more = raw.read(_CHUNK)
                if not more:
                    break
                first += more
            limit, bomb = cap, 0
            if packed and (inflating or first[:2] == _GZIP_MAGIC):
                limit = _inflate_cap(packed, cap)
                bomb = packed if limit < cap else 0   # the ratio, not the cap, bounds it
            try:
                if first[:2] == _GZIP_MAGIC:
                    with gzip.GzipFile(fileobj=_Prepended(first, raw)) as f:
                        _fill(buf, f, limit, uri, bomb)
                else:
                    buf += first
                    if len(buf) > limit:
                        raise _inflates_too_much(uri, bomb, limit) if bomb else _too_large(uri, cap)
                    _fill(buf, raw, limit, uri, bomb)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise InputError(f"not a valid gzip file ({e})", file=uri) from e
        return buf
    return storage.retrying(_read, uri)


class _Prepended:
    """A read-only stream: ``head`` (already read) then the rest of ``rest``."""

    def __init__(self, head: bytes, rest: Any):
        self._head, self._rest = head, rest

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n is None or n < 0:
                out, self._head = self._head + self._rest.read(), b""
                return out
            out, self._head = self._head[:n], self._head[n:]
            return out
        return self._rest.read() if n is None or n < 0 else self._rest.read(n)


def _fill(buf: bytearray, f: Any, cap: int, uri: str, packed: int = 0) -> None:
    """Read ``f`` into ``buf`` up to ``cap`` bytes; past it the one-line error says which bound: the
    ratio to the ``packed`` (compressed) size when that set ``cap``, else MEMSIFTER_MAX_INPUT_BYTES."""
    while chunk := f.read(_CHUNK):
        if len(buf) + len(chunk) > cap:
            raise _inflates_too_much(uri, packed, cap) if packed else _too_large(uri, cap)
        buf += chunk


_MAX_INT_DIGITS = 4300   # Python's int <-> str limit (sys.get_int_max_str_digits)


class _HugeInt(Exception):
    """An integer literal longer than Python converts (raised by :func:`_parse_int`)."""

    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _MAX_INT_DIGITS:
        raise _HugeInt(digits)
    return int(text)


_STRICT_DECODER = json.JSONDecoder(parse_int=_parse_int)


def _huge_int_error(text: str, uri: str, *, what: str | None, id_key: str, digits: int,
                    item: str | None = None) -> InputError:
    """One line for an integer of more than 4300 digits: the file, the list item that holds it (for a
    JSON list of ``what``) and the key whose value it is."""
    m = re.search(r'"((?:[^"\\]|\\.){0,200})"\s*:\s*-?\d{%d,}' % (_MAX_INT_DIGITS + 1), text)
    field = m.group(1) if m else None
    if item is None and what:
        pos = m.start() if m else -1
        item = _list_item_at(text, pos, what, id_key) if pos >= 0 else None
    return InputError(f"an integer of {digits} digits (more than {_MAX_INT_DIGITS}): too long to read; write "
                      f"ids as strings", file=uri, item=item, field=field)


def _list_item_at(text: str, pos: int, what: str, id_key: str) -> str | None:
    """``"{what} #i ('id')"``: the item of the JSON list ``text`` that spans character ``pos``."""
    try:
        for idx, start, end, obj in _list_items(text):
            if start <= pos < end:
                ident = obj.get(id_key) if isinstance(obj, dict) else _guess_id(text, start, len(text), id_key)
                return f"{what} #{idx}" + (f" ('{ident}')" if ident not in (None, "") else "")
    except _ListStop as e:   # an integer too long to read: its item runs to the end, as far as we know
        if isinstance(e.cause, _HugeInt) and e.pos <= pos < len(text):
            ident = _guess_id(text, e.pos, len(text), id_key)
            return f"{what} #{e.index}" + (f" ('{ident}')" if ident not in (None, "") else "")
    return None


def _too_deep(uri: str, item: str | None = None) -> InputError:
    return InputError("JSON nested too deeply to parse (more than 1024 levels)", file=uri, item=item)


def _text(data: bytes, uri: str, *, what: str | None = None, id_key: str = "") -> str:
    """UTF-8 text of a source file; bytes that are not UTF-8 are an error naming byte, line and, for a
    JSON list of ``what`` items, the item that holds them."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        item = _item_at(data, e.start, what, id_key) if what else None
        raise InputError(f"not UTF-8 text (byte {e.start}, line {line}: {e.reason})", file=uri, item=item) from None


def _item_at(data: bytes, byte: int, what: str, id_key: str) -> str | None:
    """Which item of a JSON list holds byte ``byte`` (the file decoded with replacement characters)."""
    text = data.decode("utf-8-sig", errors="replace")
    pos = len(data[:byte].decode("utf-8-sig", errors="replace"))
    try:
        for idx, start, end, obj in _list_items(text):
            if start <= pos < end:
                ident = obj.get(id_key) if isinstance(obj, dict) else None
                return f"{what} #{idx}" + (f" ('{ident}')" if ident not in (None, "") else "")
    except _ListStop:
        pass
    return None


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


_WS = re.compile(r"[ \t\n\r]*")


class _ListStop(Exception):
    """Where :func:`_list_items` stopped, ``how``: ``not-a-list`` (``pos``: the first non-blank character,
    the length when none), ``bad-item`` (item ``index`` from ``pos`` does not parse; ``cause``: the
    decoder's error, a ``ValueError`` or :class:`_HugeInt`), ``truncated`` (the text ends after item
    ``index``), ``separator`` (neither ``,`` nor ``]`` after item ``index``) or ``extra`` (more after the
    closing ``]``); ``item``: the item before the stop."""

    def __init__(self, how: str, pos: int, index: int = -1, item: Any = None, cause: Exception | None = None):
        super().__init__(how, pos)
        self.how, self.pos, self.index, self.item, self.cause = how, pos, index, item, cause


def _list_items(text: str) -> Iterator[tuple[int, int, int, Any]]:
    """Walk the JSON list ``text`` once, item by item with the strict decoder: ``(index, start, end,
    item)`` of each. Where it is not a list, an item does not parse or the punctuation is broken, it
    raises :class:`_ListStop` saying which (after yielding the items before): what the callers need to
    name the item at a position or the place of a JSON error."""
    n = len(text)
    pos = _WS.match(text, 0).end()
    if pos >= n or text[pos] != "[":
        raise _ListStop("not-a-list", pos)
    pos = _WS.match(text, pos + 1).end()
    if pos < n and text[pos] == "]":
        pos += 1
    else:
        idx = 0
        while True:
            start = pos
            try:
                obj, pos = _STRICT_DECODER.raw_decode(text, pos)
            except (ValueError, _HugeInt) as e:
                raise _ListStop("bad-item", start, idx, cause=e) from None
            yield idx, start, pos, obj
            pos = _WS.match(text, pos).end()
            if pos >= n:
                raise _ListStop("truncated", pos, idx, obj)
            if text[pos] == ",":
                pos = _WS.match(text, pos + 1).end()
                idx += 1
                continue
            if text[pos] == "]":
                pos += 1
                break
            raise _ListStop("separator", pos, idx, obj)
    pos = _WS.match(text, pos).end()
    if pos < n:
        raise _ListStop("extra", pos)


def _guess_id(text: str, start: int, end: int, key: str) -> str | None:
    m = re.search(r'"%s"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)' % re.escape(key), text[start:min(end, start + 1_000_000)])
    if not m:
        return None
    try:
        return str(json.loads(m.group(1)))
    except ValueError:
        return None


def _json_error_kind(e: json.JSONDecodeError, n: int) -> str:
    # JSON strings cannot hold raw newlines, so an unterminated string ran into the end of the text.
    return "truncated JSON" if e.pos >= n or e.msg.startswith("Unterminated string") else "invalid JSON"


def _load_json_list(data: bytes, uri: str, *, what: str, id_key: str) -> list:
    """Parse a JSON list; on failure, name the list item (number and id) and line/column."""
    try:
        obj = _fastjson.loads(data) if _fastjson is not None else json.loads(data)
    except RecursionError:
        raise _too_deep(uri) from None
    except ValueError as e:
        if "recursion" in str(e).lower():   # orjson's depth limit
            raise _too_deep(uri) from None
        text = _text(data, uri, what=what, id_key=id_key)
        try:  # what orjson refuses (a BOM, huge integers) the stdlib may still read
            obj = _STRICT_DECODER.decode(text)
        except RecursionError:
            raise _too_deep(uri) from None
        except _HugeInt as e:
            raise _huge_int_error(text, uri, what=what, id_key=id_key, digits=e.digits) from None
        except ValueError:
            try:
                _locate_json_error(text, uri, what=what, id_key=id_key)
            except RecursionError:
                raise _too_deep(uri) from None
            raise AssertionError("unreachable")  # _locate_json_error always raises here
    if not isinstance(obj, list):
        raise InputError(f"expected a JSON list of {what}s, got {type(obj).__name__}", file=uri)
    return obj


def _locate_json_error(text: str, uri: str, *, what: str, id_key: str) -> None:
    """Re-parse item by item with the stdlib decoder to say where the JSON is broken."""
    n = len(text)
    try:
        for _ in _list_items(text):
            pass
    except _ListStop as e:
        line, col = _line_col(text, e.pos)
        ident = e.item.get(id_key) if isinstance(e.item, dict) else None
        after = f"{what} #{e.index}" + (f" ('{ident}')" if ident else "")
        if e.how == "not-a-list":
            if e.pos >= n:
                raise InputError("empty file (no JSON)", file=uri) from None
            try:
                json.loads(text)
            except json.JSONDecodeError as je:
                raise InputError(f"invalid JSON at line {je.lineno} column {je.colno}: {je.msg}", file=uri) from je
            raise InputError(f"expected a JSON list of {what}s", file=uri) from None
        if isinstance(e.cause, _HugeInt):
            raise _huge_int_error(text, uri, what=what, id_key=id_key, digits=e.cause.digits) from None
        if e.how == "bad-item":
            err = e.cause
            if not isinstance(err, json.JSONDecodeError):
                raise err from None   # (not a JSON error: as the decoder raised it)
            ident = _guess_id(text, e.pos, err.pos, id_key)
            item = f"{what} #{e.index}" + (f" ('{ident}')" if ident else "")
            raise InputError(f"{_json_error_kind(err, n)} at line {err.lineno} column {err.colno}: {err.msg}",
                             file=uri, item=item) from err
        if e.how == "truncated":
            raise InputError(f"truncated JSON at line {line} column {col}: the list ends without ']' after {after}",
                             file=uri) from None
        if e.how == "separator":
            raise InputError(f"invalid JSON at line {line} column {col}: expected ',' or ']' after this {what}",
                             file=uri, item=after) from None
        raise InputError(f"invalid JSON at line {line} column {col}: extra data after the list", file=uri) from None
    raise InputError("invalid JSON", file=uri)  # the fast parser refused what the stdlib accepts


def _turn(t: Any, *, uri: str, item: str, field: str) -> dict:
    if not isinstance(t, dict):
        raise InputError(f"a turn must be an object, got {type(t).__name__}", file=uri, item=item, field=field)
    for k in ("role", "content"):
        if k not in t:
            raise InputError("missing", file=uri, item=item, field=f"{field}.{k}")
        if not isinstance(t[k], str):
            raise InputError(f"expected str, got {type(t[k]).__name__}", file=uri, item=item,
                             field=f"{field}.{k}")
    check_role(t["role"], file=uri, item=item, field=f"{field}.role")
    check_text(t["content"], file=uri, item=item, field=f"{field}.content")
    check_turn_size(t["content"], file=uri, item=item, field=f"{field}.content")
    return {"role": t["role"], "content": t["content"]}


def check_turn_size(text: str, *, file: str, item: str | None, field: str) -> None:
    """Refuse a turn longer than ``MEMSIFTER_MAX_TURN_BYTES`` (UTF-8 bytes, default 1 MiB) at import:
    a 50 MB message would otherwise pass the import and blow up rendering and ranking later."""
    cap = int(storage.setting("MEMSIFTER_MAX_TURN_BYTES"))
    if len(text) * 4 <= cap:   # no UTF-8 character is longer than 4 bytes: surely under the cap
        return
    n = len(text.encode("utf-8", errors="surrogatepass"))
    if n > cap:
        raise InputError(f"a turn of {n} bytes: over the per-turn cap (MEMSIFTER_MAX_TURN_BYTES={cap}); raise it "
                         f"if turns this long are meant to be there", file=file, item=item, field=field)


def _opt_str(obj: dict, key: str, *, uri: str, item: str) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise InputError(f"expected str, got {type(v).__name__}", file=uri, item=item, field=key)
    return str(v)
