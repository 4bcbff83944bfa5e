"""``LLM``: load a local Hugging Face model and serve it with continuous batching on kvlab's paged KV cache.

Offline: ``llm.generate(prompts, SamplingParams(...))``, or ``llm.chat(messages)`` through the tokenizer's chat
template. Step by step (to watch the pool between steps):
``llm.add_request(...)``, then ``llm.step()`` while ``llm.has_unfinished_requests()``. Every request's output
is returned exactly once: by the ``generate`` call that added it, else by ``step``.
"""

import itertools
import logging
from dataclasses import replace

from tqdm.auto import tqdm

from kvlab.blocks.tiers import check_offload_options
from kvlab.engine.chat import render
from kvlab.engine.config import load_model_config
from kvlab.engine.hybrid import make_block_manager
from kvlab.engine.intake import RequestIntake, load_tokenizer, prompt_token_ids
from kvlab.engine.kv_calibration import quantize_kv_cache
from kvlab.engine.parts import check_model_for_parts, check_parts
from kvlab.engine.kv_cache import (CPU_KV_CACHE_BYTES, PagedKVCache, blocks_for_memory, check_kernel_support,
                                   engine_kv_cache_groups, kivi_window_bytes)
from kvlab.engine.request import Request, RequestOutput
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampler import Sampler
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.schedulers import SchedulerConfig
from kvlab.engine.settings import (check_every_layer_from_env, check_kivi_options, check_kv_cache_options,
                                   check_settings, resolve_device, resolve_dtype, resolve_quantized_backend)
from kvlab.engine.speculative import resolve_speculative_config
from kvlab.engine.step_loop import StepLoop
from kvlab.engine.step_record import records_to_dataframe
from kvlab.engine.weights import load_model
from kvlab.errors import InvalidArgumentError
from kvlab.studies.doctor import DoctorView, HitDoctor
from kvlab.sizing import KVCacheConfig
from kvlab.validation import check_int, is_int

logger = logging.getLogger(__name__)


class LLM:
    """``model``: a local directory with ``config.json`` and ``*.safetensors`` (Llama or Qwen3 architecture);
    its tokenizer is loaded when the directory has one. ``num_blocks=None`` takes as many KV blocks as the
    memory budget allows (see ``kv_cache.blocks_for_memory``: on CPU a fixed 256 MiB, on a GPU what
    ``gpu_memory_utilization`` leaves); the pool made is logged at INFO level on the ``kvlab.engine.llm``
    logger (``logging.basicConfig(level=logging.INFO)`` shows it). ``llm.kv_cache_config`` is the value the
    pool, the block manager and the cache tensors are made from (``kvlab.sizing.KVCacheConfig``, vLLM's: the KV
    cache groups with their layers and pages, the blocks, the tensors the groups share). ``preemption_mode``:
    "recompute" (free the newest sequence and prefill it again later) or "swap" (move its blocks to
    ``num_cpu_blocks`` CPU blocks, default as many as the device pool). ``dtype``/``device`` None: fp32 on CPU,
    the checkpoint's dtype on a GPU. ``max_model_len`` defaults to the config's ``max_position_embeddings``.
    ``attention_backend``: "triton" (kvlab's kernels; interpreted on CPU) or "torch" (batched torch ops on the
    same paged cache); None picks "triton" on CUDA and "torch" elsewhere, and ``llm.attention_backend`` says
    which runs.

    ``num_offload_blocks``: CPU blocks of an offload tier for cached prefixes (0: none; kvlab.blocks.tiers):
    a prefix the pool evicts is kept there (``offload_policy`` "lru" or "arc", ``offload_admission`` "always"
    or "reused") and copied back when a prompt hits it; full-attention models with prefix caching only.

    ``scheduling``: "v1" (the default) or "v0". V1 is vLLM V1's scheduler, what vLLM runs today: each step
    spends one budget of ``max_num_batched_tokens`` on the running sequences' decode tokens first, then on
    prompt chunks, all in one forward pass, so a prompt longer than the budget is served over several steps
    and a long prompt does not stall the decodes running beside it (``kvlab.engine.scheduler_v1``). V0 (vLLM
    V0 and nano-vllm without chunked prefill) runs a step of whole prompts or a step of decodes and refuses a
    prompt longer than the budget; it is kept to compare the two (``kvlab.engine.scheduler``).
    ``scheduler``: a name in ``kvlab.engine.schedulers.SCHEDULERS`` ("v1", "v0", or one you added) or your own
    ``Scheduler`` subclass; ``scheduling`` names only the built-ins, and given both they must agree
    (``kvlab.engine.schedulers``). ``llm.scheduling`` is the family of the scheduler that runs.
    ``scheduling_policy``: the order waiting prompts are admitted in, "fcfs" (arrival order, the default, as
    vLLM's ``scheduling_policy``) or "lpm" (longest cached prefix first, SGLang's ``--schedule-policy lpm``,
    falling back to FCFS past a queue length and an overtake bound so nothing starves:
    ``kvlab.engine.queue_order``). Greedy outputs per request are the same either way; hits and latency differ.

    ``kv_cache_dtype``: "auto" (K/V in the model's dtype) or a quantized cache, vLLM's "fp8" (= "fp8_e4m3"),
    "fp8_e4m3", "fp8_e5m2", or kvlab's "kivi_int4" / "kivi_int2" (KIVI, Liu et al. 2024: keys per channel over
    groups of G = 32 tokens, values per token, scales from the data; "kivi_int4_g128" etc. for another G; the
    newest ``kv_residual_length`` tokens, R, in full precision, see ``kvlab.kernels.torch_paged_quant``),
    "int4_calibrated_channel" (4-bit keys per channel with offline-calibrated ranges, values per token, no
    window) and "k_fp16_v_fp8" (K in fp16, V in fp8): ``reshape_and_cache`` quantizes on write, attention dequantizes on
    read, and the pool holds more blocks in the same bytes (``kvlab.sizing.kv_dtypes``). fp8 scales are 1.0
    (vLLM's default) unless ``kv_calibration_prompts`` (prompts run once through the model before serving)
    set them from the K/V ranges seen, per layer (``kv_scale_granularity="tensor"``) or per KV head ("head");
    int4_calibrated_channel needs calibration (``kvlab.engine.kv_calibration``). Quantized caches run on the
    torch attention backend (None picks it; see ``settings.resolve_quantized_backend`` for the Triton kernels' share).

    ``kv_events=True`` publishes vLLM's KV cache events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``:
    what enters and leaves the prefix cache, for a router) on ``llm.kv_events``, the block manager's stream
    (kvlab.blocks.events), with its subscription API: ``llm.kv_events.subscribe(callback)``,
    ``llm.kv_events.subscribe()`` to iterate, ``llm.kv_events.write_jsonl(path)``. A hybrid model's events carry
    their KV cache group (``group_idx``, ``kv_cache_spec_*``). A subscriber that raises is dropped with a
    ``KVEventSubscriberWarning``; no request loses its output to it. Off (the default), ``llm.kv_events`` is None.

    ``prefix_match_unit``: None (the default: the prefix cache matches whole blocks) or a divisor of
    ``block_size`` (vLLM's ``hash_block_size``): the cache also finds the first whole units of a partial block,
    copied into the new sequence's own block before the step (``kvlab.blocks.manager``), so a block size picked
    for a page (vLLM #40696's 528 tokens) still gives hits at that unit. Not with a sliding window, an offload
    tier, speculative decoding's EAGLE rule or a KIVI cache.

    ``record_decisions=True`` keeps each step's scheduling decision in ``llm.decisions`` (one
    ``kvlab.engine.decisions.StepDecision`` per step record: who ran and as what, who was preempted or
    aborted, the queues), by request id; it grows by one per step. Off (the default) nothing is built and
    ``llm.decisions`` is None.

    ``speculative_config``: None (the default), or vLLM's dictionary for a model-free proposer, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}``:
    each decoding sequence gets up to k proposed tokens per step, verified in the step's one forward pass;
    greedy output is unchanged, sampled output keeps its distribution (``kvlab.engine.speculative``). V1
    scheduling only. ``RequestOutput.metrics`` and the step records count drafts proposed and accepted.

    ``parts``: None, or a ``kvlab.engine.parts.EngineParts`` whose parts (a learner's slot mapping, block
    hashes, LRU policy, torch attention, n-gram proposer, rejection sampling, admission) replace kvlab's own
    in this engine (the course's capstone, ``kvlab.course.engine_with``, builds it); ``llm.parts`` is what it
    got.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 preemption_mode: str = "recompute", dtype=None, device=None, max_model_len: int | None = None,
                 num_cpu_blocks: int | None = None, gpu_memory_utilization: float = 0.9, seed: int = 0,
                 record_events: bool = False, attention_backend: str | None = None, scheduling: str | None = None,
                 scheduler=None, record_decisions: bool = False, kv_events: bool = False, num_offload_blocks: int = 0,
                 offload_policy: str = "lru", offload_admission: str = "always", kv_cache_dtype: str = "auto",
                 kv_scale_granularity: str = "tensor", kv_calibration_prompts=None, kv_residual_length=None,
                 speculative_config: dict | None = None, scheduling_policy: str = "fcfs",
                 prefix_match_unit: int | None = None, parts=None):
        check_settings(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       preemption_mode=preemption_mode, max_model_len=max_model_len,
                       num_cpu_blocks=num_cpu_blocks, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                       record_events=record_events, kv_events=kv_events, record_decisions=record_decisions)
        check_int("num_offload_blocks", num_offload_blocks, 0)
        check_offload_options(offload_policy, offload_admission)
        check_kv_cache_options(kv_cache_dtype, kv_scale_granularity, kv_calibration_prompts)
        residual_length = check_kivi_options(kv_cache_dtype, kv_residual_length, block_size, speculative_config)
        if prefix_match_unit is not None and residual_length is not None:
            raise InvalidArgumentError("prefix_match_unit does not combine with a KIVI cache (its full-precision "
                                       "windows hold a block's newest tokens apart from the pages) yet; pass None")
        self.speculation = resolve_speculative_config(speculative_config)
        self.parts = parts = check_parts(parts, speculation=self.speculation, attention_backend=attention_backend,
                                         kv_cache_dtype=kv_cache_dtype)
        if parts.ngram_proposer is not None:
            self.speculation = replace(self.speculation, proposer=parts.proposer(
                self.speculation.proposer.min_n, self.speculation.proposer.max_n))
        scheduler_config = SchedulerConfig(scheduler=scheduler, scheduling=scheduling,
                                           scheduling_policy=scheduling_policy, preemption_mode=preemption_mode,
                                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                           drafter=self.speculation)
        self.device = resolve_device(device)
        if parts.replaces_attention and attention_backend is None:
            attention_backend = "torch"  # a learner's attention is torch (the torch backend's seam)
        self.attention_backend = resolve_quantized_backend(attention_backend, kv_cache_dtype, self.device)
        check_every_layer = check_every_layer_from_env()
        self.model_config = config = load_model_config(model)
        self.tokenizer = load_tokenizer(config.path)  # before the weights and the cache: fails fast
        self.dtype = resolve_dtype(dtype, config, self.device)
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            raise InvalidArgumentError(f"max_model_len={max_model_len} is longer than the model's context "
                                       f"({config.max_position_embeddings} positions)")
        self.max_model_len = max_model_len or config.max_position_embeddings
        if self.speculation is not None:  # drafts are proposals: one that is no token id of this model is refused
            self.speculation = replace(self.speculation, vocab_size=config.vocab_size)
        scheduler_config = replace(scheduler_config, drafter=self.speculation,
                                   max_model_len=self.max_model_len)  # no draft past it
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduling = scheduler_config.scheduler_class.scheduling
        # The KV cache groups, and from them the one KVCacheConfig every part below is made from: the block
        # size and the cache format are read from the settings here and nowhere else.
        groups = engine_kv_cache_groups(config, self.dtype, kv_cache_dtype, block_size, prefix_match_unit)
        check_model_for_parts(parts, groups, config.path)
        check_kernel_support(config, groups, self.dtype, self.device, self.attention_backend)
        self.model = load_model(config, self.dtype, self.device)
        self.model.init_rope(self.dtype, self.device)
        self.kv_cache_dtype = kv_cache_dtype
        calibration = kv_calibration_prompts and [
            prompt_token_ids(self.tokenizer, config, prompt, self.max_model_len) for prompt in kv_calibration_prompts]
        self.kv_quantizers = quantize_kv_cache(self.model, groups, kv_scale_granularity, calibration, self.dtype,
                                               self.device, residual_length)
        sized_by = f"num_blocks={num_blocks}"
        if num_blocks is None:
            sized_by = ("num_blocks=None: gpu_memory_utilization less weights and activations"
                        if self.device.type == "cuda" else
                        f"num_blocks=None: the CPU budget, {CPU_KV_CACHE_BYTES >> 20} MiB")
            # Useful at most: every sequence at full length in every group.
            longest = sum(-(-self.max_model_len // group.block_size) for group in groups)
            num_blocks = blocks_for_memory(
                groups, config, self.dtype, self.device, gpu_memory_utilization=gpu_memory_utilization,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                max_useful_blocks=max_num_seqs * longest,
                window_bytes=kivi_window_bytes(config, self.dtype, residual_length, max_num_seqs))
        #: vLLM's KVCacheConfig: the groups, their layers, the blocks and the tensors they share.
        self.kv_cache_config = KVCacheConfig(groups, num_blocks)
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks if preemption_mode == "swap" else 0
        self.block_manager = make_block_manager(self.kv_cache_config, num_cpu_blocks=num_cpu_blocks,
                                                enable_prefix_caching=enable_prefix_caching,
                                                record_events=record_events, kv_events=kv_events,
                                                num_offload_blocks=num_offload_blocks,
                                                offload_policy=offload_policy, offload_admission=offload_admission,
                                                **parts.block_manager_options())
        self.kv_events = self.block_manager.kv_events  # vLLM's KV cache events, None unless kv_events=True
        self.kv_cache = PagedKVCache(self.kv_cache_config, self.dtype, self.device, num_cpu_blocks,
                                     num_offload_blocks, parts.copy_blocks if parts.triton_copy_blocks else None)
        if residual_length is not None:  # KIVI: the full-precision windows follow the block moves
            self.kv_cache.windows = [layer.self_attn.kv_window for layer in self.model.model.layers]
        logger.info("KV cache: %s (%s)", self.kv_cache.summary(), sized_by)
        #: Names the cause of every prompt token the scheduler admits (``miss_causes``; kvlab.studies.doctor).
        self.hit_doctor = HitDoctor(self.block_manager)
        self.scheduler = scheduler_config.build(DoctorView(self.block_manager, self.hit_doctor))
        if parts.can_allocate is not None:
            self.scheduler.admission = parts.admit
        if parts.preemption is not None:
            if self.scheduler.scheduling != "v1":
                raise InvalidArgumentError(f"parts: preemption is the V1 scheduler's (scheduling='v1'); this "
                                           f"engine's scheduling is {self.scheduler.scheduling!r}")
            self.scheduler.preemption = parts.preempt
        if parts.v1_step is not None:
            if self.scheduler.scheduling != "v1":
                raise InvalidArgumentError(f"parts: v1_step is the V1 scheduler's step (scheduling='v1'); this "
                                           f"engine's scheduling is {self.scheduler.scheduling!r}")
            self.scheduler.token_allocation = parts.allocate_tokens
        if residual_length is not None:  # KIVI: a freed sequence's open chunks leave the windows with it
            self.scheduler.on_blocks_freed = self.kv_cache.forget_blocks
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.attention_backend,
                                  check_every_layer=check_every_layer,
                                  kivi=None if residual_length is None else self.kv_quantizers[0], parts=parts)
        self._loop = StepLoop(self.scheduler, self.runner, Sampler(seed, self.device), config.eos_token_ids,
                              self.max_model_len, record_decisions,
                              **({"verify": parts.accept} if parts.rejection_sampling is not None else {}))
        self._intake = RequestIntake(config, self.tokenizer, self.max_model_len, self.scheduler, max_num_batched_tokens)
        self._request_ids = itertools.count()
        self._unreturned: list[RequestOutput] = []  # outputs generate() saw for requests it did not add

    # ---- the step-level API ------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one prompt (a string, or a list of token ids); it joins the batch at a coming step (``params``
        None: ``default_sampling_params()``). Returns its id. Raises before queueing anything if the prompt or
        the parameters cannot be served."""
        params = self._intake.params(params)
        token_ids = self._intake.encode(prompt)
        if request_id is not None and (not isinstance(request_id, str) or request_id in self._ids_in_use()):
            raise InvalidArgumentError(f"request_id must be a new string (not the id of a request that is "
                                       f"unfinished or whose output step() has not returned yet), got {request_id!r}")
        return self._queue(prompt, token_ids, params, request_id)

    def _ids_in_use(self) -> set[str]:
        """Ids that one output of a coming step() could carry: two requests must never share one."""
        return ({*self._loop.requests} | {r.request_id for r in self._loop.finished_between}
                | {o.request_id for o in self._unreturned})

    def _queue(self, prompt, token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        if request_id is None:
            in_use = self._ids_in_use()
            request_id = str(next(self._request_ids))
            while request_id in in_use:  # a caller may have taken that name
                request_id = str(next(self._request_ids))
        request = Request.create(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                                 self.block_manager.block_size, self.device)
        self._loop.add(request)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step. Returns the outputs not returned yet: first those of requests that
        finished since the last call (aborted with ``abort_request`` or by a failed step, or finished during
        ``generate``, which returns only its own), then those that finished in this step. Returns them even
        when nothing is queued (then no step runs)."""
        finished = self._outputs(self._loop.step())
        outputs, self._unreturned = self._unreturned + finished, []
        return outputs

    def _outputs(self, requests) -> list[RequestOutput]:
        return [r.output(self.tokenizer) for r in requests]

    def has_unfinished_requests(self) -> bool:
        """Whether some request's output has not been returned yet: it is in flight, or finished and waiting
        for the next ``step`` (so ``while llm.has_unfinished_requests(): llm.step()`` collects every output)."""
        return bool(self._loop.requests or self._loop.finished_between or self._unreturned)

    def abort_request(self, request_id: str) -> None:
        """Stop a request between steps: its unfinished samples end with finish_reason "abort", and the next
        ``step`` returns its output. An id that is unknown or already finished is ignored (a request may
        finish just before the caller aborts it)."""
        if not isinstance(request_id, str):
            raise InvalidArgumentError(f"request_id must be a string, got {type(request_id).__name__}")
        self._loop.abort(request_id, "aborted by the caller")

    # ---- offline generation ------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run ``prompts`` (a list of strings or of token-id lists, or one string) to completion, in a batch
        with any requests already queued. ``sampling_params``: one for all, or a list with one per prompt;
        None: ``default_sampling_params()``. Every prompt is checked before the first is queued. ``use_tqdm``:
        show a tqdm progress bar counting finished requests (``tqdm.auto``: a widget in notebooks). Returns
        the outputs of these prompts, in order; outputs of other requests that finish meanwhile are kept and
        returned by the next ``step()`` (as are these prompts' outputs if generate raises)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or any(is_int(p) for p in prompts):
            raise InvalidArgumentError("prompts must be a list of strings or of token-id lists (e.g. [[1, 2, 3]])")
        params = self._intake.params_for(sampling_params, len(prompts))
        token_ids = [self._intake.encode(prompt) for prompt in prompts]  # all checked before any is queued
        return self._run(prompts, token_ids, params, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them, as
        vLLM's ``LLM.chat``: each is rendered by the tokenizer's chat template with the generation prompt and
        encoded without adding special tokens (the template writes its own BOS; see ``kvlab.engine.chat``),
        then run as ``generate`` runs token ids (same ``sampling_params`` and ``use_tqdm``). Each output's
        ``prompt`` is the rendered text. Raises NoTokenizerError or NoChatTemplateError when the model cannot
        chat, InvalidArgumentError for a malformed conversation, before anything is queued."""
        rendered = render(self.tokenizer, self.model_config.path, messages)
        params = self._intake.params_for(sampling_params, len(rendered))
        token_ids = [self._intake.encode(ids) for _, ids in rendered]  # the length checks; all before any is queued
        return self._run([text for text, _ in rendered], token_ids, params, use_tqdm)

    def _run(self, prompts, token_ids, params, use_tqdm: bool) -> list[RequestOutput]:
        ids = [self._queue(*args) for args in zip(prompts, token_ids, params)]
        pending, done = set(ids), {}
        try:
            with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
                while pending:
                    for output in self._outputs(self._loop.step()):
                        if output.request_id in pending:
                            pending.discard(output.request_id)
                            done[output.request_id] = output
                            bar.update(1)
                        else:
                            self._unreturned.append(output)
        except BaseException:
            self._unreturned += done.values()  # finished, not returned: the next step() returns them
            raise
        return [done[i] for i in ids]

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets, as vLLM's ``generation_config="auto"``: the model's
        ``generation_config.json`` temperature, top_p, top_k and max_new_tokens (as max_tokens; ``do_sample:
        false`` is greedy), SamplingParams' defaults for what it does not set. A SamplingParams passed
        explicitly replaces all of it: its unset fields take SamplingParams' defaults, not the file's."""
        return self._intake.default_params()

    # ---- what happened ------------------------------------------------------------------------------------
    @property
    def prefix_cache_stats(self):
        """Overall prefix-cache counters (hit and queried tokens and blocks, ``hit_rate``; a request
        preempted by recompute finds its own blocks again under ``recomputed_*``, never as hits), cumulative;
        per run, ``make_prefix_cache_stats()``; per request, ``RequestOutput.metrics.num_cached_prompt_tokens``."""
        return self.block_manager.stats

    @property
    def miss_causes(self):
        """Every prompt token admitted so far, cumulative: hit on the GPU, hit in the offload tier, or missed
        and why (cold, evicted, partial block, group cut, speculative drop, isolated by a cache salt, recomputed
        after a preemption, lost in the tier): a DataFrame of tokens and shares per cause
        (``kvlab.studies.doctor``; ``hit_doctor.tokens`` has the counts, ``hit_doctor.reuse_distances`` the
        evicted blocks' reuse distances in admissions)."""
        return self.hit_doctor.table()

    def make_prefix_cache_stats(self):
        """The prefix-cache counters since the last call (a run's; vLLM V1's name), then a new run starts."""
        return self.block_manager.make_prefix_cache_stats()

    @property
    def step_records(self) -> list:
        return self._loop.records

    @property
    def decisions(self) -> list | None:
        """Each step's scheduling decision (``kvlab.engine.decisions.StepDecision``), ``decisions[i]`` for
        ``step_records[i]``; None unless the engine was made with ``record_decisions=True``."""
        return self._loop.decisions

    def step_dataframe(self):
        """One row per step (see ``kvlab.engine.step_record.StepRecord``), for ``kvlab.viz.draw_engine_timeline``."""
        return records_to_dataframe(self._loop.records)
