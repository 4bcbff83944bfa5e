"""A solution of kvlab.puzzles.preemption."""


def preemption(blocks_held, needs_block, num_free_blocks):
    queue, scheduled, waiting, free = list(range(len(blocks_held))), [], [], num_free_blocks
    while queue:
        request = queue.pop(0)
        while needs_block[request] and free == 0:
            victim = queue.pop() if queue else request
            free += blocks_held[victim]
            waiting.insert(0, victim)
            if victim == request:
                break
        else:
            free -= needs_block[request]
            scheduled.append(request)
    return scheduled, waiting
