"""The tensor ledger: live torch tensors by owner, deduplicated by storage.

Owners come from a :class:`TensorRegistry`: each owner (``weights``, ``weights/packed`` -- the oneDNN copies
CPU runners keep --, ``kv/device``, ``kv/host``, ``workspace``, ``sampling``, ``staging`` or any name a user
picks) names *roots* -- a module, a store, a
backend, a tensor, or a callable returning tensors -- and every tensor reachable from a root through
attributes, dicts, lists and tuples belongs to that owner. A scan of every live tensor object (the
garbage collector's list) finds the rest: tensors nobody registered. Views share their base's storage, so
bytes are counted per storage, once, whichever owner reaches it first (owners are tried in registration
order). Opaque tensors without a storage (oneDNN-packed weights) count ``numel * element_size``.

Registering a root keeps only a weak reference where the object allows one, so a registry never keeps
memory alive. Where it helps, :class:`CreationSites` records where large tensors were created (the first
frame outside torch) while it is active, so an unexplained storage can name the line that made it.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import CellType, FrameType, FunctionType, ModuleType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ....errors import ConfigError

StorageKey = tuple[str, int, int]  # (device type, device index or -1, data pointer) or ("opaque", id, 0)

# Well-known owners, in the order a scan attributes shared storages to them.
OWNERS = ("weights/packed", "weights", "kv/device", "kv/host", "staging", "workspace", "sampling")


def storage_of(t: torch.Tensor) -> tuple[StorageKey, int] | None:
    """The storage a tensor views, as ``(key, bytes)``; None for meta tensors (they hold no memory)."""
    dev = t.device
    if dev.type == "meta":
        return None
    try:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        nbytes = s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # mkldnn, sparse, nested: no plain storage
        return ("opaque", id(t), 0), t.numel() * t.element_size()
    if ptr == 0 and nbytes == 0:
        return None
    return (dev.type, -1 if dev.index is None else dev.index, ptr), nbytes


def _walk(root: Any, out: list[torch.Tensor], seen: set[int], depth: int) -> None:
    if depth < 0:
        return
    oid = id(root)
    if oid in seen:
        return
    seen.add(oid)
    if isinstance(root, torch.Tensor):
        out.append(root)
        return
    if isinstance(root, (str, bytes, int, float, bool, type(None), ModuleType, type, FunctionType)):
        return
    if isinstance(root, nn.Module):
        for t in root.parameters():
            out.append(t)
        for t in root.buffers():
            out.append(t)
        for m in root.modules():  # tensors kept as plain attributes (packed weight copies, caches)
            for value in vars(m).values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
                elif isinstance(value, (tuple, list)) and len(value) <= 8:
                    out.extend(v for v in value if isinstance(v, torch.Tensor))
        return
    if isinstance(root, dict):
        values: Iterable[Any] = list(root.values())
    elif isinstance(root, (list, tuple, set, frozenset)):
        values = list(root)
    elif dataclasses.is_dataclass(root) and not isinstance(root, type):
        values = [getattr(root, f.name, None) for f in dataclasses.fields(root)]
    elif hasattr(root, "__dict__"):
        values = list(vars(root).values())
    elif hasattr(type(root), "__slots__"):
        values = [getattr(root, s, None) for s in getattr(type(root), "__slots__", ())]
    else:
        return
    if len(values) > 100_000:
        return  # a token list, not a tensor holder
    for v in values:
        _walk(v, out, seen, depth - 1)


def tensors_of(root: Any, depth: int = 6) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` (a tensor, module, container or object) within ``depth``
    attribute/container hops; modules contribute parameters, buffers and tensor attributes."""
    out: list[torch.Tensor] = []
    _walk(root, out, set(), depth)
    return out


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


@dataclass(frozen=True, slots=True)
class _Root:
    owner: str
    get: Callable[[], Any]  # the object (None when it was collected), or the callable's tensors
    is_callable: bool


class TensorRegistry:
    """Owners and their roots. ``register(owner, obj)`` adds a root; ``register(owner, fn, call=True)``
    adds a callable that returns the owner's tensors (or objects holding them) at scan time."""

    def __init__(self) -> None:
        self._roots: list[_Root] = []
        self._lock = threading.Lock()

    def register(self, owner: str, root: Any, *, call: bool = False) -> None:
        if not isinstance(owner, str) or not owner.strip():
            raise ConfigError(f"a tensor owner is a non-empty name, got {owner!r}")
        if call and not callable(root):
            raise ConfigError(f"owner {owner!r}: call=True needs a callable root")
        with self._lock:
            self._roots.append(_Root(owner, root if call else _ref(root), call))

    @property
    def owners(self) -> list[str]:
        """Owner names in attribution order (well-known owners first, then in registration order)."""
        names = list(dict.fromkeys(r.owner for r in self._roots))
        return sorted(names, key=lambda n: (OWNERS.index(n) if n in OWNERS else len(OWNERS), names.index(n)))

    def owned(self) -> dict[StorageKey, tuple[str, int]]:
        """Every registered storage: key -> (owner, bytes); a storage reached by several owners goes to
        the first in :attr:`owners` order."""
        with self._lock:
            roots = list(self._roots)
        by_owner: dict[str, list[torch.Tensor]] = {}
        for r in roots:
            obj = r.get()
            if obj is None:
                continue
            by_owner.setdefault(r.owner, []).extend(tensors_of(obj))
        out: dict[StorageKey, tuple[str, int]] = {}
        for owner in self.owners:
            for t in by_owner.get(owner, ()):
                st = storage_of(t)
                if st is not None and st[0] not in out:
                    out[st[0]] = (owner, st[1])
        return out


# ---- creation sites ----------------------------------------------------------------------------------


def _site() -> str:
    """``file:line in function`` of the first frame outside torch and this module."""
    frame = sys._getframe(2)
    here = __file__
    while frame is not None:
        name = frame.f_code.co_filename
        if name != here and f"{'/'}torch{'/'}" not in name.replace("\\", "/"):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class CreationSites(TorchFunctionMode):
    """While active (``with sites:``), remember where every tensor of at least ``min_bytes`` was created:
    storage key -> ``file:line in function``. Bounded (the newest ``limit`` storages); a storage reused at
    the same address by a later tracked tensor takes the later site."""

    def __init__(self, min_bytes: int = 1 << 20, limit: int = 4096) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.limit = limit
        self.sites: OrderedDict[StorageKey, tuple[int, str]] = OrderedDict()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() * out.element_size() >= self.min_bytes:
            st = storage_of(out)
            if st is not None and (st[0] not in self.sites or self.sites[st[0]][0] != st[1]):
                self.sites[st[0]] = (st[1], _site())
                self.sites.move_to_end(st[0])
                while len(self.sites) > self.limit:
                    self.sites.popitem(last=False)
        return out

    def site(self, key: StorageKey, nbytes: int) -> str | None:
        hit = self.sites.get(key)
        return hit[1] if hit is not None and hit[0] == nbytes else None


# ---- the scan ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class StorageInfo:
    """One storage nobody registered: its size, one tensor viewing it, and where it was made if known."""

    key: StorageKey
    nbytes: int
    device: str
    dtype: str
    shape: tuple[int, ...]
    site: str | None = None
    tensor: weakref.ReferenceType[torch.Tensor] | None = field(default=None, repr=False)
    view_bytes: int = 0  # bytes of the largest tensor seen viewing it (shape and dtype are that one's)

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "device": self.device, "dtype": self.dtype, "shape": list(self.shape),
                "site": self.site}


@dataclass(slots=True)
class TensorSample:
    """The tensor ledger at one moment: bytes per owner and device, and the unregistered storages."""

    owners: dict[str, dict[str, int]]  # owner -> device -> bytes
    unregistered: dict[StorageKey, StorageInfo]
    tensors: int  # tensor objects seen (views included)

    def owner_bytes(self, owner: str, device: str | None = None) -> int:
        per = self.owners.get(owner, {})
        return sum(per.values()) if device is None else per.get(device, 0)

    def unregistered_bytes(self, device: str | None = None) -> int:
        return sum(s.nbytes for s in self.unregistered.values() if device is None or s.device == device)

    def total(self, device: str | None = None) -> int:
        return sum(self.owner_bytes(o, device) for o in self.owners) + self.unregistered_bytes(device)

    def as_dict(self, top: int = 8) -> dict[str, Any]:
        largest = sorted(self.unregistered.values(), key=lambda s: -s.nbytes)[:top]
        return {"owners": {o: dict(d) for o, d in self.owners.items()},
                "unregistered_bytes": self.unregistered_bytes(), "unregistered_storages": len(self.unregistered),
                "largest_unregistered": [s.as_dict() for s in largest], "tensor_objects": self.tensors}


def _tensor_types() -> set[type]:
    out: set[type] = set()
    todo = [torch.Tensor]
    while todo:
        t = todo.pop()
        if t not in out:
            out.add(t)
            todo.extend(t.__subclasses__())
    return out


def live_tensors() -> list[torch.Tensor]:
    """Every tensor object the garbage collector tracks (exact type checks: no property is touched)."""
    types = _tensor_types()
    return [obj for obj in gc.get_objects() if type(obj) in types]


def _device_name(key: StorageKey, t: torch.Tensor) -> str:
    return t.device.type if key[0] == "opaque" else key[0]


def scan(registry: TensorRegistry | None = None, sites: CreationSites | None = None) -> TensorSample:
    """One pass over every live tensor: bytes per owner (registered storages) and the storages of
    tensors nobody registered, each counted once."""
    owned = registry.owned() if registry is not None else {}
    owners: dict[str, dict[str, int]] = {}
    for key, (owner, nbytes) in owned.items():
        dev = "cpu" if key[0] == "opaque" else key[0]
        per = owners.setdefault(owner, {})
        per[dev] = per.get(dev, 0) + nbytes
    unregistered: dict[StorageKey, StorageInfo] = {}
    count = 0
    for t in live_tensors():
        count += 1
        st = storage_of(t)
        if st is None:
            continue
        key, nbytes = st
        if key in owned:
            continue
        info = unregistered.get(key)
        if info is None:
            try:
                ref: weakref.ReferenceType[torch.Tensor] | None = weakref.ref(t)
            except TypeError:
                ref = None
            unregistered[key] = StorageInfo(key, nbytes, _device_name(key, t), str(t.dtype).replace("torch.", ""),
                                            tuple(t.shape), sites.site(key, nbytes) if sites else None, ref,
                                            t.numel() * t.element_size())
        elif t.numel() * t.element_size() > info.view_bytes:
            info.shape, info.dtype = tuple(t.shape), str(t.dtype).replace("torch.", "")
            info.view_bytes = t.numel() * t.element_size()
    return TensorSample(owners, unregistered, count)


def describe_holders(t: torch.Tensor, limit: int = 3) -> list[str]:
    """What keeps a tensor alive, one hop up, with the attribute path of the holder where one is found:
    ``key 'r2' of RetainedTensor.cache``, ``attribute 'buf' of MyCallback``, ``a list of 3 at Foo.items``."""
    out: list[str] = []
    for ref in gc.get_referrers(t):
        if isinstance(ref, (FrameType, CellType)):
            continue  # the caller's own variables
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is t), None)
            owner = _dict_owner(ref)
            if owner is not None:
                out.append(f"attribute {key!r} of {owner}")
            else:
                where = _attr_path(ref)
                out.append(f"key {key!r} of {where}" if where else f"key {key!r} of a dict")
        elif isinstance(ref, (list, tuple)):
            where = _attr_path(ref)
            out.append(f"a {type(ref).__name__} of {len(ref)}" + (f" at {where}" if where else ""))
        else:
            out.append(type(ref).__qualname__)
        if len(out) >= limit:
            break
    return out


def _dict_owner(d: dict[Any, Any]) -> str | None:
    """The object (or module) whose attribute dictionary ``d`` is."""
    for ref in gc.get_referrers(d):
        if isinstance(ref, ModuleType) and vars(ref) is d:
            return f"module {ref.__name__}"
        if not isinstance(ref, (dict, list, tuple, FrameType)) and getattr(ref, "__dict__", None) is d:
            return type(ref).__qualname__
    return None


def _attr_path(container: Any) -> str | None:
    """``Owner.attribute`` for a container kept as an attribute of an object or a module."""
    for ref in gc.get_referrers(container):
        if isinstance(ref, dict):
            owner = _dict_owner(ref)
            if owner is not None:
                key = next((k for k, v in ref.items() if v is container), None)
                return f"{owner}.{key}"
    return None


__all__ = ["OWNERS", "CreationSites", "StorageInfo", "TensorRegistry", "TensorSample", "describe_holders",
           "live_tensors", "scan", "storage_of", "tensors_of"]
