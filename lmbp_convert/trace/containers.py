"""The containers a model's inputs and outputs come in, walked one way everywhere (trace, verify, re-apply).

dicts (``ModelOutput`` is an OrderedDict), lists, tuples (namedtuples too) and dataclass instances: a model
returning ``@dataclass class Out: logits; hidden`` must have its fields seen by the trace (or an affine folded
out of a returned norm output is never put back) and compared by verification.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def children(obj: Any) -> Iterator[tuple[Any, Any]]:
    """(key, value) of each element of a container (dict key, list/tuple index, dataclass field name)."""
    if isinstance(obj, dict):
        yield from obj.items()
    elif isinstance(obj, (list, tuple)):
        yield from enumerate(obj)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield f.name, getattr(obj, f.name)


def replace_child(obj: Any, key: Any, value: Any) -> Any:
    """``obj`` with the element at ``key`` replaced (in place for dicts, lists and mutable dataclasses; a new
    tuple, namedtuple or frozen dataclass otherwise)."""
    if isinstance(obj, dict):
        obj[key] = value
        return obj
    if isinstance(obj, list):
        obj[key] = value
        return obj
    if isinstance(obj, tuple):
        items = list(obj)
        items[key] = value
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if _is_dataclass_instance(obj):
        params = getattr(type(obj), "__dataclass_params__", None)
        if params is not None and params.frozen:
            return dataclasses.replace(obj, **{key: value})
        setattr(obj, key, value)
        return obj
    return obj


def has_child(obj: Any, key: Any) -> bool:
    if isinstance(obj, dict):
        return key in obj
    if isinstance(obj, (list, tuple)):
        return isinstance(key, int) and key < len(obj)
    if _is_dataclass_instance(obj):
        return isinstance(key, str) and key in {f.name for f in dataclasses.fields(obj)}
    return False
