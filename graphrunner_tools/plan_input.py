"""The input of ``graphrunner plan``: the observed batch sizes in a file, read and validated.

:func:`load_sizes` reads every format the command accepts:

- text: one int per line (blank lines and ``#`` comments ignored);
- JSON: a list of ints; ``{"schedule": [...]}``; a loadtest JSON whose levels carry their
  per-step ``schedule`` (``{"levels": [{"concurrency": C, "schedule": [...]}, ...]}``;
  ``level=C`` takes one level, else all); or named dims ``{dim: [sizes...]}``.

A file that starts with ``[`` or ``{`` is JSON, anything else text. Every size must be an int
from 0 (an idle step, left out of the plan) to :data:`MAX_SIZE`, and at least one must be
>= 1. Anything else is a :class:`PlanInputError` (a ``ValueError``) whose message starts with
``FILE:LINE:`` (the line of the offending entry; the JSON parser's line for a syntax error; line 1
for an empty file) or ``FILE:`` where there is no line (a file that cannot be read, a directory),
says what was wrong and what to pass instead. The CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import bisect
import json
import json.decoder
import json.scanner
from collections.abc import Sequence
from typing import Any

from graphrunner.buckets import MAX_LADDER_BATCH

__all__ = ["PlanInputError", "load_sizes", "MAX_SIZE"]

#: The largest batch size ``graphrunner plan`` accepts: the largest ``max_batch`` for which
#: :func:`graphrunner.default_buckets` builds vLLM's ladder (the plan's comparison). A
#: runner's key space takes any size on one rank, and sizes below ``2**32`` in the first dim
#: across ranks (:mod:`graphrunner.keys`); this bound is below both.
MAX_SIZE = MAX_LADDER_BATCH

_WHAT = "one batch size per served call: ints >= 0 (0 is an idle step)"
_FORMATS = (
    'one int per line, a JSON list of ints, {"schedule": [...]}, a loadtest JSON with per-level '
    "schedules, or {dim: [sizes...]}"
)


class PlanInputError(ValueError):
    """A sizes file that cannot be read or planned: the message names the file (and the line)
    and what to pass instead (the CLI prints it as one line, exit 2)."""


class _Located(list):
    """A JSON array with the line of each element (``lines``) and of its opening bracket (``line``)."""

    lines: list[int]
    line: int


class _LocatedDict(dict):
    """A JSON object with the line of each key's value (``lines``) and of its opening brace (``line``)."""

    lines: dict[str, int]
    line: int


class _Lines:
    """Offset -> 1-based line number of a text."""

    def __init__(self, text: str) -> None:
        self.breaks = [i for i, ch in enumerate(text) if ch == "\n"]

    def __call__(self, offset: int) -> int:
        return bisect.bisect_left(self.breaks, offset) + 1


def _parse_json(text: str, lines: _Lines) -> Any:
    """``json.loads(text)``, where every array and object also carries the lines of its elements."""
    decoder = json.JSONDecoder()

    def parse_array(s_and_end: tuple[str, int], scan_once: Any) -> tuple[list, int]:
        starts: list[int] = []

        def scan(s: str, idx: int) -> Any:
            starts.append(idx)
            return scan_once(s, idx)

        values, end = json.decoder.JSONArray(s_and_end, scan)
        out = _Located(values)
        out.lines, out.line = [lines(i) for i in starts], lines(s_and_end[1] - 1)
        return out, end

    def parse_object(
        s_and_end: tuple[str, int],
        strict: bool,
        scan_once: Any,
        object_hook: Any,
        object_pairs_hook: Any,
        memo: Any = None,
    ) -> tuple[dict, int]:
        starts: list[int] = []

        def scan(s: str, idx: int) -> Any:
            starts.append(idx)
            return scan_once(s, idx)

        pairs, end = json.decoder.JSONObject(s_and_end, strict, scan, None, lambda p: p, memo)
        out = _LocatedDict(pairs)
        out.lines = {k: lines(i) for (k, _), i in zip(pairs, starts)}
        out.line = lines(s_and_end[1] - 1)
        return out, end

    decoder.parse_array, decoder.parse_object = parse_array, parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder.decode(text)


def _line_of(container: Any, key: Any, default: int) -> int:
    lines = getattr(container, "lines", None)
    if isinstance(lines, list) and isinstance(key, int) and 0 <= key < len(lines):
        return lines[key]
    if isinstance(lines, dict) and key in lines:
        return lines[key]
    return getattr(container, "line", default)


def _size(path: str, line: int, where: str, value: Any) -> int:
    """One observed size, validated: an int in ``[0, MAX_SIZE]`` (``where``: how the message names
    the entry, e.g. ``"levels[0].schedule[3] = "``; empty on a text file's line)."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise PlanInputError(f"{path}:{line}: {where}{shown} is not an int; the file holds {_WHAT}")
    if value < 0:
        raise PlanInputError(f"{path}:{line}: {where}{value} is negative; a batch size is >= 0 (0 is an idle step)")
    if value > MAX_SIZE:
        raise PlanInputError(
            f"{path}:{line}: {where}{value:,} is above {MAX_SIZE:,}, the largest batch size "
            "graphrunner plan accepts (gr.default_buckets builds vLLM's ladder up to it for the "
            "comparison); is it a token count or an id rather than a batch size?"
        )
    return value


def _sizes(path: str, values: Any, where: str, line: int) -> list[int]:
    """A JSON array of sizes (``where`` names it), each validated, at least one >= 1."""
    name = where or "the list"
    if not isinstance(values, list):
        raise PlanInputError(f"{path}:{line}: {name} is {_kind(values)}; expected a list of batch sizes ({_WHAT})")
    out = [_size(path, _line_of(values, i, line), f"{where}[{i}] = ", v) for i, v in enumerate(values)]
    if not any(out):
        what = "empty" if not out else "all 0 (idle steps)"
        raise PlanInputError(
            f"{path}:{line}: {name} is {what}: no batch size >= 1 to plan for; pass the batch size of each served call"
        )
    return out


def _kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({json.dumps(value)[:40]})"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return f"a number ({value!r})"


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except IsADirectoryError:
        raise PlanInputError(f"{path}: is a directory; pass a file of batch sizes ({_FORMATS})") from None
    except OSError as exc:
        raise PlanInputError(
            f"{path}: cannot read it ({exc.strerror or exc}); pass a readable file of batch sizes"
        ) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise PlanInputError(
            f"{path}:{line}: not UTF-8 text (byte {exc.start}: {raw[exc.start]:#04x}); pass a "
            f"text or JSON file of batch sizes ({_FORMATS})"
        ) from None


def load_sizes(path: str, level: int | None = None) -> list[int] | dict[str, list[int]]:
    """The observed sizes in ``path`` (see the module docstring): a list of ints, or ``{dim: [...]}``
    for named dims. ``level``: a loadtest JSON's level of that concurrency only.

    Raises :class:`PlanInputError` naming the file and the line of the first problem: a file that
    cannot be read or is not UTF-8, empty, a line or entry that is not an int, a negative size, a
    size above :data:`MAX_SIZE`, no size >= 1, invalid JSON, or JSON of another shape."""
    text = _read(path)
    if not text.strip():
        raise PlanInputError(f"{path}:1: the file is empty; it holds {_WHAT}, as {_FORMATS}")
    if text.lstrip()[:1] not in ("[", "{"):
        if level is not None:
            raise PlanInputError(f"{path}:1: --level {level} needs a loadtest JSON; this is a text file of sizes")
        return _text_sizes(path, text)
    lines = _Lines(text)
    try:
        data = _parse_json(text, lines)
    except json.JSONDecodeError as exc:
        raise PlanInputError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); expected {_FORMATS}"
        ) from None
    except RecursionError:
        raise PlanInputError(f"{path}:1: JSON nested too deeply; expected {_FORMATS}") from None
    return _json_sizes(path, data, level)


def _text_sizes(path: str, text: str) -> list[int]:
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            n = int(line, 10)
        except ValueError:
            raise PlanInputError(
                f"{path}:{no}: {line!r} is not an int; the file holds one batch size per line (or a JSON list)"
            ) from None
        out.append(_size(path, no, "", n))
    if not any(out):
        what = "holds only blank lines and comments" if not out else "holds only 0s (idle steps)"
        raise PlanInputError(
            f"{path}:{len(text.splitlines())}: the file {what}: no batch size >= 1 to plan for; "
            "pass the batch size of each served call, one per line"
        )
    return out


def _json_sizes(path: str, data: Any, level: int | None) -> list[int] | dict[str, list[int]]:
    top = getattr(data, "line", 1)
    is_loadtest = isinstance(data, dict) and "levels" in data
    if level is not None and not is_loadtest:
        raise PlanInputError(f"{path}:{top}: --level {level} needs a loadtest JSON (with 'levels'); this file has none")
    if isinstance(data, list):
        return _sizes(path, data, "", top)
    if is_loadtest:
        return _loadtest_sizes(path, data, level)
    if isinstance(data, dict) and "schedule" in data:
        return _sizes(path, data["schedule"], "schedule", _line_of(data, "schedule", top))
    if isinstance(data, dict) and data:
        out: dict[str, list[int]] = {}
        for dim, values in data.items():
            line = _line_of(data, dim, top)
            if not dim.isidentifier():
                raise PlanInputError(
                    f"{path}:{line}: {dim!r} is not a dim name (an identifier such as 'reqs'); expected {_FORMATS}"
                )
            out[dim] = _sizes(path, values, dim, line)
        return out
    raise PlanInputError(
        f"{path}:{top}: the JSON is {_kind(data)}{' with nothing in it' if not data else ''}; expected {_FORMATS}"
    )


def _loadtest_sizes(path: str, data: dict[str, Any], level: int | None) -> list[int]:
    top = getattr(data, "line", 1)
    levels = data["levels"]
    where = _line_of(data, "levels", top)
    if not isinstance(levels, list) or not all(isinstance(lv, dict) for lv in levels):
        raise PlanInputError(
            f"{path}:{where}: 'levels' must be a list of objects "
            '({"concurrency": C, "schedule": [...]}), as a loadtest JSON writes it'
        )
    chosen: Sequence[tuple[int, dict[str, Any]]] = list(enumerate(levels))
    if level is not None:
        chosen = [(i, lv) for i, lv in chosen if lv.get("concurrency") == level]
        if not chosen:
            have = [lv.get("concurrency") for lv in levels]
            raise PlanInputError(f"{path}:{where}: --level {level}: no level of concurrency {level} (levels: {have})")
    if not any("schedule" in lv for _, lv in chosen):
        raise PlanInputError(
            f"{path}:{where}: a loadtest JSON without per-step schedules (levels[].schedule); "
            "pass a file of sizes (one per line) or a JSON list instead"
        )
    out: list[int] = []
    for i, lv in chosen:
        if "schedule" not in lv:
            continue
        line = _line_of(lv, "schedule", _line_of(levels, i, where))
        sched = lv["schedule"]
        if not isinstance(sched, list):
            raise PlanInputError(
                f"{path}:{line}: levels[{i}].schedule is {_kind(sched)}; expected a list of batch sizes ({_WHAT})"
            )
        out.extend(
            _size(path, _line_of(sched, j, line), f"levels[{i}].schedule[{j}] = ", v) for j, v in enumerate(sched)
        )
    if not any(out):
        raise PlanInputError(f"{path}:{where}: the schedules hold no batch size >= 1 to plan for")
    return out
