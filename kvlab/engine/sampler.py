"""Pick each sequence's next token from its logits: greedy, or temperature + top-k + top-p sampling.

Sampling uses the exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with
probability p_i. One vectorised draw serves the whole batch, and a seeded sequence draws its own noise row
from its own generator, so its samples do not depend on what else is in the batch: its t-th sampled token
uses the t-th noise row its generator gives (``noise_row``), whichever step produces it. Speculative
verification (``kvlab.engine.speculative.accept``) draws its rows the same way, one per token it keeps.

Nothing here can overflow or produce NaN from valid parameters: the temperature divides the logits minus
their row maximum (all <= 0, the most likely token exactly 0), so a tiny temperature gives the most likely
token (ties share) all the probability instead of inf - inf; and the most likely token survives every cut.
"""

import numpy as np
import torch

from kvlab.engine.sampling_params import SamplingParams

#: Temperatures below this (fp32's smallest normal number, 1.2e-38) act as it (a smaller one can round to 0 in
#: fp32). At this temperature, logits more than 1.2e-36 apart are a factor e^100 apart in probability: the
#: choice is the argmax, exact ties shared.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
#: Temperatures above fp32's largest number act as it (in fp32 they would be inf, and -inf / inf is NaN).
MAX_TEMPERATURE = torch.finfo(torch.float32).max


def sample_generator(seed: int, sample_index: int, device) -> torch.Generator:
    """The generator of sample ``sample_index`` of a request with ``seed``: the two numbers are mixed with
    NumPy's SeedSequence so that samples of one request, and requests with nearby seeds, draw unrelated noise."""
    state = int(np.random.SeedSequence([seed, sample_index]).generate_state(1, np.uint64)[0]) >> 1
    return torch.Generator(device=device).manual_seed(state)


def noise_row(generator: torch.Generator, probs: torch.Tensor) -> torch.Tensor:
    """One sampled token's Exp(1) noise from a sequence's own ``generator``, shaped as ``probs [V]``. Every
    token of a seeded sequence takes exactly one such row, drawn alone (a row's values and the generator's
    next state depend only on its length), so its t-th token always gets its generator's t-th row."""
    return torch.empty_like(probs).exponential_(generator=generator)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race's winners: argmax over the last dimension of ``probs / noise`` (same shapes)."""
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside a row's ``top_k [B]`` largest and outside the smallest set of most
    likely tokens whose probability reaches ``top_p [B]`` (computed after the top-k cut). The most likely
    token is always kept, so a ``top_p`` that rounds to 0 in fp32 keeps it alone. ``[B, V]`` in and out."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs   # probability of the more likely tokens; 0 for the first
    threshold = torch.where(top_p < 1.0, top_p, torch.inf)  # p = 1 keeps all, whatever the rounding of cumsum
    cut = (mass_before >= threshold[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 ``[B, V]``: row b's sampling distribution under ``params[b]`` (a greedy row's is computed at
    temperature 1 and not used)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    logits = shifted / temperature.clamp(MIN_TEMPERATURE, MAX_TEMPERATURE)[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k < vocab).any() or (top_p < 1.0).any()):
        logits = top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


class Sampler:
    def __init__(self, seed: int, device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for sequences without a seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
        """logits fp32 ``[B, V]``; row b uses ``params[b]`` and ``generators[b]`` (None: the engine's). Raises
        FloatingPointError if a row's logits hold NaN or +inf or are all -inf (a broken model or an overflow):
        no token can be chosen from it."""
        # One pass over [B, V] gives both the check and the greedy choice: a row's max (which propagates NaN)
        # is finite exactly when the row has no NaN, no +inf and not only -inf; its index is the argmax.
        best, argmax = logits.max(dim=-1)
        usable = best.isfinite()
        if not bool(usable.all()):
            rows = (~usable).nonzero().flatten().tolist()
            raise FloatingPointError(f"the model's logits hold NaN or +inf, or are all -inf (rows {rows} of the "
                                     "batch): no token can be chosen")
        if all(p.greedy for p in params):
            return argmax.tolist()
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        probs = probabilities(logits, params)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row] = noise_row(generator, probs[row])
        sampled = race(probs, noise)
        return torch.where(greedy, argmax, sampled).tolist()
