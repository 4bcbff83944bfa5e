"""Bookkeeping for CPU<->GPU swapping: the CPU pool, and which GPU and CPU blocks hold the same bytes.

Sequences that share blocks (forks, prefix hits) are swapped one at a time. When the first of them swaps
out, a shared GPU block g is copied to a CPU block c and the pair (g, c) is remembered as *twins*: the
second sequence swapping out reuses c instead of copying g again, and a sequence swapping in reuses g if it
is still there. So a shared block moves once each way. Twins are forgotten as soon as either side is freed
or g is written (an append into a partial block), because then they no longer hold the same bytes.
"""

from kvlab.block_pool import AllocStatus, Event
from kvlab.allocations import is_int
from kvlab.errors import InvalidArgumentError, OutOfBlocksError
from kvlab.sequence import Sequence, SequenceStatus


class CpuPool:
    """Blocks in host memory: reference counts and a free stack. No prefix caching on this side."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return self._free[::-1]

    def take(self) -> int:
        if not self._free:
            raise OutOfBlocksError("no free CPU block")
        block = self._free.pop()
        self.ref[block] = 1
        return block

    def release(self, block: int) -> bool:
        self.ref[block] -= 1
        if self.ref[block]:
            return False
        self._free.append(block)
        return True


class Twins:
    """A one-to-one relation between GPU blocks and CPU blocks holding identical content."""

    def __init__(self) -> None:
        self.cpu_of: dict[int, int] = {}
        self.gpu_of: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.cpu_of)

    def link(self, gpu: int, cpu: int) -> None:
        self.cpu_of[gpu] = cpu
        self.gpu_of[cpu] = gpu

    def forget_gpu(self, gpu: int) -> None:
        cpu = self.cpu_of.pop(gpu, None)
        if cpu is not None:
            del self.gpu_of[cpu]

    def forget_cpu(self, cpu: int) -> None:
        gpu = self.gpu_of.pop(cpu, None)
        if gpu is not None:
            del self.cpu_of[gpu]


class Swapping:
    """BlockManager's swap operations, kept apart because they are one idea. A mixin: it uses the manager's
    ``_pool`` (BlockPool), ``_cpu`` (CpuPool), ``_twins`` (Twins), ``_allocs`` (seq_id -> allocation with
    ``on_cpu`` and ``num_released``), ``events``, and its helpers ``_on_gpu``, ``_on_cpu``, ``_admission``,
    ``_release_gpu`` and ``_release_cpu``."""

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu.num_free

    def cpu_ref_count(self, block_id: int) -> int:
        """How many swapped-out block-table entries point at CPU block ``block_id``."""
        if not is_int(block_id) or not 0 <= block_id < self._cpu.num_blocks:
            raise InvalidArgumentError(f"CPU block id must be an int in [0, {self._cpu.num_blocks}), "
                                       f"got {block_id!r}")
        return self._cpu.ref[block_id]

    def is_swapped(self, seq: Sequence) -> bool:
        """Whether an allocated sequence's blocks are in the CPU pool (its table then holds CPU ids)."""
        return self._alloc(seq).on_cpu

    def can_swap_out(self, seq: Sequence) -> bool:
        alloc = self._on_gpu(seq)
        needed = {b for b in seq.block_table[alloc.num_released:] if b not in self._twins.cpu_of}
        return len(needed) <= self._cpu.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the CPU pool; returns the (gpu, cpu) copies to make. A block
        shared with a sequence swapped out earlier is not copied again."""
        if not self.can_swap_out(seq):
            raise OutOfBlocksError(f"not enough free CPU blocks to swap out sequence {seq.seq_id}")
        alloc, table, mapping = self._allocs[seq.seq_id], seq.block_table, []
        for i in range(alloc.num_released, len(table)):
            gpu = table[i]
            cpu = self._twins.cpu_of.get(gpu)
            if cpu is None:
                cpu = self._cpu.take()
                self._twins.link(gpu, cpu)
                mapping.append((gpu, cpu))
                if self.events is not None:
                    self.events.append(Event("swap_out", seq.seq_id, gpu, cpu))
            else:
                self._cpu.ref[cpu] += 1
            table[i] = cpu
            self._release_gpu([gpu])
        alloc.on_cpu = True
        seq.status = SequenceStatus.SWAPPED
        return mapping

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        alloc = self._on_cpu(seq)
        needed = {c for c in seq.block_table[alloc.num_released:] if c not in self._twins.gpu_of}
        return self._admission(len(seq.block_table) - alloc.num_released, len(needed))

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back; returns the (cpu, gpu) copies to make. Swapped-in blocks are not
        re-registered in the prefix cache."""
        if self.can_swap_in(seq) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        alloc, table, mapping = self._allocs[seq.seq_id], seq.block_table, []
        for i in range(alloc.num_released, len(table)):
            cpu = table[i]
            gpu = self._twins.gpu_of.get(cpu)
            if gpu is None:
                gpu = self._pool.take(1)[0]
                self._twins.link(gpu, cpu)
                mapping.append((cpu, gpu))
                if self.events is not None:
                    self.events.append(Event("swap_in", seq.seq_id, gpu, cpu))
            else:
                self._pool.acquire([gpu])
            table[i] = gpu
            self._release_cpu([cpu])
        alloc.on_cpu = False
        seq.status = SequenceStatus.RUNNING
        return mapping
