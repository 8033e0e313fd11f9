"""Where a module keeps its tensors: read cheaply on every call, swapped and restored by traces.

A model's parameters, buffers and plain tensor attributes (tensors set as ordinary module
attributes, ``self.mask = torch.ones(4)``) are all graph inputs: at run time the real ones
are passed in, so what the graph does to them in place lands on the module, once per call,
as in eager. A ``Binding`` finds once every place that holds each of these tensors (a
submodule's ``_parameters``, ``_buffers`` or ``__dict__`` entry; tied weights have several)
and on each call reads them from there and checks, cheaply, that the structure it found still
holds: no submodule replaced, added or removed, no parameter or buffer registered or removed,
tied places still tied. When it does not hold, the executor binds afresh, and since the
structure is part of the signature, a changed model is traced anew.

A ``Swap`` puts the trace's fake tensors in those places for the forward, reports the tensors
the forward stores on the modules (a buffer it rebinds, ``self.avg = 0.9 * self.avg + ...``,
a tensor attribute it sets), and then puts every entry of every submodule back exactly as it
was, so tracing leaves nothing behind on the model: no fake tensor, no changed attribute.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.parameter import is_lazy

from .._errors import SharedMemError
from .guards import holds_fake

__all__ = ["Binding", "Place", "State", "Swap"]

_PARAMS, _BUFFERS, _ATTRS = "_parameters", "_buffers", "__dict__"
_STRUCTURE = frozenset({_PARAMS, _BUFFERS, "_modules"})


@dataclass(frozen=True)
class Place:
    """One entry of one submodule: ``getattr(module at path, kind)[attr]``."""

    path: str  # the submodule, "" for the model itself
    kind: str  # "_parameters", "_buffers" or "__dict__"
    attr: str

    @property
    def name(self) -> str:
        return f"{self.path}.{self.attr}" if self.path else self.attr


def _entries(module: nn.Module, kind: str) -> dict[str, Any]:
    entries: dict[str, Any] = vars(module) if kind == _ATTRS else getattr(module, kind)
    return entries


@dataclass(frozen=True)
class State:
    """A module's graph-input tensors as they are at this call.

    ``buffers`` holds the registered buffers, then the plain tensor attributes; ``key`` is
    everything a trace fixes about them and the module (structure, training flags, layouts).
    """

    param_names: tuple[str, ...]
    params: list[torch.Tensor]
    buffer_names: tuple[str, ...]
    buffers: list[torch.Tensor]
    registered: int  # how many of ``buffers`` are registered buffers
    key: tuple[object, ...]


class _Structure:
    """A description of the bound structure, hashed once (it is part of every call's key)."""

    __slots__ = ("_hash", "value")

    def __init__(self, value: tuple[object, ...]) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Structure) and self.value == other.value)


class Binding:
    """Every place of every graph-input tensor of ``model``, found once.

    Raises:
        ValueError: a lazy module (``nn.LazyLinear``) is not initialized yet.
    """

    def __init__(self, model: nn.Module) -> None:
        paths = list(model.named_modules(remove_duplicate=False))
        self.modules: dict[str, nn.Module] = dict(paths)
        self.unique: list[tuple[str, nn.Module]] = list(model.named_modules())
        self.places: list[list[Place]] = []
        self._index: dict[int, int] = {}
        counts = {_PARAMS: 0, _BUFFERS: 0, _ATTRS: 0}
        for kind in (_PARAMS, _BUFFERS, _ATTRS):
            seen: set[tuple[int, str]] = set()
            for path, module in paths:
                for attr, value in _entries(module, kind).items():
                    if not isinstance(value, torch.Tensor) or (id(module), attr) in seen:
                        continue
                    seen.add((id(module), attr))
                    counts[kind] += self._add(value, Place(path, kind, attr))
        self.n_params, self.n_registered = counts[_PARAMS], counts[_BUFFERS]
        firsts = [places[0] for places in self.places]
        self.names = tuple(p.name for p in firsts)
        self.structure = _Structure(
            (
                tuple((path, type(m)) for path, m in paths),
                tuple(tuple((p.path, p.kind, p.attr) for p in places) for places in self.places),
            )
        )
        self.state: Callable[[], State | None] = self._compile(paths)

    def _add(self, tensor: torch.Tensor, place: Place) -> int:
        if is_lazy(tensor):
            raise ValueError(
                f"sharedmem: the model's {place.name!r} is an uninitialized parameter of a lazy "
                f"module ({type(self.modules[place.path]).__name__}); run one eager forward "
                "first (with torch.no_grad(): model(inputs)) to initialize lazy modules"
            )
        k = self._index.get(id(tensor))
        if k is not None:
            self.places[k].append(place)
            return 0
        self._index[id(tensor)] = len(self.places)
        self.places.append([place])
        return 1

    def _compile(self, paths: list[tuple[str, nn.Module]]) -> Callable[[], State | None]:
        """``state()``: the tensors as they are now and their key, or ``None`` where the
        structure changed. Generated as straight-line code: it runs on every call."""
        env: dict[str, Any] = {"State": State, "Tensor": torch.Tensor, "S": self.structure}

        def name(value: object) -> str:
            env[f"x{len(env)}"] = value
            return f"x{len(env) - 1}"

        lines: list[str] = []
        checks: list[str] = []
        for k, places in enumerate(self.places):
            first = places[0]
            lines.append(f"t{k} = {name(self._dict(first))}.get({first.attr!r})")
            # A parameter or buffer set to None or removed; an attribute set to a non-tensor.
            gone = "not isinstance(t{0}, Tensor)" if first.kind == _ATTRS else "t{0} is None"
            checks.append(gone.format(k))
            # Tied places that were given another tensor (untied).
            checks += [f"{name(self._dict(p))}.get({p.attr!r}) is not t{k}" for p in places[1:]]
        for path, module in paths[1:]:  # a submodule replaced or removed
            parent, _, attr = path.rpartition(".")
            children = name(self.modules[parent]._modules)
            checks.append(f"{children}.get({attr!r}) is not {name(module)}")
        for _, m in self.unique:  # something registered or removed
            for entries in (m._parameters, m._buffers, m._modules):
                held = name(entries)
                checks.append(f"len({held}) != {len(entries)}")
                # An entry set to None keeps its key: watch for it being given a tensor.
                unset = [attr for attr, value in entries.items() if value is None]
                checks += [f"{held}.get({attr!r}) is not None" for attr in unset]
        for at in range(0, len(checks), 64):
            lines += [f"if {' or '.join(checks[at : at + 64])}:", "    return None"]
        n, modules = self.n_params, [name(m) for _, m in self.unique]
        key = ["S", *(f"{m}.training" for m in modules)]
        for k in range(len(self.places)):  # parameters: also requires_grad
            meta = ("shape", "dtype", "device", "requires_grad")[: 4 if k < n else 3]
            key += [f"t{k}.{attr}" for attr in meta]
        params = ", ".join(f"t{k}" for k in range(n))
        buffers = ", ".join(f"t{k}" for k in range(n, len(self.places)))
        lines.append(
            f"return State({name(self.names[:n])}, [{params}], {name(self.names[n:])}, "
            f"[{buffers}], {self.n_registered}, ({', '.join(key)},))"
        )
        source = "def state():\n" + "".join(f"    {line}\n" for line in lines)
        exec(compile(source, "<sharedmem binding>", "exec"), env)
        state: Callable[[], State | None] = env["state"]
        return state

    def _dict(self, place: Place) -> dict[str, Any]:
        return _entries(self.modules[place.path], place.kind)


class Swap:
    """Put ``tensors`` in the binding's places for one traced call, and everything back after.

    Inside, ``stored()`` reports the tensors the call stored on the modules since (buffers
    rebound, tensor attributes set), which a graph carries out and the executor writes back.
    """

    def __init__(self, binding: Binding, tensors: Sequence[torch.Tensor]) -> None:
        self._binding = binding
        self._tensors = tensors
        self._saved: list[tuple[nn.Module, dict[str, dict[str, Any]]]] = []
        self._placed: list[tuple[str, nn.Module, dict[str, dict[str, Any]]]] = []

    def __enter__(self) -> Swap:
        self._saved = [(m, _snapshot(m)) for _, m in self._binding.unique]
        try:
            for places, tensor in zip(self._binding.places, self._tensors, strict=True):
                for place in places:
                    _entries(self._binding.modules[place.path], place.kind)[place.attr] = tensor
        except BaseException:
            self._restore()
            raise
        self._placed = [(path, m, _snapshot(m)) for path, m in self._binding.unique]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # A call that returned keeps the plain values it set on the modules (a counter, a
        # cached length), as eager does; the guard then sees them change (``guards``).
        set_plain = self._set_plain() if kind is None else []
        kept = [(entries, attr, value) for entries, attr, value in set_plain if not _traced(value)]
        self._restore()
        for entries, attr, value in kept:
            entries[attr] = value

    def _set_plain(self) -> list[tuple[dict[str, Any], str, object]]:
        """The non-tensor attributes the call set on the modules since entering."""
        found = []
        for _, module, placed in self._placed:
            entries = vars(module)
            before = placed[_ATTRS]
            for attr, value in entries.items():
                if attr in _STRUCTURE or isinstance(value, torch.Tensor):
                    continue
                if attr not in before or before[attr] is not value:
                    found.append((entries, attr, value))
        return found

    def stored(self) -> list[tuple[Place, torch.Tensor]]:
        """The tensors stored on the modules since entering, by place.

        Raises:
            SharedMemError: the call registered or replaced a parameter, which a graph
                cannot carry out (its gradient would have nowhere to go).
        """
        found: list[tuple[Place, torch.Tensor]] = []
        for path, module, placed in self._placed:
            for kind, before in placed.items():
                for attr, value in _entries(module, kind).items():
                    if value is before.get(attr) or not isinstance(value, torch.Tensor):
                        continue
                    place = Place(path, kind, attr)
                    if kind == _PARAMS:
                        raise SharedMemError(
                            f"sharedmem: the model's forward sets parameter {place.name!r}; the "
                            "pooled executor cannot carry a new parameter out of a graph: "
                            "create parameters before the first call"
                        )
                    found.append((place, value))
        inputs = frozenset(map(id, self._tensors))
        for _, attr, value in self._set_plain():
            # A list of the placed tensors (an RNN's flat weights) is put back as it was.
            if holds_fake(value, inputs):
                raise SharedMemError(
                    f"sharedmem: the model's forward stores tensors it computed in {attr!r} "
                    f"(a {type(value).__name__}), where a pooled step could only leave traced "
                    "tensors with no values; store them as tensor attributes or buffers "
                    "(written back after every call), or return them from the forward"
                )
        return found

    def _restore(self) -> None:
        for module, saved in self._saved:
            _put_back(vars(module), saved[_ATTRS])  # first: it holds the three dicts
            for kind in (_PARAMS, _BUFFERS, "_modules"):
                _put_back(getattr(module, kind), saved[kind])


def _traced(value: object) -> bool:
    """Whether a value the forward set refers to the trace's tensors (holds one, or a weak
    reference to one: an RNN's ``_flat_weight_refs``): put back, never kept."""
    if holds_fake(value):
        return True
    items = value if type(value) in (list, tuple) else ()
    return any(isinstance(v, weakref.ref) and isinstance(v(), FakeTensor) for v in items)  # type: ignore[attr-defined]


def _snapshot(module: nn.Module) -> dict[str, dict[str, Any]]:
    return {kind: dict(_entries(module, kind)) for kind in (_ATTRS, _PARAMS, _BUFFERS, "_modules")}


def _put_back(entries: dict[str, Any], saved: dict[str, Any]) -> None:
    for attr in [a for a in entries if a not in saved]:
        del entries[attr]
    for attr, value in saved.items():
        if attr not in entries or entries[attr] is not value:
            entries[attr] = value
