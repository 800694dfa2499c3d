"""The text of the JSON files the writer writes: `json.dumps(doc, indent=2, ensure_ascii=False,
default=str)`, character for character, in fewer steps.

With an indent, the standard library encodes in Python (its C encoder has no indentation), a
generator per list and dict and a `yield` per piece: the structure files of a `save_child` dump
(a node per kernel) took 5 ms of the writer's time on the bench's small model, every round's
tokens.json a list of numbers a line each. Here the pieces go into one list, and a list of
strings or of integers is joined by C code. What this does not know (a key that is not a
string, number, bool or None, a document that refers to itself) goes to `json.dumps` itself,
which writes it or raises as it always did.
"""
from __future__ import annotations

import json
from json.encoder import encode_basestring  # C; ensure_ascii=False

_INF = float("inf")


class _Unknown(Exception):
    """A document `dumps` leaves to the standard library."""


def dumps(doc) -> str:
    """`json.dumps(doc, indent=2, ensure_ascii=False, default=str)`."""
    try:
        parts: list[str] = []
        _encode(doc, "\n", parts.append)
        return "".join(parts)
    except (_Unknown, RecursionError):
        return json.dumps(doc, indent=2, ensure_ascii=False, default=str)


def _float(o: float) -> str:
    if o != o:
        return "NaN"
    if o == _INF:
        return "Infinity"
    if o == -_INF:
        return "-Infinity"
    return float.__repr__(o)


def _key(k) -> str:
    if isinstance(k, str):
        return encode_basestring(k)
    if isinstance(k, float):
        return '"' + _float(k) + '"'
    if k is True:
        return '"true"'
    if k is False:
        return '"false"'
    if k is None:
        return '"null"'
    if isinstance(k, int):
        return '"' + int.__repr__(k) + '"'
    raise _Unknown


def _encode(o, indent: str, add) -> None:
    """Append the text of `o` at the nesting `indent` ("\\n" and two spaces a level), in the
    order of checks `json`'s own encoder makes."""
    if isinstance(o, str):
        add(encode_basestring(o))
    elif o is None:
        add("null")
    elif o is True:
        add("true")
    elif o is False:
        add("false")
    elif isinstance(o, int):
        add(int.__repr__(o))
    elif isinstance(o, float):
        add(_float(o))
    elif isinstance(o, (list, tuple)):
        if not o:
            add("[]")
            return
        inner = indent + "  "
        kinds = {type(x) for x in o}
        if kinds == {str}:
            add("[" + inner + ("," + inner).join(map(encode_basestring, o)) + indent + "]")
        elif kinds == {int}:
            add("[" + inner + ("," + inner).join(map(int.__repr__, o)) + indent + "]")
        else:
            add("[" + inner)
            first = True
            for x in o:
                if first:
                    first = False
                else:
                    add("," + inner)
                _encode(x, inner, add)
            add(indent + "]")
    elif isinstance(o, dict):
        if not o:
            add("{}")
            return
        inner = indent + "  "
        opening = "{" + inner
        for k, v in o.items():
            key = encode_basestring(k) if type(k) is str else _key(k)
            if type(v) is str:  # most values of a structure file's node
                add(opening + key + ": " + encode_basestring(v))
            else:
                add(opening + key + ": ")
                _encode(v, inner, add)
            opening = "," + inner
        add(indent + "}")
    else:  # `default=str`
        add(encode_basestring(str(o)))
