"""The swap space: the CPU pool, and which GPU and CPU blocks hold the same bytes.

Sequences that share blocks (forks, prefix hits) are swapped one at a time. When the first of them swaps
out, a shared GPU block g is copied to a CPU block c and the pair (g, c) is remembered as *twins*: the
second sequence swapping out reuses c instead of copying g again, and a sequence swapping in reuses g if it
is still there. So a shared block moves once each way. Twins are forgotten as soon as either side is freed
or g is written (an append into a partial block), because then they no longer hold the same bytes.

The swap space owns the CPU side. Once the swap calls (kvlab.blocks.manager_swap) made the GPU pool's policy
calls, it moves a sequence's table (and its group's cross-attention table, which travels with the group's last
sequence on the GPU) with ``moved_out`` / ``moved_in``, and returns the copy mappings for ``swap_blocks``. The manager calls ``forget_gpu`` for GPU blocks it frees or writes in place.
"""

from collections import Counter

from kvlab.blocks.records import AllocStatus
from kvlab.errors import InvariantViolation, OutOfBlocksError


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cpu_of: dict[int, int] = {}  # GPU block -> its CPU twin
        self._gpu_of: dict[int, int] = {}  # CPU block -> its GPU twin

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- moving a sequence ------------------------------------------------------------------------------
    @staticmethod
    def moving_out(alloc):
        """(GPU blocks a swap-out moves, the cross table moving with them or None): the cross table's blocks
        come last, if no other group member stays on the GPU."""
        cross = alloc.cross if alloc.cross is not None and alloc.cross.members_on_gpu() == 1 else None
        return alloc.live_blocks() + (cross.blocks if cross else []), cross

    @staticmethod
    def moving_in(alloc):
        """(CPU blocks a swap-in moves, the cross table moving with them or None)."""
        cross = alloc.cross if alloc.cross is not None and alloc.cross.on_cpu else None
        return alloc.live_blocks() + (cross.blocks if cross else []), cross

    def admission(self, needed: int) -> AllocStatus:
        """Whether a swap-out taking ``needed`` CPU blocks fits now, once others swap in (LATER), or never."""
        if needed > self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if needed <= self.num_free else AllocStatus.LATER

    def moved_out(self, alloc, moving, freed) -> list[tuple[int, int]]:
        """A swap-out's bookkeeping once the pool released the GPU blocks of ``moving`` (``moving_out(alloc)``),
        ``freed`` of them becoming free; returns the (gpu, cpu) copies. Cannot fail (the caller checked room)."""
        gpu_blocks, cross = moving
        cpu_blocks, mapping = self.swap_out(gpu_blocks)
        self.forget_gpu(freed)            # after swap_out, which may reuse their twins
        self._place(alloc, cross, cpu_blocks, on_cpu=True)
        return mapping

    def blocks_needed_in(self, alloc) -> tuple[int, int]:
        """(GPU blocks the swapped-in sequence holds, free GPU blocks it takes: those without a twin)."""
        cpu_blocks, _ = self.moving_in(alloc)
        return len(cpu_blocks), self.gpu_twins(cpu_blocks).count(None)

    def moved_in(self, alloc, pool, new_blocks) -> list[tuple[int, int]]:
        """A swap-in's bookkeeping once the policy handed out ``new_blocks``, one per CPU block without a GPU
        twin; returns the (cpu, gpu) copies. Cannot fail."""
        cpu_blocks, cross = self.moving_in(alloc)
        twins = self.gpu_twins(cpu_blocks)
        pool.fill(new_blocks)
        pool.claim([gpu for gpu in twins if gpu is not None], 0)  # twins are in use: none was free
        gpu_blocks, mapping = self.swap_in(cpu_blocks, twins, new_blocks)
        self._place(alloc, cross, gpu_blocks, on_cpu=False)
        return mapping

    @staticmethod
    def _place(alloc, cross, blocks, on_cpu) -> None:
        """Point the table (and cross table) at ``blocks``, given in ``moving_*`` order."""
        num_live = len(alloc.table) - alloc.num_released
        alloc.table[alloc.num_released:] = blocks[:num_live]
        alloc.on_cpu = on_cpu
        if cross is not None:
            cross.blocks, cross.on_cpu = blocks[num_live:], on_cpu

    # ---- GPU -> CPU -------------------------------------------------------------------------------------
    def blocks_needed_out(self, gpu_blocks) -> int:
        """CPU blocks a swap-out of ``gpu_blocks`` takes (those without a CPU twin)."""
        return len({g for g in gpu_blocks if g not in self._cpu_of})

    def swap_out(self, gpu_blocks) -> tuple[list[int], list[tuple[int, int]]]:
        """The CPU blocks now holding ``gpu_blocks`` (one per entry) and the (gpu, cpu) copies to make. The
        caller releases the GPU blocks afterwards and checked ``blocks_needed_out`` against ``num_free``."""
        cpu_blocks, mapping = [], []
        for gpu in gpu_blocks:
            cpu = self._cpu_of.get(gpu)
            if cpu is None:
                if not self._free:
                    raise OutOfBlocksError("no free CPU block")
                cpu = self._free.pop()
                self.ref[cpu] = 1
                self._link(gpu, cpu)
                mapping.append((gpu, cpu))
            else:
                self.ref[cpu] += 1
            cpu_blocks.append(cpu)
        return cpu_blocks, mapping

    # ---- CPU -> GPU -------------------------------------------------------------------------------------
    def gpu_twins(self, cpu_blocks) -> list:
        """For each CPU block, the GPU block still holding its bytes, or None (it needs a new GPU block)."""
        return [self._gpu_of.get(cpu) for cpu in cpu_blocks]

    def swap_in(self, cpu_blocks, twins, new_gpu_blocks) -> tuple[list[int], list[tuple[int, int]]]:
        """Bring ``cpu_blocks`` back: entries with a GPU twin (``twins = gpu_twins(cpu_blocks)``) reuse it,
        the others take ``new_gpu_blocks`` in order. Returns the GPU blocks (one per entry) and the
        (cpu, gpu) copies to make, and releases the CPU blocks."""
        fresh = iter(new_gpu_blocks)
        gpu_blocks, mapping = [], []
        for cpu, gpu in zip(cpu_blocks, twins):
            if gpu is None:
                gpu = next(fresh)
                self._link(gpu, cpu)
                mapping.append((cpu, gpu))
            gpu_blocks.append(gpu)
        self.release(cpu_blocks)
        return gpu_blocks, mapping

    # ---- bookkeeping ------------------------------------------------------------------------------------
    def release(self, cpu_blocks) -> None:
        """One reference less to each CPU block; a freed block forgets its twin."""
        for cpu in cpu_blocks:
            self.ref[cpu] -= 1
            if not self.ref[cpu]:
                self._free.append(cpu)
                gpu = self._gpu_of.pop(cpu, None)
                if gpu is not None:
                    del self._cpu_of[gpu]

    def forget_gpu(self, gpu_blocks) -> None:
        """These GPU blocks were freed or written in place: their CPU twins no longer hold the same bytes."""
        if self._cpu_of:
            for gpu in gpu_blocks:
                cpu = self._cpu_of.pop(gpu, None)
                if cpu is not None:
                    del self._gpu_of[cpu]

    def _link(self, gpu: int, cpu: int) -> None:
        self._cpu_of[gpu] = cpu
        self._gpu_of[cpu] = gpu

    def check(self, table_refs: Counter, gpu_ref) -> None:
        """Raise InvariantViolation unless CPU ref counts equal ``table_refs`` (CPU block -> entries using
        it), the free list is their complement, and every twin link joins two live blocks, both ways."""
        for block in range(self.num_blocks):
            if self.ref[block] != table_refs.get(block, 0):
                raise InvariantViolation(f"CPU block {block}: ref count {self.ref[block]}, "
                                         f"{table_refs.get(block, 0)} entries use it")
        if len(self._free) != len(set(self._free)) or set(self._free) != {
                b for b in range(self.num_blocks) if self.ref[b] == 0}:
            raise InvariantViolation("CPU free list disagrees with CPU ref counts")
        if len(self._cpu_of) != len(self._gpu_of) or any(self._gpu_of.get(c) != g for g, c in self._cpu_of.items()):
            raise InvariantViolation("twin links are not one-to-one both ways")
        for gpu, cpu in self._cpu_of.items():
            if gpu_ref[gpu] == 0 or self.ref[cpu] == 0:
                raise InvariantViolation(f"twin link {gpu}<->{cpu} outlived one of its blocks")
