"""A solution of kvlab.puzzles.rejection_sampling."""


def verify(drafts, draft_probs, target_probs, uniforms, sample):
    for i, draft in enumerate(drafts):
        if uniforms[i] * draft_probs[i][draft] <= target_probs[i][draft]:  # accepted with probability min(1, p/q)
            continue
        residual = [max(p - q, 0.0) for p, q in zip(target_probs[i], draft_probs[i])]
        total = sum(residual)
        return list(drafts[:i]) + [sample([r / total for r in residual])]  # the recovered token
    return list(drafts) + [sample(target_probs[len(drafts)])]  # the bonus token
