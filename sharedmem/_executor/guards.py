"""Guards: what a trace read besides its tensors, checked cheaply on every call.

A trace bakes Python values into its graph: a Dropout's ``p``, a batch norm's ``momentum``
and ``eps``, any attribute or flag of a submodule, the hooks registered on the modules (and
globally), the values a closure cell or a global gives the loss function, a forward or a
hook. Parameters, buffers and inputs are tensors passed in at run time, not guarded here
(``binding`` watches where they live, the signature their layouts). A ``Guard`` takes a
snapshot of every such value before a trace (as Dynamo guards what a frame read on entry)
and ``changed()`` says, on each later call, what differs: the executor then captures again,
so a call never replays a graph traced with values eager would no longer use. A trace that
itself changes a guarded value (a counter a forward increments) keeps the change, as eager
does, and so is captured again on the next call.

The fast check compares identities (a rebound attribute is a new object), the lengths of
module dictionaries (an attribute added), the keys of hook dictionaries, and the contents of
small containers of constants; only where an identity differs does the slow check compare
values, so that ``m.p = 0.5`` set again to an equal value costs no capture.

``leaks()`` walks the same values after a trace for tensors the trace computed: a hook or a
forward that stored one (in a list, a dict, an attribute) would hand the user a fake tensor.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as _module

__all__ = ["HOOK_DICTS", "Guard", "holds_fake", "user_code"]

# Entries of a module's ``__dict__`` that no forward reads, or that are part of a call's
# signature already (``binding``: the structure, and the training flags, so that switching
# between train and eval keeps both graphs).
_SKIPPED = frozenset(
    {
        "training",
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
# The hook dictionaries a call runs (a module's, and torch.nn's global ones).
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
_CONSTANT = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    range,
)
_SMALL = 16  # a mutable container of constants up to this size is compared by content
_MISSING = object()


def user_code(obj: object) -> bool:
    """Whether a function or class is the user's (not torch's or this package's own)."""
    module = getattr(obj, "__module__", None) or ""
    return not module.startswith(("torch.", "sharedmem.")) and module != "torch"


def _constant(value: object, depth: int = 0) -> bool:
    if isinstance(value, _CONSTANT):
        return True
    if type(value) in (tuple, frozenset, torch.Size) and depth < 2 and len(value) <= _SMALL:  # type: ignore[arg-type]
        return all(_constant(v, depth + 1) for v in value)  # type: ignore[attr-defined]
    return False


def _same(a: object, b: object) -> bool:
    """Whether two guarded values are the same for a trace: equal constants of one type."""
    if a is b:
        return True
    if type(a) is not type(b) or not _constant(a):
        return False
    if isinstance(a, float) and a != a:  # NaN
        return b != b
    return bool(a == b)


def _contents(value: object) -> object | None:
    """A copy of a small mutable container of constants (compared by ``==``), else None."""
    if type(value) is dict and len(value) <= _SMALL:
        items: list[object] = [*value, *value.values()]
    elif type(value) in (list, set) and len(value) <= _SMALL:  # type: ignore[arg-type]
        items = list(value)  # type: ignore[call-overload]
    else:
        return None
    return value.copy() if all(_constant(v) for v in items) else None  # type: ignore[attr-defined]


_NOT_PLAIN = (
    nn.Module,
    torch.Tensor,
    type,
    types.FunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
)


def _plain_object(value: object) -> bool:
    """An object whose attributes a forward may read (a config), watched one level deep."""
    return (
        hasattr(value, "__dict__") and not isinstance(value, _NOT_PLAIN) and user_code(type(value))
    )


class _Watch(NamedTuple):
    """One guarded value: how to read it now, and put it back; what it is, for messages."""

    read: Callable[[], object]
    write: Callable[[object], None]
    what: str
    by_content: bool  # a small container of constants, compared by ``==`` with a copy


class Guard:
    """A snapshot of the Python values a trace of ``modules`` and ``functions`` depends on.

    Args:
        modules: the model's submodules, by path (``binding.unique``).
        functions: the other callables a trace runs, by the name messages give them (the
            loss function).
    """

    def __init__(
        self, modules: list[tuple[str, nn.Module]], functions: list[tuple[str, object]]
    ) -> None:
        self._env: dict[str, Any] = {"M": _MISSING, "_cell": _cell}
        self._terms: list[str] = []
        self._watched: list[_Watch] = []
        self._taken: list[object] = []  # each watched value as the snapshot found it
        self._seen: set[int] = set()
        self._keys: set[tuple[int, str]] = set()  # plain objects' attributes watched
        self.hooks: list[tuple[str, object]] = []  # every module hook, named
        for path, module in modules:
            self._module(path, module)
        for name in _GLOBAL_HOOKS:
            self._hook_dict(getattr(_module, name), f"torch.nn's {name[8:].replace('_', ' ')}")
        self._item(
            vars(_module),
            "_global_is_full_backward_hook",
            "torch.nn's global backward hook kind",
        )
        for name, fn in functions:
            self._callable(fn, name, depth=0)
        for what, fn in list(self.hooks):
            self._callable(fn, what, depth=0)
        source = "def same():\n"
        for at in range(0, len(self._terms), 128):
            source += f"    if not ({' and '.join(self._terms[at : at + 128])}):\n"
            source += "        return False\n"
        source += "    return True\n"
        exec(compile(source, "<sharedmem guard>", "exec"), self._env)
        self._same: Callable[[], bool] = self._env["same"]

    # ---- checking ---------------------------------------------------------------------------

    def changed(self) -> str | None:
        """What differs from the snapshot, in words (``None``: nothing a trace read)."""
        if self._same():
            return None
        for k, watch in enumerate(self._watched):
            now, then = watch.read(), self._env[f"v{k}"]
            if watch.by_content:
                if now != then:
                    return f"{watch.what} changed ({_short(then)} -> {_short(now)})"
            elif not _same(now, then):
                return f"{watch.what} changed ({_short(then)} -> {_short(now)})"
            else:
                self._env[f"v{k}"] = now  # an equal value: keep the fast check fast
        return None

    def fakes(self) -> frozenset[int]:
        """The fake tensors (by id) in the watched state now: those a trace finds there
        afterwards that were there before it are not its own (another tool's leftovers)."""
        found: set[int] = set()
        for watch in self._watched:
            _collect(watch.read(), 0, found)
        return frozenset(found)

    def leaks(self, before: frozenset[int] = frozenset()) -> tuple[str, Callable[[], None]] | None:
        """Where a tensor the trace computed was stored (in words), and how to take it out
        (a container is cleared of it, a rebound value put back); ``None`` where none was.
        ``before``: the fake tensors there before the trace (``fakes()``), left alone."""
        for watch, taken in zip(self._watched, self._taken, strict=True):
            value = watch.read()
            if isinstance(value, FakeTensor) and id(value) in before:
                continue
            found = _find_fake(value, depth=0, inputs=before)
            if isinstance(value, FakeTensor) or found is _IN_TUPLE:
                return watch.what, functools.partial(watch.write, taken)
            if found is not None:
                return watch.what, found
        return None

    # ---- taking the snapshot ---------------------------------------------------------------

    def _name(self, obj: object) -> str:
        name = f"o{len(self._env)}"
        self._env[name] = obj
        return name

    def _watch(self, watch: _Watch, expression: str, value: object, term: str = "") -> None:
        """Watch ``value``, read now by ``expression``; ``term``: the fast check, where not
        ``expression is`` (or ``==``, by content) the snapshot ``v{k}``."""
        k = len(self._watched)
        self._watched.append(watch)
        self._taken.append(value)
        self._env[f"v{k}"] = value
        self._terms.append(term or f"{expression} {'==' if watch.by_content else 'is'} v{k}")

    def _item(
        self, entries: dict[str, Any], key: str, what: str, names: set[str] | None = None
    ) -> None:
        value = entries.get(key, _MISSING)
        contents = _contents(value)
        self._watch(
            _Watch(
                functools.partial(entries.get, key, _MISSING),
                functools.partial(entries.__setitem__, key),
                what,
                contents is not None,
            ),
            f"{self._name(entries)}.get({key!r}, M)",
            value if contents is None else contents,
        )
        self._nested(value, what, names)

    def _nested(self, value: object, what: str, names: set[str] | None = None) -> None:
        """An object a forward may read attributes of (a config), one level deep: those the
        code reading it names (``names``: a trainer whose bound method is the loss has a
        step count that changes every call), or all of them."""
        if not _plain_object(value):
            return
        entries = vars(value)
        if names is None and id(value) not in self._seen:
            self._length(entries, f"the attributes of {what}")
        self._seen.add(id(value))
        for key, item in list(entries.items()):
            if isinstance(item, torch.Tensor) or (names is not None and key not in names):
                continue
            if (id(value), key) not in self._keys:
                self._keys.add((id(value), key))
                self._item(entries, key, f"{what}.{key}")

    def _length(self, entries: dict[str, Any], what: str) -> None:
        self._watch(
            _Watch(entries.__len__, _nothing, f"how many {what} there are", by_content=True),
            f"len({self._name(entries)})",
            len(entries),
        )

    def _hook_dict(self, hooks: dict[int, Any], what: str, where: str = "") -> None:
        d, keys = self._name(hooks), tuple(hooks)
        self._watch(
            _Watch(functools.partial(tuple, hooks), _nothing, what, by_content=True),
            f"tuple({d})",
            keys,
            term="" if keys else f"not {d}",  # almost every hook dictionary is empty
        )
        kind = what.split(" of ")[0].removeprefix("torch.nn's ").rstrip("s")
        for hook in hooks.values():
            if callable(hook):
                self.hooks.append((f"the {kind} {_hook_name(hook)}{where}", hook))

    def _module(self, path: str, module: nn.Module) -> None:
        if id(module) in self._seen:
            return
        self._seen.add(id(module))
        cls = type(module)
        where = f"{cls.__name__} {path!r}" if path else f"the model ({cls.__name__})"
        entries = vars(module)
        self._length(entries, f"attributes of {where}")
        for key, value in list(entries.items()):
            if key in _SKIPPED or isinstance(value, torch.Tensor):
                continue
            if key in HOOK_DICTS:
                kind = key.strip("_").replace("_", " ")
                self._hook_dict(value, f"{kind} of {where}", f" of {where}")
            else:
                self._item(entries, key, f"attribute {key!r} of {where}")
        method = getattr(cls, "forward", None)
        if isinstance(method, types.FunctionType) and user_code(method):
            self._function(method, f"{cls.__name__}.forward", depth=0, owner=cls)

    def _callable(self, fn: object, what: str, depth: int) -> None:
        if depth > 3 or id(fn) in self._seen:
            return
        if isinstance(fn, nn.Module):
            for path, module in fn.named_modules():
                self._module(f"{what}.{path}" if path else what, module)
            return
        self._seen.add(id(fn))
        if isinstance(fn, functools.partial):
            self._callable(fn.func, what, depth + 1)
            for value in (*fn.args, *fn.keywords.values()):
                self._nested(value, what)
        elif isinstance(fn, types.MethodType):
            func = fn.__func__
            code = getattr(func, "__code__", None)
            names = _names(code) if isinstance(code, types.CodeType) else None
            self._nested(fn.__self__, f"{what}.__self__", names)
            self._callable(func, what, depth + 1)
        elif isinstance(fn, types.FunctionType):
            if user_code(fn):
                self._function(fn, what, depth=depth, owner=None)
        elif _plain_object(fn):  # a callable object
            call = vars(type(fn)).get("__call__")
            if isinstance(call, types.FunctionType) and user_code(call):
                self._nested(fn, what, _names(call.__code__))
                self._function(call, what, depth=depth + 1, owner=type(fn))
            else:
                self._nested(fn, what)

    def _function(
        self, fn: types.FunctionType, what: str, *, depth: int, owner: type | None
    ) -> None:
        """A function's closure cells and the globals its code names (and the user functions
        and methods those name, a few levels deep, as Dynamo inlines them)."""
        if depth > 3:
            return
        self._seen.add(id(fn))
        code = fn.__code__
        names = _names(code)
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
            value = _cell(cell)
            contents = _contents(value)
            label = f"closure variable {name!r} of {what}"
            self._watch(
                _Watch(
                    functools.partial(_cell, cell),
                    functools.partial(setattr, cell, "cell_contents"),
                    label,
                    contents is not None,
                ),
                f"_cell({self._name(cell)})",
                value if contents is None else contents,
            )
            self._nested(value, label, names)
            if callable(value) and not isinstance(value, type):
                self._callable(value, f"{name} (called by {what})", depth + 1)
        scope = fn.__globals__
        for name in sorted(names):
            if name in scope:
                value = scope[name]
                if isinstance(value, types.ModuleType):
                    continue
                self._item(scope, name, f"global {name!r} read by {what}", names)
                if callable(value) and not isinstance(value, type):
                    self._callable(value, f"{name} (called by {what})", depth + 1)
            elif owner is not None:
                method = getattr(owner, name, None)
                if (
                    isinstance(method, types.FunctionType)
                    and user_code(method)
                    and id(method) not in self._seen
                ):
                    label = f"{owner.__name__}.{name}"
                    self._function(method, label, depth=depth + 1, owner=owner)


def _nothing(value: object) -> None:
    """Nothing to put back (a length, a hook dictionary's keys)."""


def _cell(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _hook_name(hook: object) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    return repr(name)


def _short(value: object) -> str:
    if value is _MISSING:
        return "unset"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def holds_fake(value: object, inputs: frozenset[int] = frozenset()) -> bool:
    """Whether ``value`` is, or holds a few levels deep, a tensor a trace computed, other
    than the trace's ``inputs`` (by id)."""
    if isinstance(value, FakeTensor):
        return id(value) not in inputs
    return _find_fake(value, depth=0, inputs=inputs) is not None


def _find_fake(
    value: object, depth: int, inputs: frozenset[int] = frozenset()
) -> Callable[[], None] | None:
    """Where a fake tensor sits in ``value`` (containers and plain objects, a few levels
    deep): a function that takes it (or the tuple holding it) out of its holder; ``None``
    where there is none."""
    if depth > 3:
        return None
    holder: Any = None
    if type(value) in (list, tuple, set):
        items = list(value)  # type: ignore[call-overload]
        holder = value if type(value) is not tuple else None
    elif type(value) is dict:
        items, holder = list(value.values()), value
    elif _plain_object(value):
        items, holder = list(vars(value).values()), vars(value)
    else:
        return None
    for item in items:
        if _fake(item, inputs):
            if holder is None:  # in a tuple: its holder takes the tuple out
                return _IN_TUPLE
            return functools.partial(_purge, holder, inputs)
        found = _find_fake(item, depth + 1, inputs)
        if found is _IN_TUPLE:
            return functools.partial(_purge, holder, inputs) if holder is not None else found
        if found is not None:
            return found
    return None


def _collect(value: object, depth: int, found: set[int]) -> None:
    """Add the ids of the fake tensors in ``value`` (as ``_find_fake`` walks it) to ``found``."""
    if isinstance(value, FakeTensor):
        found.add(id(value))
    elif depth <= 3:
        if type(value) in (list, tuple, set):
            items = list(value)  # type: ignore[call-overload]
        elif type(value) is dict:
            items = list(value.values())
        elif _plain_object(value):
            items = list(vars(value).values())
        else:
            return
        for item in items:
            _collect(item, depth + 1, found)


def _fake(value: object, inputs: frozenset[int]) -> bool:
    return isinstance(value, FakeTensor) and id(value) not in inputs


def _in_tuple() -> None:
    """A fake tensor in a tuple held nowhere the walk can change."""


_IN_TUPLE = _in_tuple


def _purge(holder: Any, inputs: frozenset[int]) -> None:
    """Take every fake tensor, and every tuple holding one, out of a list, set or dict."""

    def fake(v: object) -> bool:
        return _fake(v, inputs) or (type(v) is tuple and _find_fake(v, 3, inputs) is not None)

    if isinstance(holder, list):
        holder[:] = [v for v in holder if not fake(v)]
    elif isinstance(holder, set):
        holder.difference_update([v for v in holder if fake(v)])
    else:
        for key in [k for k, v in holder.items() if fake(v)]:
            del holder[key]
