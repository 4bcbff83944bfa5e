"""A solution of kvlab.puzzles.v1_step."""


def v1_step(running, waiting, token_budget, max_num_seqs):
    budget, running_tokens = token_budget, []
    for left in running:
        tokens = min(left, budget)
        running_tokens.append(tokens)
        budget -= tokens
    admitted = []
    for prompt in waiting:
        if not budget or len(running) + len(admitted) >= max_num_seqs:
            break
        admitted.append(min(prompt, budget))
        budget -= admitted[-1]
    return running_tokens, admitted
