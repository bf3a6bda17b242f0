"""The tensor ledger: owners from a registry, storages counted once, the unregistered rest, where large
tensors were made and what holds them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from kvledger.errors import ConfigError
from kvledger.runtime.measure.diagnostics.tensors import (
    CreationSites,
    TensorRegistry,
    describe_holders,
    scan,
    storage_of,
    tensors_of,
)

MiB = 1 << 20


def test_views_share_one_storage_and_count_once():
    base = torch.zeros(1024, 256)  # 1 MiB
    views = [base[:10], base.view(256, 1024), base.t()]
    keys = {storage_of(t)[0] for t in (base, *views)}
    assert len(keys) == 1 and storage_of(base)[1] == MiB
    sample = scan()
    assert sample.unregistered[storage_of(base)[0]].nbytes == MiB
    del views


def test_owners_take_their_storages_and_the_rest_is_unregistered():
    model = nn.Linear(256, 512)  # 512 KiB + 2 KiB
    store = type("Store", (), {})()
    store.kv = torch.zeros(MiB // 4)  # 1 MiB
    stray = torch.ones(3 * MiB // 4)  # 3 MiB, nobody registered it
    reg = TensorRegistry()
    reg.register("weights", model)
    reg.register("kv/device", store)
    sample = scan(reg)
    assert sample.owner_bytes("weights", "cpu") == 256 * 512 * 4 + 512 * 4
    assert sample.owner_bytes("kv/device") == MiB
    key = storage_of(stray)[0]
    assert key in sample.unregistered and sample.unregistered[key].nbytes == 3 * MiB
    assert storage_of(store.kv)[0] not in sample.unregistered
    # Conservation: every storage once, in an owner or in the rest.
    everything = {storage_of(t)[0]: storage_of(t)[1] for t in (model.weight, model.bias, store.kv, stray)}
    assert sum(everything.values()) == (sample.owner_bytes("weights") + sample.owner_bytes("kv/device")
                                        + sum(sample.unregistered[k].nbytes for k in everything
                                              if k in sample.unregistered))


def test_a_storage_reached_by_two_owners_goes_to_the_first_well_known_owner():
    t = torch.zeros(1000)
    reg = TensorRegistry()
    reg.register("mine", {"t": t})
    reg.register("weights", [t])
    sample = scan(reg)
    assert sample.owner_bytes("weights") == 4000 and sample.owner_bytes("mine") == 0


def test_registering_keeps_no_memory_alive():
    model = nn.Linear(512, 512)
    reg = TensorRegistry()
    reg.register("weights", model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert scan(reg).owner_bytes("weights") == 0


def test_callable_roots_and_bad_owner_names():
    held = [torch.zeros(100)]
    reg = TensorRegistry()
    reg.register("staging", lambda: held, call=True)
    assert scan(reg).owner_bytes("staging") == 400
    with pytest.raises(ConfigError):
        reg.register("", held)
    with pytest.raises(ConfigError):
        reg.register("x", held, call=True)


def test_tensor_attributes_of_modules_are_found():
    lin = nn.Linear(4, 4)
    lin._packed = (torch.zeros(16), torch.zeros(4))  # a packed copy kept as a plain attribute
    found = tensors_of(lin)
    assert any(t is lin._packed[0] for t in found) and any(t is lin.weight for t in found)


def test_opaque_tensors_count_numel_times_element_size():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    packed = torch.zeros(64, 64).to_mkldnn()
    key, nbytes = storage_of(packed)
    assert key[0] == "opaque" and nbytes == 64 * 64 * 4


def test_creation_sites_name_the_line_that_made_a_large_tensor():
    sites = CreationSites(min_bytes=MiB)
    with sites:
        big = torch.ones(MiB // 2)  # 2 MiB: recorded
        small = torch.ones(16)  # below min_bytes: not recorded
    sample = scan(None, sites)
    info = sample.unregistered[storage_of(big)[0]]
    assert info.site is not None and "test_tensors.py" in info.site and "test_creation_sites" in info.site
    assert storage_of(small)[0] not in sites.sites


class _Callback:
    def __init__(self) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        self.last = torch.zeros(3)


def test_holders_are_described_with_their_attribute_path():
    cb = _Callback()
    cb.seen["req-7"] = torch.zeros(10)
    assert describe_holders(cb.seen["req-7"]) == ["key 'req-7' of _Callback.seen"]
    assert describe_holders(cb.last) == ["attribute 'last' of _Callback"]
