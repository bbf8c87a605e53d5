"""The CPU KV pool: mapped in full at start-up (prefault) or page by page as used."""

from __future__ import annotations

import mmap

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.runner import kv_pool, prefault_default


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE / 2**20


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux-only")
def test_a_prefaulted_pool_is_resident_and_a_lazy_one_is_not() -> None:
    shape = (4, 2, 8, 256, 16, 64)  # layers, k/v, heads, blocks, slots, head_dim: 32 MB
    cpu = torch.device("cpu")
    before = _rss_mb()
    lazy = kv_pool(shape, torch.bfloat16, cpu, prefault=False)
    assert _rss_mb() - before < 8
    lazy[1, 0, 2, 5].fill_(1.0)  # one block of one head of one layer: its pages only
    assert _rss_mb() - before < 8
    before = _rss_mb()
    eager = kv_pool(shape, torch.bfloat16, cpu, prefault=True)
    assert _rss_mb() - before > 30
    assert eager.abs().sum().item() == 0 and lazy.sum().item() == 16 * 64  # zeroed either way


def test_prefault_default_follows_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TIDEWIRE_KV_PREFAULT", raising=False)
    assert prefault_default() is True
    for off in ("0", "false", "off"):
        monkeypatch.setenv("TIDEWIRE_KV_PREFAULT", off)
        assert prefault_default() is False
    assert CacheConfig().prefault is None  # None: the environment decides
    assert EngineConfig.from_flat("m", kv_prefault=True).cache.prefault is True
