"""Every name `pjit_pipe` exports has a structured (Google-style) docstring.

A function or public method needs `Args:` naming exactly its parameters
(besides self/cls) when it has any, and `Returns:` (or `Yields:` for an
iterator) unless it is annotated `-> None`. A `Raises:` section is optional,
but each class it names must exist: in `pjit_pipe.errors`, among the builtins,
or in the defining module (e.g. `WorkerFailure`, `PlanError`). A dataclass's
`Attributes:` names exactly its public fields; an exception class needs a
one-line summary. Only `inspect` is used: nothing is traced or compiled.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Callable

import pytest

import pjit_pipe
from pjit_pipe import errors

_HEADER = re.compile(r"(Args|Returns|Yields|Raises|Attributes|Examples?|Notes?):")
_ENTRY = re.compile(r"(\*{0,2}[A-Za-z_][\w.]*)(?: \([^)]*\))?:(?:\s|$)")
_ITERATOR = re.compile(r"^(?:typing\.|collections\.abc\.)?(?:Async)?(?:Iterator|Generator)\b")


def sections(doc: str) -> dict[str, list[str]]:
    """Section name -> its body lines, for the sections of a Google-style docstring."""
    out: dict[str, list[str]] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        if _HEADER.fullmatch(line):
            current = line[:-1]
            out[current] = []
        elif current is not None and line and not line[0].isspace():
            current = None  # unindented prose ends a section
        elif current is not None:
            out[current].append(line)
    return out


def entries(body: list[str]) -> list[str | None]:
    """The names of a section's entries (`name: text`); None for a malformed entry."""
    indents = [len(line) - len(line.lstrip()) for line in body if line.strip()]
    if not indents:
        return []
    base = min(indents)
    names: list[str | None] = []
    for line in body:
        if line.strip() and len(line) - len(line.lstrip()) == base:
            match = _ENTRY.match(line.strip())
            names.append(match.group(1) if match else None)
    return names


def _raisable(name: str, module: str) -> bool:
    """Whether `name` is an exception class pjit_pipe.errors, builtins or `module` defines."""
    for namespace in (errors, builtins, sys.modules.get(module)):
        value = getattr(namespace, name, None)
        if isinstance(value, type) and issubclass(value, BaseException):
            return True
    return False


def _check_raises(where: str, found: dict[str, list[str]], module: str) -> list[str]:
    problems = []
    for name in entries(found.get("Raises", [])):
        if name is None:
            problems.append(f"{where}: a Raises entry is not 'ErrorClass: when'")
        elif not _raisable(name, module):
            problems.append(f"{where}: Raises names {name}, which is no exception class here")
    return problems


def _check_args(where: str, found: dict[str, list[str]], params: list[str]) -> list[str]:
    documented = entries(found.get("Args", []))
    if params and "Args" not in found:
        return [f"{where}: no Args section for {params}"]
    if None in documented:
        return [f"{where}: an Args entry is not 'name: text'"]
    names = [n.lstrip("*") for n in documented if n is not None]
    if sorted(names) != sorted(params):
        return [f"{where}: Args documents {names}, the signature has {params}"]
    return []


def check_function(where: str, fn: Callable, bound: bool) -> list[str]:
    """Problems with the docstring of `fn` (`bound`: its first parameter is self/cls)."""
    if not (fn.__doc__ or "").strip():
        return [f"{where}: no docstring"]
    found = sections(fn.__doc__)
    signature = inspect.signature(fn)
    params = list(signature.parameters)[1:] if bound else list(signature.parameters)
    problems = _check_args(where, found, params)
    returns = signature.return_annotation
    if returns not in (None, "None"):
        wanted = ("Returns", "Yields") if _ITERATOR.match(str(returns)) else ("Returns",)
        if not any(found.get(s) for s in wanted):
            problems.append(f"{where}: returns {returns}, but no {' or '.join(wanted)} section")
    return problems + _check_raises(where, found, fn.__module__)


def _own_doc(cls: type) -> str:
    """The class's own docstring (not a base's, nor the signature dataclasses write)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def _member_function(member: object) -> tuple[Callable, bool] | None:
    """(function, bound) for a public method, classmethod, staticmethod or property."""
    if isinstance(member, property):
        return member.fget, True
    if isinstance(member, functools.cached_property):
        return member.func, True
    if isinstance(member, classmethod):
        return member.__func__, True
    if isinstance(member, staticmethod):
        return member.__func__, False
    if inspect.isfunction(member):
        return member, True
    return None


def check_class(name: str, cls: type) -> list[str]:
    """Problems with the docstrings of an exported class and its public members."""
    doc = _own_doc(cls)
    if not doc.strip():
        return [f"{name}: no class docstring"]
    if issubclass(cls, BaseException):
        summary = inspect.cleandoc(doc).splitlines()[0]
        return [] if summary.endswith(".") else [f"{name}: the first line is no sentence"]
    found = sections(doc)
    problems = _check_raises(name, found, cls.__module__)
    if dataclasses.is_dataclass(cls):
        fields = sorted(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))
        documented = entries(found.get("Attributes", []))
        if sorted(n for n in documented if n) != fields or None in documented:
            problems.append(f"{name}: Attributes documents {documented}, the fields are {fields}")
    elif "__init__" in cls.__dict__:  # its Args and Raises: in the class or __init__ docstring
        init = cls.__dict__["__init__"]
        both = sections(doc)  # each docstring dedented on its own, then their sections joined
        for section, body in sections(init.__doc__ or "").items():
            both.setdefault(section, []).extend(body)
        params = list(inspect.signature(init).parameters)[1:]
        problems += _check_args(f"{name}()", both, params)
        problems += _check_raises(f"{name}()", both, cls.__module__)
    for attr, member in sorted(cls.__dict__.items()):
        public = not attr.startswith("_") or attr == "__call__"  # a step is called
        function = _member_function(member) if public else None
        # Members a library writes (flax.struct's `replace`) carry that library's docstring.
        if function is not None and function[0].__module__.startswith("pjit_pipe"):
            problems += check_function(f"{name}.{attr}", *function)
    return problems


@pytest.mark.parametrize("name", sorted(pjit_pipe.__all__))
def test_export_has_structured_docstrings(name: str) -> None:
    value = getattr(pjit_pipe, name)
    if isinstance(value, type):
        problems = check_class(name, value)
    else:
        problems = check_function(name, value, bound=False)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_bad_docstrings() -> None:
    """The checker is not vacuous: each kind of gap is reported."""

    def undocumented(x: int) -> int:
        return x

    def no_sections(x: int) -> int:
        """Something."""
        return x

    def wrong_args(x: int, y: int) -> int:
        """Something.

        Args:
            x: A number.
            z: Not a parameter.

        Returns:
            A number.
        """
        return x + y

    def unknown_raise(x: int) -> None:
        """Something.

        Args:
            x: A number.

        Raises:
            NoSuchError: Never.
        """

    def good(x: int, **changes: int) -> dict:
        """Something.

        Args:
            x: A number.
            **changes: More numbers.

        Returns:
            A dict.

        Raises:
            ScheduleError: Sometimes.
            ValueError: Other times.
        """
        return dict(changes, x=x)

    @dataclasses.dataclass
    class Undocumented:
        """A thing.

        Attributes:
            a: A field.
        """

        a: int
        b: int

    class MadeFrom:
        """A thing made from a number."""

        def __init__(self, a: int):
            """Checked when made.

            Args:
                a: A number.

            Raises:
                OptionError: a is negative.
            """

    class MadeFromUndocumented:
        """A thing made from a number."""

        def __init__(self, a: int):
            """Checked when made."""

    assert check_function("f", undocumented, False) == ["f: no docstring"]
    assert [p.split(":")[1].strip() for p in check_function("f", no_sections, False)] == [
        "no Args section for ['x']",
        "returns int, but no Returns section",
    ]
    assert "Args documents ['x', 'z']" in check_function("f", wrong_args, False)[0]
    assert "NoSuchError" in check_function("f", unknown_raise, False)[0]
    assert check_function("f", good, False) == []
    assert "the fields are ['a', 'b']" in check_class("Undocumented", Undocumented)[0]
    assert check_class("MadeFrom", MadeFrom) == []  # __init__'s sections count
    assert check_class("MadeFromUndocumented", MadeFromUndocumented) == [
        "MadeFromUndocumented(): no Args section for ['a']"
    ]
