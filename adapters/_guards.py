"""Guard tables: the framework internals an adapter relies on, and their check.

Rules of this room: framework-neutral (the standard library and attrs; a
framework module is imported only by name, when a table is checked). Every
adapter that uses a member its framework does not promise to keep lists it in
a table of :class:`Member` values in its own room (``torch/_private.py``,
``lightning/_private.py``, ``torchmetrics/_private.py``, ...) and runs
:func:`problems` over the table when it first adapts an object, raising its
framework's ``Unsupported...Error`` with the lines it returns: a new release
fails loudly, never silently (the module doc of ``torch/_private.py`` says why).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

__all__ = ["Need", "Member", "member", "problems", "class_names", "names_in", "read_only_property",
           "version", "supported_spec", "refusal"]


class Need(enum.Enum):
    """What joinkit needs of a member."""

    #: A function or method, called with :attr:`Member.params`.
    CALLABLE = "callable"
    #: An attribute of instances: the class's own code (or its class body) names it.
    ATTRIBUTE = "attribute"
    #: An attribute of instances that joinkit sets (or puts back): as :attr:`ATTRIBUTE`,
    #: and where the class defines it as a property, the property has a setter.
    SETTABLE = "settable"
    #: A namedtuple class with exactly the fields :attr:`Member.params`.
    FIELDS = "fields"
    #: A ``staticmethod`` in the class body (joinkit takes it out and puts it back).
    STATICMETHOD = "staticmethod"
    #: Anything that exists: a module's class, an enum member.
    EXISTS = "exists"


@attrs.frozen(kw_only=True)
class Member:
    """One framework member an adapter relies on.

    Attributes:
        module: the module that defines it.
        name: its qualified name in the module (``Class.method``).
        need: what joinkit needs of it.
        params: for :attr:`Need.CALLABLE`, the leading parameter names joinkit
            calls it with (any further parameter must have a default); for
            :attr:`Need.FIELDS`, the fields.
        called_by: framework functions (``module:Qualified.name``) that must still
            call this member by its name: joinkit replaces it on the object.
        why: what joinkit does with it (for the error message).
    """

    module: str
    name: str
    need: Need
    params: tuple[str, ...] = ()
    called_by: tuple[str, ...] = ()
    why: str

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


def member(module: str, name: str, need: Need, why: str, params: Sequence[str] = (),
       called_by: Sequence[str] = ()) -> Member:
    """A :class:`Member` (positional shorthand for the tables)."""
    return Member(module=module, name=name, need=need, params=tuple(params),
                  called_by=tuple(called_by), why=why)


def problems(members: Sequence[Member]) -> list[str]:
    """What is wrong with ``members`` in the installed framework, one line each (none: all fine)."""
    return [problem for member in members for problem in _member_problems(member)]


def _member_problems(member: Member) -> Iterator[str]:
    try:
        owner, value = _resolve(member.module, member.name,
                                instance_attribute=member.need in _INSTANCE_ATTRIBUTES)
    except LookupError as error:
        yield f"{member.path} is missing ({error}); joinkit uses it: {member.why}"
        return
    leaf = member.name.rsplit(".", 1)[-1]
    if member.need is Need.CALLABLE:
        if not callable(value):
            yield f"{member.path} is not callable; joinkit calls it: {member.why}"
        else:
            mismatch = _params_mismatch(value, member.params)
            if mismatch:
                yield f"{member.path} {mismatch}; joinkit calls it: {member.why}"
    elif member.need is Need.FIELDS:
        fields = tuple(getattr(value, "_fields", ()))
        if fields != member.params:
            yield (f"{member.path} has the fields {fields}, joinkit builds it with "
                   f"{member.params}; joinkit uses it: {member.why}")
    elif member.need is Need.STATICMETHOD:
        if not isinstance(vars(owner).get(leaf), staticmethod):
            yield f"{member.path} is not a staticmethod; joinkit uses it: {member.why}"
    elif member.need is Need.SETTABLE and read_only_property(owner, leaf):
        yield f"{member.path} is a property without a setter; joinkit sets it: {member.why}"
    for caller in member.called_by:
        module, _, qualname = caller.partition(":")
        try:
            _, function = _resolve(module, qualname)
        except LookupError:
            yield (f"{module}.{qualname}, which should call {member.path}, is missing; "
                   f"joinkit relies on that call: {member.why}")
            continue
        if leaf not in names_in(function):
            yield (f"{module}.{qualname} no longer calls {leaf}; joinkit relies on that "
                   f"call ({member.why}) and would go wrong silently without it")


_MISSING = object()
_INSTANCE_ATTRIBUTES = (Need.ATTRIBUTE, Need.SETTABLE)


def read_only_property(cls: Any, name: str) -> bool:
    """Whether ``cls`` (or a base) defines ``name`` as a property without a setter.

    Setting such an attribute on an instance raises ``AttributeError``; the
    guard tables check it for :attr:`Need.SETTABLE`, and a room's compatibility
    module asks it to choose a path on the releases where a property replaced
    an attribute.
    """
    if not isinstance(cls, type):
        return False
    static = inspect.getattr_static(cls, name, None)
    return isinstance(static, property) and static.fset is None


def _resolve(module_name: str, qualname: str, *,
             instance_attribute: bool = False) -> tuple[Any, Any]:
    """(owner, member) for ``module_name`` + ``qualname``. With
    ``instance_attribute``, a name the owner class's code uses resolves to a
    marker. Raises LookupError when missing."""
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise LookupError(f"no module {module_name}") from error
    *path, leaf = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            raise LookupError(f"no {part} in {module_name}")
    value = getattr(owner, leaf, _MISSING)
    if (value is _MISSING and instance_attribute and isinstance(owner, type)
            and leaf in class_names(owner)):
        return owner, _MISSING  # an instance attribute the class's code names
    if value is _MISSING:
        raise LookupError(f"{owner.__name__} has no {leaf}")
    return owner, value


def class_names(cls: type) -> set[str]:
    """Every name the code and class bodies of ``cls`` and its bases mention."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names.update(vars(klass))
        names.update(getattr(klass, "__annotations__", {}))
        for value in vars(klass).values():
            function = value.fget if isinstance(value, property) else value
            function = getattr(function, "__func__", function)
            if isinstance(function, types.FunctionType):
                names.update(names_in(function))
    return names


def names_in(function: Any) -> set[str]:
    """The names a function's code (with nested code: comprehensions, lambdas) uses."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    code = getattr(function, "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return names


def _params_mismatch(function: Any, expected: tuple[str, ...]) -> str | None:
    """Why ``function`` cannot be called with ``expected`` parameters, or ``None``."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        # A C++ binding: its docstring's first line is its signature, with
        # positional names arg0, arg1...; only their number means anything.
        found = _binding_params(function)
        if found is None or len(found) == len(expected):
            return None
        return (f"takes {len(found)} parameters ({', '.join(found)}), joinkit passes "
                f"{len(expected)} ({', '.join(expected)})")
    params = list(signature.parameters.values())
    names = tuple(p.name for p in params[: len(expected)])
    rest = params[len(expected):]
    required = [p.name for p in rest
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if names == expected and not required:
        return None
    return f"has the parameters ({', '.join(p.name for p in params)}), joinkit expects " \
           f"({', '.join(expected)})"


def _binding_params(function: Any) -> list[str] | None:
    doc = (getattr(function, "__doc__", None) or "").strip().splitlines()
    if not doc or "(" not in doc[0]:
        return None
    line = doc[0]
    depth, start, params = 0, line.index("(") + 1, []
    current = ""
    for char in line[start:]:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        params.append(current)
    return [p.split(":", 1)[0].strip() for p in params]


def version(distribution: str) -> str:
    """The installed version of ``distribution`` (a loaded torch's own), or a placeholder."""
    if distribution == "torch" and "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:
        return "(unknown version)"


def supported_spec(tested: Sequence[str]) -> str:
    """The pip range of a framework whose oldest tested release is ``tested[0]``.

    No upper bound: a newer release runs where its guard table passes (issue 48,
    "honest ranges"); the table, not the version number, decides.
    """
    return f">={tested[0]}"


def refusal(distribution: str, adapter: str, found: Sequence[str], tested: Sequence[str],
            stakes: str) -> str:
    """The message of an adapter's ``Unsupported...Error`` for the problems ``found``.

    It names the version running, each member this release lacks or changed (the
    lines of :func:`problems`), what going on would risk, and the releases tested.
    """
    installed = version(distribution)
    lines = "\n".join(f"  - {problem}" for problem in found)
    return (
        f"found {distribution} {installed}; joinkit's {adapter} adapter needs internals this "
        f"release lacks or changed:\n{lines}\n{stakes}, so joinkit stops here. joinkit "
        f"supports {distribution}{supported_spec(tested)} wherever these internals are as "
        f"listed (tested with {' and '.join(dict.fromkeys(tested))}); install such a release, "
        f"or a joinkit release that supports {distribution} {installed}."
    )
