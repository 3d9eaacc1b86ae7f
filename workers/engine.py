"""The engine: one `step()` schedules, runs the model, applies the sampled tokens and emits outputs.

It wires the parts together and asks; it owns no state of its own kind. The scheduler (through its KV
cache manager) owns requests' progress and blocks, the model runner owns the cache tensors and the forward
pass, and the output processor owns text, stop strings, logprobs and `RequestOutput`s. Requests with
`n > 1` become sibling sequences that share the prompt's blocks."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from workers.config import EngineConfig, check_async_speculation, default_speculation_limit
from workers.kv_cache_manager import KVCacheManager
from workers.model_loader import (dtype_name, load_hf_config, load_tokenizer, resolve_dtype, resolve_model_path,
                                  weight_files)
from workers.model_setup import build_model, kv_blocks, make_runner, profile_kv_budget
from workers.model_runner import ModelRunner
from workers.models.llama import LlamaForCausalLM
from workers.onednn_caches import bound_onednn_caches
from workers.output_processor import OutputKind, OutputProcessor
from workers.penalties import bad_words_token_ids
from workers.outputs import RequestOutput
from workers.request import Request, RequestStatus
from workers.request_queue import make_request_queue
from workers.run_ahead import InFlight, RunAhead
from workers.sampling_params import SamplingParams, check_int
from workers.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.sizing import dtype_device, resolve_device, resolve_max_model_len
from workers.step_isolation import IsolatedStep, execute_isolating
from workers.structured_output import StructuredOutputManager


@dataclass(slots=True)
class KVImport:
    """KV of the first `num_tokens` prompt tokens computed elsewhere (a prefill replica), in the
    `workers.kv_transfer` payload layout."""

    num_tokens: int
    payload: torch.Tensor


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    computed_tokens: int
    finished: dict[str, int]
    num_pending_tokens: int = 0  # prompt (or recompute) tokens not yet computed: the prefill backlog
    num_kv_held: int = 0  # finished prefill-only requests whose blocks wait for their transfer
    num_kv_import_fallbacks: int = 0  # imports that found no free blocks and were recomputed instead
    token_gaps: list[float] = field(default_factory=list)  # inter-token gaps (s) since the previous get_stats()
    # Speculation (vLLM's spec_decode_* counters): drafting steps of a request, drafts, drafts kept, and drafts
    # kept by position in the draft (index 0: the first).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


def _load_predictor(path: str | None):
    """The trained length predictor at `path` (for the `predicted` policy), or None for its default."""
    if path is None:
        return None
    from workers.length_predictor import LinearLengthPredictor

    return LinearLengthPredictor.load(path)


@dataclass(slots=True)
class _PendingOutputs:
    """A step's sampled sequences whose outputs are not made yet (`Engine.overlap_outputs`)."""

    sampled: list[Request]
    logprobs: list
    prompt_logprobs: dict


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        if config.dtype == "auto":  # one concrete dtype for every rank, and for whoever reads the config
            config = dataclasses.replace(config, dtype=dtype_name(resolve_dtype("auto", dtype_device(config))))
        self.config = config
        bound_onednn_caches()
        torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model)
        hf_config = load_hf_config(path)
        files = weight_files(path)
        self.model_path = path
        self.tokenizer = load_tokenizer(path)
        self.dtype = resolve_dtype(config.dtype)
        self.max_model_len = resolve_max_model_len(config, hf_config)
        self.model: LlamaForCausalLM | None = None  # in this process only without tensor parallelism
        if config.tensor_parallel_size > 1:
            from workers.tp_runner import TPModelRunner

            # the grammar bitmask is filled here on the host and goes to rank 0 with the step
            self.structured = StructuredOutputManager(self.tokenizer, hf_config.vocab_size, config.max_num_seqs)
            self.runner = TPModelRunner(config, path, hf_config, self.dtype, self.max_model_len, self.structured)
            self.device, self.num_kv_blocks = self.runner.device, self.runner.num_kv_blocks
        else:
            self.device = resolve_device(config.device)
            self.structured = StructuredOutputManager(self.tokenizer, hf_config.vocab_size, config.max_num_seqs,
                                                      self.device)
            self.model, attn = build_model(config, files, hf_config, self.dtype, self.device, self.max_model_len)
            budget = (profile_kv_budget(self.model, attn, config, self.dtype, self.device, self.max_model_len)
                      if self.device.type == "cuda" else None)
            self.num_kv_blocks = kv_blocks(config, self.model.args, self.model.part, self.dtype, self.max_model_len,
                                           budget)
            self.runner = make_runner(self.model, attn, config, self.num_kv_blocks, self.dtype, self.device,
                                      self.max_model_len, self.structured)
        self.kv_cache = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        graphs = getattr(self.runner, "graphs", None)
        spec_limit = default_speculation_limit(config, graphs.sizes[-1] if graphs is not None else None)
        check_async_speculation(config.async_scheduling, config.num_speculative_tokens, spec_limit)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                            self.max_model_len, config.num_speculative_tokens, config.prompt_lookup_max,
                            config.prompt_lookup_min, spec_limit),
            self.kv_cache, make_request_queue(config.scheduling_policy, _load_predictor(config.length_predictor)))
        self.outputs = OutputProcessor(self.tokenizer, config.stream_interval)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else getattr(hf_config, "eos_token_id", None)
        self.vocab_size = hf_config.vocab_size
        self._computed_tokens = 0
        self.failed: dict[str, str] = {}  # requests the latest step failed and aborted: id -> error message
        # On a GPU, a step's outputs are made while the device runs the next step (see `step`).
        self.overlap_outputs = (isinstance(self.runner, ModelRunner) and self.device.type == "cuda"
                                and not config.disable_async_output_proc)
        self._pending: _PendingOutputs | None = None
        # On one GPU, each decode step without drafts is queued behind the one the device runs (`step`): without
        # speculation, or with it off for batches above `speculative_disable_by_batch_size` (by default, with
        # CUDA graphs, above the requests whose drafts fit the largest graph: `default_speculation_limit`).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None else
                                 isinstance(self.runner, ModelRunner) and self.device.type == "cuda"
                                 and (not config.num_speculative_tokens or spec_limit is not None))
        self._inflight: InFlight | None = None
        self._ahead = RunAhead(self.scheduler, self.runner, self.structured)

    @property
    def steps_queued_ahead(self) -> int:
        """Decode steps queued on the device behind the one in flight so far (`async_scheduling`)."""
        return self._ahead.steps_queued

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (a local model needs nothing)."""
        self.runner.close()

    # ---- requests in and out -------------------------------------------------------------------

    def validate_prompt(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None) -> list[int]:
        """Token ids for the prompt, checked for emptiness, range and length."""
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer(prompt).input_ids
            elif isinstance(prompt, list):
                prompt_token_ids = prompt
            else:
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids):,} tokens; max_model_len is {self.max_model_len:,} "
                             "(and at least one token must be generated)")
        return list(prompt_token_ids)

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None, priority: int = 0,
                    output_kind: OutputKind = OutputKind.CUMULATIVE, hold_kv: bool = False,
                    kv_import: KVImport | None = None) -> None:
        """Queue a request. Raises ValueError, leaving the engine untouched, if the request is invalid
        (its `params` are validated again here, in case they were changed after construction).

        `hold_kv`: keep the prompt's blocks when the request finishes, for `export_kv` / `release_kv`
        (a prefill replica). `kv_import`: start from KV computed elsewhere for the first
        `kv_import.num_tokens` prompt tokens (a decode replica); if the pool has no room for it now, the
        prompt is recomputed instead."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        check_int("priority", priority)
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate_prompt(prompt, prompt_token_ids)
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt has {len(ids):,} tokens and max_tokens is {max_tokens:,}, together more than "
                             f"max_model_len {self.max_model_len:,}")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens:,}) exceeds the {max_tokens:,} tokens this request "
                             "may generate")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:3]}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"{name} ({getattr(params, name)}) exceeds the vocabulary size {self.vocab_size}")
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad[:3]}")
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words or [])
        if any(t >= self.vocab_size for w in bad_words for t in w):
            raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary of {self.vocab_size}")
        if (hold_kv or kv_import is not None) and params.n != 1:
            raise ValueError("KV hand-off (hold_kv / kv_import) supports n=1 only")
        grammar = None if params.structured_outputs is None else self.structured.compile(params.structured_outputs)
        if kv_import is not None:
            if not 0 < kv_import.num_tokens < len(ids):
                raise ValueError(f"imported KV covers {kv_import.num_tokens} tokens; the prompt has {len(ids)} "
                                 "(at least the last prompt token must be computed here)")
            self.runner.check_kv_payload(kv_import.num_tokens, kv_import.payload)
            if params.prompt_logprobs is not None:
                kv_import = None  # prompt logprobs need the prompt's logits: compute it here
        arrival = time.monotonic() if arrival_time is None else arrival_time
        reqs = [Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, max_tokens, arrival,
                        priority, self.eos_token_id, parent_id=request_id, index=i,
                        seed=None if params.seed is None else params.seed + i, hold_kv=hold_kv,
                        bad_words_token_ids=bad_words)
                for i in range(params.n)]
        imported = self.scheduler.add_request(reqs[0], reqs[1:], kv_import.num_tokens if kv_import else 0)
        try:
            if imported:
                self.runner.import_kv(reqs[0].block_ids, kv_import.num_tokens, kv_import.payload)
            if grammar is not None:
                self.structured.add(reqs, grammar)
            self.outputs.add_request(request_id, prompt if isinstance(prompt, str) else None, reqs, output_kind,
                                     arrival, imported)
        except BaseException:
            self._finish(reqs, RequestStatus.FINISHED_ABORTED)  # leave the engine as it was
            raise

    def export_kv(self, request_id: str) -> torch.Tensor:
        """The computed prompt KV of a finished `hold_kv` request, packed for transfer."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            raise KeyError(f"no held KV for request {request_id!r}")
        return self.runner.export_kv(req.block_ids, req.num_computed_tokens)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks of a held request (transfer confirmed or lease expired). False if unknown."""
        return self.scheduler.release_held(request_id)

    def holds_kv(self, request_id: str) -> bool:
        return request_id in self.scheduler.held

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks go back to the pool. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._finish(self.outputs.abort(rid), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.request_ids)

    def unfinished_request_ids(self) -> list[str]:
        return self.outputs.request_ids

    @property
    def num_waiting(self) -> int:
        """Sequences in the policy queue (safe to read from another thread)."""
        return len(self.scheduler.waiting)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, apply the sampled tokens, and report the requests that made progress.

        A request that breaks the step fails alone: it is aborted (its blocks go back to the pool), its
        error is in `failed` (request id -> message) until the next step, and the others go on.

        With `overlap_outputs` (on a GPU) a step's outputs (text, stop strings, `RequestOutput`s: a third of
        the host's work at batch 256 on an H200) are made while the device runs the next step, which reports
        them (one with nothing to schedule reports the last), so has_unfinished_requests() holds until they are
        out; a stop string found then ends its request and drops its token from the step in flight.

        With `async_scheduling` (one GPU; steps without drafts) a decode step goes further: the step after it
        is queued behind it on the device before the host waits for it (`_step_ahead`)."""
        self.failed = {}
        current, self._inflight = self._inflight, None
        if current is None:
            start = time.perf_counter()
            sched = self.scheduler.schedule()
            if not sched.requests:
                return self._take_pending()
            self.outputs.mark_scheduled(sched.admitted, time.monotonic())
            current = self._ahead.launch(sched) if self.async_scheduling else None
            if current is None:
                return self._step_in_turn(sched, start)
        return self._step_ahead(current)

    def _step_ahead(self, current: InFlight) -> list[RequestOutput]:
        """Collect `current`, a decode step queued on the device, having queued the next decode step of its
        requests behind it (input ids read there from `current`'s sampled ids: `workers/run_ahead.py`), so that
        the host applies `current` and makes its outputs while the device runs the next. The next `step()`
        collects that one (and queues the one after) unscheduled while nothing else waits: no request to admit,
        a free slot for each (penalties and bad words read the token in flight on the device, `min_tokens` counts
        it on the host). Under a grammar, whose mask needs that token on the host, the next step's forward pass
        is queued ahead and its sampling once `current` is applied, before its outputs are made. A request
        `current` ends (a stop token or string, an abort) computes one token more in the step queued behind,
        which is dropped, and gives back its blocks as if it had not been scheduled."""
        self._inflight = self._ahead.run_ahead(current)
        try:
            earlier = self._take_pending()  # outputs left by a step before (the device is busy meanwhile)
        except BaseException:
            self._inflight = None  # queued on tokens not applied: the requests are scheduled again from here
            raise
        try:
            run = IsolatedStep(current.sched, current.pending.result())
        except Exception:
            # the step ahead was queued on inputs it never had: drop it, and run this one again the usual way
            # (a request that breaks it fails alone)
            self._inflight = None
            run = execute_isolating(self.runner.execute, current.sched)
        # under a grammar the step queued ahead samples once these tokens are applied, its masks read from them
        deferred = self._inflight is not None and self._inflight.pending is None
        try:
            self._apply(run)
        except BaseException:
            if deferred:
                self._inflight = None  # scheduled again from here
            raise
        if deferred:
            self._inflight = self._ahead.sample(self._inflight)
        return earlier + self._take_pending()

    def _step_in_turn(self, sched: SchedulerOutput, start: float) -> list[RequestOutput]:
        """Run `sched` and wait for it; with `overlap_outputs`, the last step's outputs are made while the
        device runs it and this step's are left for the next. A decode-only step is timed from `start` (before
        it was scheduled) while drafts are being decided (`keep_odds`): what `StepCosts` fits."""
        costs = self.scheduler.step_costs
        decode_only = costs is not None and self.scheduler.speculates() and sched.decodes_only()
        earlier: list[RequestOutput] = [] if self.overlap_outputs else self._take_pending()
        made: list[list[RequestOutput]] = []
        errors: list[BaseException] = []

        def make_pending() -> None:  # once, while the device runs this step; errors wait for the step's end
            if made or errors:
                return
            try:
                made.append(self._take_pending())
            except Exception as e:
                errors.append(e)

        self.runner.before_sync = make_pending if self.overlap_outputs else None
        try:
            run = execute_isolating(self.runner.execute, sched)
        finally:
            self.runner.before_sync = None
            make_pending()
        if errors:
            raise errors[0]
        earlier += made[0] if made else []
        self._apply(run)
        outputs = earlier if self.overlap_outputs else earlier + self._take_pending()
        if decode_only:
            costs.observe(sched.total_num_tokens, time.perf_counter() - start)
        return outputs

    def _apply(self, run: IsolatedStep) -> None:
        """Fail the step's failed requests, apply the sampled tokens of the others (not of those finished
        since it was scheduled) and leave their outputs pending."""
        if run.failed:
            self._fail(run.failed)
        finished = {r for r in run.sched.requests if r.status.finished}  # failed, stopped or aborted meanwhile
        if finished:
            run = run.without(finished)
        self._computed_tokens += run.sched.total_num_tokens
        sampled = self.scheduler.update_from_output(run.sched, run.output.token_ids, run.output.accepted)
        logprobs = run.output.logprobs
        if self.structured.active:
            sampled, logprobs = self._advance_grammars(sampled, logprobs)
        self._pending = _PendingOutputs(sampled, logprobs, run.output.prompt_logprobs)

    def _take_pending(self) -> list[RequestOutput]:
        """Make the outputs of the step whose tokens were applied last (those of requests still tracked: an
        abort since forgets one), finish the requests a stop string ended, and forget finished requests'
        generators."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        sampled, logprobs = pending.sampled, pending.logprobs
        if not self.outputs.tracks_all(sampled):
            kept = [(r, lp) for r, lp in zip(sampled, logprobs) if self.outputs.tracks(r.request_id)]
            sampled, logprobs = [r for r, _ in kept], [lp for _, lp in kept]
        outputs, stopped = self.outputs.process(sampled, logprobs, time.monotonic(), pending.prompt_logprobs)
        self._finish(stopped, RequestStatus.FINISHED_STOPPED)
        self.runner.release([r.request_id for r in sampled if r.status.finished])
        return outputs

    def _advance_grammars(self, sampled: list[Request], logprobs: list) -> tuple[list[Request], list]:
        """Feed the new tokens to the requests' grammars: a grammar that has ended ends its request
        ("stop"); a token a grammar refuses fails its whole request. Returns the sequences that go on, with
        their logprobs."""
        ended, refused = self.structured.accept(sampled)
        self.scheduler.finish_requests(ended, RequestStatus.FINISHED_STOPPED)
        if not refused:
            return sampled, logprobs
        self._fail(refused)
        kept = [(r, lp) for r, lp in zip(sampled, logprobs) if (r.parent_id or r.request_id) not in self.failed]
        return [r for r, _ in kept], [lp for _, lp in kept]

    def _fail(self, failed: dict[Request, str]) -> None:
        """Abort each failed sequence's whole request (all `n` of its sequences) and record its error."""
        for req, message in failed.items():
            rid = req.parent_id or req.request_id
            if rid not in self.failed:
                self.failed[rid] = f"request {rid!r} failed in the engine and was aborted: {message}"
                self.abort_request(rid)
            self._finish([req], RequestStatus.FINISHED_ABORTED)  # no-op unless it was not tracked

    def _finish(self, requests: list[Request], status: RequestStatus) -> None:
        self.scheduler.finish_requests(requests, status)
        self.runner.release([r.request_id for r in requests])

    def get_stats(self) -> EngineStats:
        """The engine's counters now; `token_gaps` are those recorded since the previous call (each call takes
        them, so one reader, the engine loop, should call it once per step)."""
        s, kv = self.scheduler, self.kv_cache
        return EngineStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=s.num_preemptions,
            prompt_tokens=self.outputs.prompt_tokens,
            generation_tokens=self.outputs.generation_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            computed_tokens=self._computed_tokens,
            finished=dict(self.outputs.finished),
            num_kv_held=len(s.held),
            num_kv_import_fallbacks=s.num_import_fallbacks,
            num_pending_tokens=s.num_pending_tokens,
            token_gaps=self.outputs.take_token_gaps(),
            spec_num_drafts=s.num_drafts,
            spec_num_draft_tokens=s.num_draft_tokens,
            spec_num_accepted_tokens=s.num_accepted_tokens,
            spec_accepted_per_pos=tuple(s.accepted_per_pos),
        )
