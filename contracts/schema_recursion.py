"""Recursive JSON schemas that admit no finite value.

llguidance follows a local `$ref` back to the schema it is in (a tree, a linked list: a
recursion with a way out, an optional property, an array that may be empty, an `anyOf`
alternative that ends), and builds a grammar for one with no way out too: `{"$ref": "#"}`, or an
object whose required property is the object again. Such a grammar allows no first token, or
none after `{"child":`, so the answer was an empty or cut-off 200. `endless_ref` finds them:

    ref = endless_ref(schema)   # '#/$defs/node', or None when every recursion can end

Two fixpoints over the schema's local `$ref`s. The least: a reference is finite once its
target admits a value built only from references already known finite. The greatest: every
reference is finite but those whose target admits no value even then. A root finite by the
greatest and not by the least needs an endless recursion to have a value: that is blamed; a root
without a value by the greatest too fails for other reasons, left to llguidance. Leaves are
judged leniently (any primitive type, `enum`, `const`, a type-less schema are finite; remote
`$ref`s and keywords not modelled too). The work is bounded (`MAX_VISITS` schema nodes, beyond
which nothing is blamed: a fraction of a second at worst).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MAX_VISITS = 200_000  # schema nodes visited in all (each fixpoint round walks the targets)
_COMPOSITE = ("object", "array")


class _OutOfBudget(Exception):
    pass


def endless_ref(schema: Any) -> str | None:
    """The first local `$ref` (in document order) through which `schema` admits no finite
    value, when its recursion is why it admits none; else None (finite, or not our case)."""
    refs = _local_refs(schema)
    if not refs:
        return None
    targets = {ref: _resolve(schema, ref) for ref in refs}
    checker = _Checker()
    try:
        # Greatest fixpoint: every reference finite but those whose target has no value even
        # so. A root that admits none then fails without any recursion: llguidance's to judge.
        checker.finite_refs = frozenset(refs)
        while dead := {ref for ref in checker.finite_refs
                       if targets[ref] is not _UNRESOLVED and not checker.is_finite(targets[ref])}:
            checker.finite_refs -= dead
        if not checker.is_finite(schema):
            return None
        # Least fixpoint: a reference is finite once its target admits a value built from
        # references already known finite. A root finite above but not here needs an endless
        # recursion to have a value.
        checker.finite_refs = frozenset(ref for ref in refs if targets[ref] is _UNRESOLVED)
        while grown := {ref for ref in refs if ref not in checker.finite_refs
                        and checker.is_finite(targets[ref])}:
            checker.finite_refs |= grown
        if checker.is_finite(schema):
            return None
    except _OutOfBudget:
        return None
    return next(ref for ref in refs if ref not in checker.finite_refs)


_UNRESOLVED = object()


def _local_refs(schema: Any) -> list[str]:
    """Every `$ref` of the document that points into it ("#..."), first occurrence first."""
    found: dict[str, None] = {}
    stack = [schema]
    num_visits = 0
    while stack:
        node = stack.pop()
        num_visits += 1
        if num_visits > MAX_VISITS:
            return []
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found.setdefault(ref)
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return list(found)


def _resolve(schema: Any, ref: str) -> Any:
    """The node a local JSON pointer ("#/$defs/a~1b") names, or _UNRESOLVED (an anchor, a
    pointer to nothing: llguidance's to refuse)."""
    node = schema
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return _UNRESOLVED  # a plain-name anchor ("#node")
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _UNRESOLVED
    return node


class _Checker:
    def __init__(self) -> None:
        self.finite_refs: frozenset[str] = frozenset()
        self._num_visits = 0

    def is_finite(self, node: Any) -> bool:
        """Whether `node` admits a finite value, counting a local `$ref` finite when it is in
        `finite_refs`."""
        self._num_visits += 1
        if self._num_visits > MAX_VISITS:
            raise _OutOfBudget
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: llguidance's to refuse
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in self.finite_refs:
            return False
        subs = node.get("allOf")
        if isinstance(subs, list) and not all(
                self.is_finite(sub) for sub in subs):
            return False
        for key in ("anyOf", "oneOf"):
            subs = node.get(key)
            if isinstance(subs, list) and subs and not any(
                    self.is_finite(sub) for sub in subs):
                return False
        if "const" in node or "enum" in node:
            return True
        kinds = node.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or any(kind not in _COMPOSITE for kind in kinds):
            return True  # no type (any value), or a primitive one among them
        return (("object" in kinds and self._object_is_finite(node))
                or ("array" in kinds and self._array_is_finite(node)))

    def _object_is_finite(self, node: dict[str, Any]) -> bool:
        properties = node.get("properties")
        required = node.get("required")
        if not isinstance(properties, dict) or not isinstance(required, list):
            return True
        return all(self.is_finite(properties[name])
                   for name in required if isinstance(name, str) and name in properties)

    def _array_is_finite(self, node: dict[str, Any]) -> bool:
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        if not all(self.is_finite(sub) for sub in prefix[:min_items]):
            return False
        items = node.get("items")
        return (min_items <= len(prefix) or not isinstance(items, dict | bool)
                or self.is_finite(items))
