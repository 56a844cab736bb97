"""docs/reference/configuration.md: every key of the deployment config, from its models.

The models are :class:`stack.config.DeploymentConfig` and the sections it nests (the dispatch
queue's :class:`~stack.dispatch.DispatchSpec` and its readiness among them). The free-form
``launch`` mapping is documented by :class:`stack.config.LaunchConfig`, which the launcher's
keys are held to (tests/unit/test_reference_docs.py). Defaults are read from a config that
leaves the key out (so ``router.dispatch`` shows the router's default queue, not the
simulator's); a field's ``shown_default`` (``json_schema_extra``) replaces it where the default
depends on the engine or the pool.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from stack.config import DeploymentConfig, LaunchConfig
from stack.reference.markdown import HEADER, anchor, code, table, text, value

#: free-form mappings documented by a model that does not validate them: (model, field) -> model
FREE_FORM: dict[tuple[type[BaseModel], str], type[BaseModel]] = {(DeploymentConfig, "launch"): LaunchConfig}


@dataclass(frozen=True)
class Key:
    """One row: a key's YAML path, type, default and description."""

    path: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    """One model's keys under a YAML path."""

    path: str
    model: type[BaseModel]
    keys: tuple[Key, ...]
    #: defaults read from an instance (a section the config may leave out) or from the model
    from_instance: bool


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation names (``X``, ``X | None``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for a in typing.get_args(annotation):
        out += _models_in(a)
    return out


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is list:
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if typing.get_origin(a) is not Literal)


def type_name(annotation: Any) -> str:
    """A YAML-minded name of a field's type: ``int or null``, ``"a" or "b"``, ``list[str]``,
    ``mapping``. "or", not a pipe: a pipe in a table cell must be escaped, and MkDocs shows the
    escape inside a code span."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " or ".join(value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return f"mapping of {type_name(args[1])}" if args and args[1] is not Any else "mapping"
    if origin is typing.Annotated:
        return type_name(args[0])
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return "section"
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def _shown_default(f: FieldInfo) -> str | None:
    extra = f.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("shown_default"), str):
        return extra["shown_default"]
    return None


def _default(f: FieldInfo, instance: BaseModel | None, name: str) -> str:
    shown = _shown_default(f)
    if shown is not None:
        return shown
    if instance is not None:
        v = getattr(instance, name)
    elif f.is_required():
        return "required"
    else:
        v = f.get_default(call_default_factory=True)
        if v is PydanticUndefined:
            return "required"
    if isinstance(v, BaseModel):
        return "see its section"
    return code(value(v))


#: annotated_types' bounds, as the type column writes them
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _type(f: FieldInfo, sub: str | None) -> str:
    out = code(type_name(f.annotation))
    bounds = [f"{op} {value(getattr(m, k))}" for m in f.metadata for k, op in _BOUNDS if hasattr(m, k)]
    if bounds:
        out += ", " + ", ".join(bounds)
    if sub is not None:
        out += f" (see [`{sub}`](#{anchor(sub)}))"
    return out


def sections(
    model: type[BaseModel] = DeploymentConfig, path: str = "", instance: BaseModel | None = None
) -> Iterator[Section]:
    """``model``'s section and those it nests, depth first in declaration order."""
    if instance is None and not path:
        instance = model()
    keys: list[Key] = []
    nested: list[tuple[type[BaseModel], str, BaseModel | None]] = []
    for name, f in model.model_fields.items():
        p = f"{path}.{name}" if path else name
        documented = FREE_FORM.get((model, name))
        subs = [documented] if documented is not None else _models_in(f.annotation)
        sub_path = (p + "[]") if _is_list(f.annotation) else p
        keys.append(
            Key(
                p,
                _type(f, sub_path if subs else None),
                _default(f, instance, name),
                text(f.description),
            )
        )
        for sub in subs:
            v = getattr(instance, name, None) if instance is not None else None
            nested.append((sub, sub_path, v if isinstance(v, sub) else None))
    yield Section(path, model, tuple(keys), instance is not None)
    for sub, sub_path, v in nested:
        yield from sections(sub, sub_path, v)


def _intro(s: Section) -> str:
    doc = s.model.__doc__ if s.model.__module__ == "stack.config" else None
    parts = [text(doc)] if doc and doc is not BaseModel.__doc__ else []
    parts.append(
        "Defaults: those of a config that leaves the key out."
        if s.from_instance
        else "Defaults: each key's when the key is left out."
    )
    return "\n\n".join(parts) + "\n"


def render() -> str:
    """The page."""
    out = [
        HEADER,
        "# Configuration reference\n",
        "Every key of the deployment YAML (`smetric router --config`, `smetric up --config`; "
        "`stack/config.py`), by its path. A key left out takes its default. Unknown keys are an "
        "error under `router` (with the nearest valid key named) and kept elsewhere.\n",
    ]
    for s in sections():
        title = s.path or "Top level"
        out.append(f"## {code(s.path) if s.path else title}\n")
        out.append(_intro(s))
        out.append(
            table(
                ("Key", "Type", "Default", "Description"),
                ((code(k.path), k.type, k.default, k.description) for k in s.keys),
            )
        )
    return "\n".join(out)


def undocumented() -> list[str]:
    """The paths of keys with no description (the test holds this empty)."""
    return [k.path for s in sections() for k in s.keys if not k.description.strip()]
