"""Typed results that also read as the JSON they write.

A result file's keys are a published format (`vllm bench serve`'s names plus loom's), read
by scripts and notebooks as `result["p95_ttft_ms"]`. Each typed result keeps its figures in
typed fields for loom's own code, and reads by those keys too, so a script written against
the file works on the object unchanged. The view is read-only: a result is built once, at
the end of what it measures, and replaced (dataclasses.replace), never edited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any, TypeVar

V = TypeVar("V", bound="JsonView")


class JsonView(Mapping[str, Any]):
    """Mixin for a frozen dataclass: `obj[key]` is `obj.to_json()[key]`. The default layout
    is one key per field (a nested view as its own JSON); a class that writes another
    layout overrides `to_json` and `from_json` together."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls: type[V], obj: Mapping[str, Any]) -> V:
        """The fields `obj` holds (a file from an older loom lacks some: their defaults)."""
        return cls(**{f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj})

    @cached_property
    def _json(self) -> dict[str, Any]:  # once: the object is frozen
        return self.to_json()

    def __getitem__(self, key: str) -> Any:
        return self._json[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)


def plain(value: Any) -> Any:
    """A field's value as JSON: anything with a `to_json` as its JSON, lists and dicts of
    them likewise."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
