"""Protobuf text format (``.prototxt``) into nested dicts: our own small parser.

Messages become ``dict[str, list[value]]`` (every field may repeat, so every field is a list);
scalars are int, float, str (quoted) or the enum identifier as str.
"""

from __future__ import annotations

import re
from typing import Any

Message = dict[str, list[Any]]
MAX_DEPTH = 100  # messages nested deeper are refused (a Caffe net nests 3 or 4 levels)

_TOKEN = re.compile(r"""\s*(?:(\#[^\n]*)                           # comment
                           |("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')  # quoted string
                           |([{}:<>;,\[\]])                         # punctuation
                           |([^\s{}:<>;,\[\]"'\#]+))                  # word or number""", re.X)


class PrototxtError(ValueError):
    """Text that is not protobuf text format; the message gives the line."""


def _tokens(text: str, where: str) -> list[tuple[str, int]]:
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise PrototxtError(f"{where} line {line}: unexpected text {text[pos:pos + 20]!r}")
        line += text.count("\n", pos, m.end())
        tok = m.group(2) or m.group(3) or m.group(4)
        if tok:
            out.append((tok, line))
        pos = m.end()
    return out


def _scalar(tok: str, where: str, line: int) -> Any:
    if tok[0] in "\"'":
        try:
            return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
        except UnicodeDecodeError as err:
            raise PrototxtError(f"{where} line {line}: string {tok} has a bad escape ({err.reason})") from None
    for conv in (int, float):
        try:
            return conv(tok)
        except ValueError:
            pass
    if tok in ("true", "True"):
        return True
    if tok in ("false", "False"):
        return False
    return tok  # an enum identifier


def parse(text: str, where: str = "prototxt") -> Message:
    """Parse protobuf text format into a Message; errors start with ``where`` (the file name)."""
    msg, pos = _message(_tokens(text, where), 0, None, where, 0, 0)
    return msg


def _message(toks: list[tuple[str, int]], pos: int, close: str | None, where: str,
             opened: int, depth: int) -> tuple[Message, int]:
    """The fields up to ``close`` (None: the end); ``opened`` is the line of the opening brace,
    ``depth`` how many messages enclose this one (at most MAX_DEPTH)."""
    if depth > MAX_DEPTH:
        raise PrototxtError(f"{where} line {opened}: messages nested deeper than {MAX_DEPTH} levels")
    msg: Message = {}
    while pos < len(toks):
        tok, line = toks[pos]
        if tok == close:
            return msg, pos + 1
        if tok in ";,":
            pos += 1
            continue
        if not re.match(r"^[A-Za-z_][\w.]*$", tok):
            raise PrototxtError(f"{where} line {line}: expected a field name, got {tok!r}")
        pos += 1
        if pos >= len(toks):
            raise PrototxtError(f"{where} line {line}: field {tok!r} has no value")
        nxt = toks[pos][0]
        if nxt == ":":
            pos += 1
            nxt = toks[pos][0] if pos < len(toks) else ""
        if nxt in ("{", "<"):
            sub, pos = _message(toks, pos + 1, "}" if nxt == "{" else ">", where, toks[pos][1], depth + 1)
            msg.setdefault(tok, []).append(sub)
        elif nxt == "[":
            pos += 1
            while pos < len(toks) and toks[pos][0] != "]":
                if toks[pos][0] != ",":
                    msg.setdefault(tok, []).append(_scalar(toks[pos][0], where, toks[pos][1]))
                pos += 1
            if pos >= len(toks):
                raise PrototxtError(f"{where} line {line}: unclosed list (no ']' before the end)")
            pos += 1
        elif nxt in ("", "}", ">", ":"):
            raise PrototxtError(f"{where} line {line}: field {tok!r} has no value")
        else:
            msg.setdefault(tok, []).append(_scalar(nxt, where, toks[pos][1]))
            pos += 1
    if close is not None:
        raise PrototxtError(f"{where} line {opened}: unclosed message (no {close!r} before the end)")
    return msg, pos


def one(msg: Message, key: str, default: Any = None) -> Any:
    """The last value of field ``key`` (protobuf's rule for a repeated scalar read as optional)."""
    vals = msg.get(key)
    return vals[-1] if vals else default
