"""What a side-task class declares: its options, peak memory and the device it needs.

Options are checked at submit against the task's ``__init__`` signature, so a
misspelt or mistyped option is refused before any process starts instead of
failing in a worker. Two readers give the same :class:`Declared`:

* :func:`declared` inspects an imported class (the ``freeride submit`` client
  and the worker, which import the task anyway);
* :func:`declared_in_source` reads the class's source without importing it
  (the manager, whose event loop must not stall on importing torch), following
  base classes through the module's own imports. It gives up (``None``) on
  anything it cannot read statically; the worker's check then catches what it
  missed, and fails the task at once.
"""

from __future__ import annotations

import ast
import inspect
import operator
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

__all__ = ["Declared", "OptionError", "OptionInfo", "OptionValue", "declared", "declared_in_source", "validate_options"]

OptionValue = str | int | float | bool
"""What an option may be on the wire (see :data:`freeride.protocol.Options`)."""

_TYPES = ("int", "float", "bool", "str")
_REQUIRED = inspect.Parameter.empty


class OptionError(ValueError):
    """Options that do not match the task's ``__init__``; the message lists what it accepts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionInfo:
    """One keyword argument of a task's ``__init__``."""

    name: str
    type: str
    """``int``, ``float``, ``bool``, ``str``, or ``any`` (annotated otherwise: not checked)."""
    default: object = _REQUIRED
    """The default, or ``inspect.Parameter.empty`` for a required option."""

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def __str__(self) -> str:
        return f"{self.name}: {self.type}" + ("" if self.required else f" = {self.default!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Declared:
    """What a task class declares."""

    name: str
    """The class's name, for messages."""
    options: tuple[OptionInfo, ...] = ()
    open: bool = False
    """``__init__`` takes ``**kwargs``: names are not checked."""
    peak_memory: int = -1
    """The class attribute ``peak_memory`` (-1: undeclared)."""
    device_kind: str = "any"
    """The class attribute ``device_kind``: ``any`` or ``gpu``."""


def _type_name(annotation: object) -> str:
    if isinstance(annotation, type) and annotation.__name__ in _TYPES:
        return annotation.__name__
    if isinstance(annotation, str) and annotation.strip() in _TYPES:
        return annotation.strip()
    return "any"


def declared(cls: type) -> Declared:
    """What the imported task class ``cls`` declares."""
    init = next((vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), object.__init__)
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # names only the task's own module resolves: fall back to the raw annotations
        hints = {}
    options: list[OptionInfo] = []
    is_open = False
    if init is not object.__init__:
        for param in inspect.signature(cls).parameters.values():
            if param.kind is param.VAR_KEYWORD:
                is_open = True
            elif param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                kind = _type_name(hints.get(param.name, param.annotation))
                options.append(OptionInfo(name=param.name, type=kind, default=param.default))
    return Declared(
        name=cls.__name__,
        options=tuple(options),
        open=is_open,
        peak_memory=int(getattr(cls, "peak_memory", -1)),
        device_kind=str(getattr(cls, "device_kind", "any")),
    )


def _convert(info: OptionInfo, value: OptionValue) -> OptionValue:
    """``value`` as ``info``'s type; raises ``ValueError`` if it is not one."""
    match info.type:
        case "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
        case "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        case "float":
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        case "str":
            # the command line reads 007 as an int: a str option takes it back as written
            return value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
        case _:
            return value
    raise ValueError(f"{info.name} must be {info.type}, got {type(value).__name__} {value!r}")


def validate_options(decl: Declared, options: Mapping[str, OptionValue]) -> dict[str, OptionValue]:
    """``options`` converted to the declared types (an int for a float option, "007" for a str one).

    Raises:
        OptionError: an unknown name, a missing required option, or a value of
            the wrong type; the message lists every option the task accepts.
    """
    known = {info.name: info for info in decl.options}
    problems = [f"unknown option {name!r}" for name in options if name not in known and not decl.open]
    problems += [
        f"missing required option {info.name!r}" for info in decl.options if info.required and info.name not in options
    ]
    converted: dict[str, OptionValue] = {}
    for name, value in options.items():
        try:
            converted[name] = _convert(known[name], value) if name in known else value
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        accepted = ", ".join(str(info) for info in decl.options) or "none"
        raise OptionError(f"{decl.name}: {'; '.join(problems)}. It accepts: {accepted}")
    return converted


# -- reading a class from its source -----------------------------------------------------

_MAX_DEPTH = 12
_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.FloorDiv: operator.floordiv,
}
_BASE_CLASS = ("freeride.sidetask", "IterativeTask")
"""Where the search ends: the base declares no options, no peak and any device."""


class _Unreadable(Exception):
    pass


def _value(node: ast.expr | None) -> Any:
    """A literal, or integer arithmetic on literals (``2 << 30``)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _value(node.left), _value(node.right)
        if not (isinstance(left, int) and isinstance(right, int)) or (isinstance(node.op, ast.Pow) and right > 64):
            raise _Unreadable("not integer arithmetic")
        return _BINOPS[type(node.op)](left, right)
    if node is None:
        raise _Unreadable("no value")
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _Unreadable(ast.unparse(node)) from None


def _source_of(module: str) -> Path | None:
    """The file of ``module`` found the way import would, without importing a package on the way."""
    locations: list[str] | None = None
    spec = None
    parts = module.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), locations if i else sys.path)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


class _Reader:
    def __init__(self) -> None:
        self._trees: dict[Path, ast.Module] = {}

    def tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._trees[path]

    def declared(self, module: str, path: Path, cls_name: str, depth: int = 0) -> Declared:
        if depth > _MAX_DEPTH:
            raise _Unreadable("too deep")
        tree = self.tree(path)
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
        if node is None:  # a package's __init__ re-exports it: read it where it is defined
            return self._imported(module, path, tree, cls_name, depth)
        found: dict[str, Any] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                found["init"] = stmt
            target: ast.expr | None = None
            value: ast.expr | None = None
            if isinstance(stmt, ast.AnnAssign):
                target, value = stmt.target, stmt.value
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
            if isinstance(target, ast.Name) and target.id in ("peak_memory", "device_kind"):
                found[target.id] = _value(value)
        if ("init" in found and "peak_memory" in found and "device_kind" in found) or not node.bases:
            base = Declared(name=cls_name)  # all its own (or a mixin of plain object: nothing inherited)
        elif len(node.bases) == 1:
            base = self._base(module, path, tree, node.bases[0], depth)
        else:
            # as the method resolution order would find them, for mixins that do not override each other
            parts = [self._base(module, path, tree, b, depth) for b in node.bases]
            with_options = [d for d in parts if d.options or d.open]
            base = Declared(
                name=cls_name,
                options=with_options[0].options if with_options else (),
                open=with_options[0].open if with_options else False,
                peak_memory=next((d.peak_memory for d in parts if d.peak_memory != -1), -1),
                device_kind=next((d.device_kind for d in parts if d.device_kind != "any"), "any"),
            )
        options, is_open = base.options, base.open
        if "init" in found:
            options, is_open = _options(found["init"])
        return Declared(
            name=cls_name,
            options=options,
            open=is_open,
            peak_memory=int(found.get("peak_memory", base.peak_memory)),
            device_kind=str(found.get("device_kind", base.device_kind)),
        )

    def _base(self, module: str, path: Path, tree: ast.Module, expr: ast.expr, depth: int) -> Declared:
        if not isinstance(expr, ast.Name):
            raise _Unreadable(f"base {ast.unparse(expr)}")
        name = expr.id
        if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
            return self.declared(module, path, name, depth + 1)
        return self._imported(module, path, tree, name, depth)

    def _imported(self, module: str, path: Path, tree: ast.Module, name: str, depth: int) -> Declared:
        """The class ``name`` that ``module`` imports by name (``from x import name``), read where it is defined."""
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom) and any((a.asname or a.name) == name for a in stmt.names):
                original = next(a.name for a in stmt.names if (a.asname or a.name) == name)
                source = stmt.module or ""
                if stmt.level:
                    package = module.rsplit(".", stmt.level)[0] if path.name != "__init__.py" else module
                    if stmt.level > 1:
                        package = package.rsplit(".", stmt.level - 1)[0]
                    source = f"{package}.{source}" if source else package
                if (source, original) == _BASE_CLASS or (source, original) == ("freeride", "IterativeTask"):
                    return Declared(name=original)
                found = _source_of(source)
                if found is None:
                    raise _Unreadable(f"cannot find module {source}")
                return self.declared(source, found, original, depth + 1)
        raise _Unreadable(f"{name} is neither defined in {path} nor imported there by name")


def _options(init: ast.FunctionDef) -> tuple[tuple[OptionInfo, ...], bool]:
    args = init.args
    positional = [*args.posonlyargs, *args.args][1:]
    if args.posonlyargs[1:]:
        raise _Unreadable("positional-only options")
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = [*zip(positional, defaults, strict=True), *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    options = []
    for arg, default in pairs:
        annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        value = _REQUIRED if default is None else _value(default)
        options.append(OptionInfo(name=arg.arg, type=_type_name(annotation), default=value))
    return tuple(options), args.kwarg is not None


def declared_in_source(target: str) -> Declared | None:
    """What the class ``module:Class`` (or ``file.py:Class``) declares, read from source; None if unreadable."""
    module, _, cls_name = target.rpartition(":")
    try:
        if module.endswith(".py"):
            path: Path | None = Path(module)
            module = Path(module).stem
        else:
            path = _source_of(module)
        if path is None:
            return None
        return _Reader().declared(module, path, cls_name)
    except (_Unreadable, OSError, SyntaxError, ValueError, ImportError):
        return None
