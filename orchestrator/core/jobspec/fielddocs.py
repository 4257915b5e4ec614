"""Field descriptions from the docstring under each field, for the JSON Schemas (`fsdpjob schema`, the docs' reference
pages) and nothing else.

pydantic's ``use_attribute_docstrings`` reads and parses each model's source file while the class is created: about
60 ms of every command's start (validate, render), for text that only a schema shows. Here the same pydantic
function fills the descriptions in when a schema is asked for, and the models are rebuilt so that it carries them."""

from __future__ import annotations

import typing
from typing import TypeVar

from pydantic import BaseModel

# The function use_attribute_docstrings=True calls (private: pinned by tests/test_render.py's golden schema).
from pydantic._internal._docs_extraction import extract_docstrings_from_cls

M = TypeVar("M", bound=type[BaseModel])


def documented(model: M) -> M:
    """``model`` and every model in its fields, each field described by its docstring (an explicit description
    stays), rebuilt from the innermost model out so that their schemas carry the text."""
    for cls in _models_inside(model):
        docs = extract_docstrings_from_cls(cls, use_inspect=True)
        for name, field in cls.model_fields.items():
            if field.description is None and name in docs and name in cls.__dict__.get("__annotations__", {}):
                field.description = docs[name]
        cls.model_rebuild(force=True)
    return model


def _models_inside(model: type[BaseModel], seen: dict | None = None) -> list[type[BaseModel]]:
    """The models reachable from ``model``'s fields, each after the models it holds (``model`` last)."""
    seen = {} if seen is None else seen
    if model in seen:
        return []
    seen[model] = None
    order: list[type[BaseModel]] = []
    for field in model.model_fields.values():
        for inner in _model_types(field.annotation):
            order += _models_inside(inner, seen)
    return [*order, model]


def _model_types(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _model_types(arg)]
