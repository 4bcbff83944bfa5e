"""Shared fixtures for kernel tests: NaN-poisoned caches in several memory layouts, random block tables and
slot mappings, and bitwise comparison. Everything lives on ``kvlab.device.DEVICE``, so the same tests run in
the interpreter on CPU and compiled on a GPU."""

import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from kvlab.device import DEVICE

#: Layouts make_cache builds. "contiguous": a plain tensor; "padded": rows padded past head_dim (every
#: stride but the last is unusual); "kv_major": stored [2, num_blocks, ...] and transposed, so the K/V
#: stride exceeds the block stride.
CACHE_LAYOUTS = ("contiguous", "padded", "kv_major")


def pytest_collection_finish(session):
    """Start the GPU compile checks (test_gpu_compile.py) once the session's tests are chosen, if they are among
    them: they compile in subprocesses for about two minutes, on the core that the single-threaded tests run
    before them leave idle, and their test collects the results."""
    module = next((item.module for item in session.items if item.path.name == "test_gpu_compile.py"
                   and "target_checks" in item.fixturenames), None)
    if module is not None and not module.STARTED and not session.config.option.collectonly:
        session.config.gpu_compile_dir = Path(tempfile.mkdtemp(prefix="kvlab-gpu-compile-"))
        module.STARTED.update(module.start_checks(session.config.gpu_compile_dir))
        session.config.gpu_compile_module = module


def pytest_sessionfinish(session):
    module = getattr(session.config, "gpu_compile_module", None)
    if module is not None:
        for check in module.STARTED.values():
            check.stop()
        shutil.rmtree(session.config.gpu_compile_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed(request):
    """A different but reproducible random stream for every test."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout="contiguous", fill=float("nan")):
    """A ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` cache on DEVICE, every element ``fill``
    (NaN by default: a slot a kernel should not touch stays NaN, bit for bit)."""
    if layout == "contiguous":
        storage = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        cache = storage
    elif layout == "padded":
        storage = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_dim + 3, dtype=dtype, device=DEVICE)
        cache = storage[..., :head_dim]
    elif layout == "kv_major":
        storage = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        cache = storage.transpose(0, 1)
    else:
        raise ValueError(f"unknown layout {layout!r}; one of {CACHE_LAYOUTS}")
    storage.fill_(fill)
    return cache


def _randn(*shape, dtype=torch.float32):
    """Standard-normal values on DEVICE (never all zeros, so a kernel that writes nothing cannot pass)."""
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _random_slot_mapping(num_tokens, num_slots, num_skipped=0):
    """int64 ``[num_tokens]`` of distinct random slots, ``num_skipped`` of them (at random places) set to -1."""
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_skipped]] = -1
    return slots.to(DEVICE)


def _random_block_tables(seq_lens, block_size, num_blocks, extra_columns=2):
    """Block tables giving every sequence distinct, shuffled blocks. Entries past a sequence's last used
    block hold junk (-1 or ids far out of range): kernels must never read them.
    Returns ``(block_tables int32 [num_seqs, width], seq_lens int32 [num_seqs])`` on DEVICE."""
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed but the cache has {num_blocks}")
    width = max(needed, default=0) + extra_columns
    junk = torch.tensor([-1, num_blocks + 1000], dtype=torch.int32)
    tables = junk[torch.randint(0, 2, (len(seq_lens), width))]
    ids = torch.randperm(num_blocks).to(torch.int32).tolist()
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    return tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def _bits(t):
    """An integer view of a float tensor, for comparisons where NaN must equal the same NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_bitwise_equal(actual, expected):
    assert actual.shape == expected.shape
    assert torch.equal(_bits(actual), _bits(expected)), "tensors differ bitwise"


# The helpers above, as fixtures (conftest modules are not importable from tests).
@pytest.fixture
def make_cache():
    return _make_cache


@pytest.fixture
def randn():
    return _randn


@pytest.fixture
def random_slot_mapping():
    return _random_slot_mapping


@pytest.fixture
def random_block_tables():
    return _random_block_tables


@pytest.fixture
def bits():
    return _bits


@pytest.fixture
def assert_bitwise_equal():
    return _assert_bitwise_equal
