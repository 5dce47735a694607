"""Config errors as one line each: ``path: problem``, naming the key path, the bad value and what is
allowed.  Turns pydantic's validation errors into those lines, renders values the way the user wrote
them (bounded, so a YAML alias bomb cannot make an error message explode), and never shows a secret."""

from __future__ import annotations

import contextlib
import difflib
import json
import re
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, SecretStr, ValidationError


def describe(v: Any) -> str:
    """A value as the user wrote it in YAML: strings in double quotes, null/true/false, short JSON.
    A URL's password is masked; containers are rendered only as far as the 60 characters shown (a
    YAML alias bomb expands to billions of items, and an alias can make a list contain itself)."""
    if isinstance(v, _Hidden):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(_URL_PASSWORD.sub(r"\1***@", v), ensure_ascii=False)
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(v)
    text = _short_json(v, 61)
    text = text if len(text) <= 60 else text[:57] + "..."
    kinds: dict[type, str] = {dict: "a mapping", list: "a list", tuple: "a list"}
    kind = kinds.get(type(v), type(v).__name__)
    return f"{kind} {text}"


_URL_PASSWORD = re.compile(r"(://[^/@\s:]*:)[^/@\s]*@")


class _Hidden:
    def __repr__(self) -> str:
        return "(hidden: a secret)"


_HIDDEN = _Hidden()


class _Enough(Exception):
    pass


def _short_json(v: Any, limit: int) -> str:
    """``json.dumps(v, default=str)`` cut after ``limit`` characters, walking no further than that."""
    out: list[str] = []
    size = 0

    def emit(s: str) -> None:
        nonlocal size
        out.append(s)
        size += len(s)
        if size >= limit:
            raise _Enough

    def walk(x: Any, path: set[int]) -> None:
        if isinstance(x, (dict, list, tuple)):
            if id(x) in path:  # a container holding itself (YAML aliases allow it)
                emit("...")
                return
            path.add(id(x))
            emit("{" if isinstance(x, dict) else "[")
            for i, item in enumerate(x.items() if isinstance(x, dict) else x):
                if i:
                    emit(", ")
                if isinstance(x, dict):
                    emit(json.dumps(item[0] if isinstance(item[0], str) else str(item[0]),
                                    ensure_ascii=False) + ": ")
                    item = item[1]
                walk(item, path)
            emit("}" if isinstance(x, dict) else "]")
            path.discard(id(x))
        else:
            emit(describe(x) if isinstance(x, str) or x is None or isinstance(x, (bool, int, float))
                 else json.dumps(str(x), ensure_ascii=False))

    with contextlib.suppress(_Enough):
        walk(v, set())
    return "".join(out)


def unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` so the walk below sees the structural type."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _walk(root: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None, Any, Any]:
    """Follow a pydantic error location through the model classes.

    Returns (path parts, model owning the last key, its FieldInfo or None, the annotation there).
    Elements left once a scalar is reached are union-member tags ("int", "str", ...), not keys: dropped.
    """
    parts: list[str] = []
    tp: Any = root
    owner, field = None, None
    for el in loc:
        tp = unwrap(tp)
        if is_model(tp):
            owner = tp
            field = next((f for n, f in tp.model_fields.items() if el in (n, f.alias)), None)
            parts.append(str(el))
            if field is None:
                return parts, owner, None, None
            tp = field.annotation
        elif get_origin(tp) in (list, tuple) and isinstance(el, int):
            parts.append(f"[{el}]")
            tp = get_args(tp)[0]
        elif get_origin(tp) in (dict, Mapping):
            parts.append(str(el))
            tp = get_args(tp)[1]
        else:
            break
    return parts, owner, field, unwrap(tp)


def join_path(parts: list[str] | tuple[str, ...]) -> str:
    return "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(parts))


def _bounds(field: Any) -> str:
    lo = hi = None
    for m in getattr(field, "metadata", ()):
        lo = getattr(m, "ge", lo)
        hi = getattr(m, "le", hi)
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else "")


def suggest(word: Any, allowed: list[str]) -> str:
    """A did-you-mean hint.  Only names with the same first letter: typos rarely hit it, and "gpu" must
    not be answered with "cpu"."""
    same = [a for a in allowed if isinstance(word, str) and a[:1].lower() == word[:1].lower()]
    close = difflib.get_close_matches(word, same, n=1) if same else []
    return f'; did you mean "{close[0]}"?' if close else ""


_EXPECT = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "dict_type": "a mapping",
    "model_type": "a mapping", "model_attributes_type": "a mapping", "list_type": "a list",
    "tuple_type": "a list", "none_required": "null", "url_type": "a URL", "url_parsing": "a URL",
}


def _message(err: Mapping[str, Any], owner: type[BaseModel] | None, field: Any, tp: Any) -> str:
    kind, got, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "missing":
        return "missing required " + ("section" if is_model(tp) else "key")
    if kind == "extra_forbidden":
        keys = list(owner.model_fields) if owner else []
        key = err["loc"][-1]
        return "unknown key" + (suggest(key, keys) or f"; allowed keys: {', '.join(keys)}")
    if kind in ("size", "kvtier"):
        return str(err["msg"])
    if kind == "invalid_key":
        return f"keys must be strings, got {describe(got)}"
    if kind == "literal_error":
        values = [str(v) for v in get_args(tp)] if get_origin(tp) is Literal else []
        allowed = ", ".join(json.dumps(v) for v in values) or ctx.get("expected", "?")
        return f"expected one of {allowed}, got {describe(got)}{suggest(got, values)}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        noun = "an integer" if isinstance(got, int) else "a number"
        return f"expected {noun}{_bounds(field) or ' ' + err['msg'].split('Input should be ')[-1]}, got {got!r}"
    if kind == "string_too_short":
        n = ctx.get("min_length", 1)
        return f"expected a {'non-empty string' if n == 1 else f'string of at least {n} characters'}, got {describe(got)}"
    if kind == "string_pattern_mismatch":
        return f"expected a name matching {ctx.get('pattern')}, got {describe(got)}"
    if kind in _EXPECT:
        bounds = _bounds(field) if kind.startswith(("int", "float")) else ""
        return f"expected {_EXPECT[kind]}{bounds}, got {describe(got)}"
    text = str(ctx["error"]) if "error" in ctx else err["msg"].removeprefix("Value error, ")
    return text if "got" in text or isinstance(got, (dict, BaseModel)) else f"{text}, got {describe(got)}"


def problems_of(exc: ValidationError, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(path, problem) per error; errors from the members of one union at one path are merged."""
    out: dict[str, list[str]] = {}
    for err in exc.errors(include_url=False):
        loc = err["loc"]
        if err["type"] == "invalid_key" and loc:
            # The bad key is not a path of the schema: name the mapping that holds it.
            loc = loc[:-1]
        parts, owner, field, tp = _walk(root, loc)
        path = join_path([*prefix, *parts]) or "(top level)"
        if tp is SecretStr and "input" in err:  # a password typed as a number is still a password
            err = {**err, "input": _HIDDEN}
        out.setdefault(path, []).append(_URL_PASSWORD.sub(r"\1***@", _message(err, owner, field, tp)))
    merged: list[tuple[str, str]] = []
    for path, msgs in out.items():
        if len(msgs) > 1 and all(m.startswith("expected ") for m in msgs):
            got = msgs[0].rsplit(", got ", 1)[-1]
            msgs = ["expected " + " or ".join(m[9:].rsplit(", got ", 1)[0] for m in msgs) + ", got " + got]
        merged.extend((path, m) for m in dict.fromkeys(msgs))
    return merged
