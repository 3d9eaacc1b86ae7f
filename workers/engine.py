"""The engine: owns the scheduler, the KV cache and the model runner, and turns one `step()` into
per-request outputs. Requests with `n > 1` become sibling sequences that share the prompt's blocks."""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kernels.attention import get_attention_backend
from kernels.layer_ops import get_layer_ops
from workers.config import EngineConfig, parse_memory
from workers.detokenizer import IncrementalDetokenizer
from workers.kv_cache_manager import KVCacheManager
from workers.model_loader import (load_hf_config, load_model, load_tokenizer, resolve_dtype, resolve_model_path,
                                  weight_files)
from workers.model_runner import ModelRunner
from workers.outputs import CompletionOutput, Logprob, RequestOutput
from workers.request import Request, RequestStatus
from workers.request_queue import make_request_queue
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig

_MAX_DEFAULT_LEN = 8192


@dataclass(slots=True)
class KVImport:
    """KV of the first `num_tokens` prompt tokens computed elsewhere (a prefill replica), in the
    `workers.kv_transfer` payload layout."""

    num_tokens: int
    payload: torch.Tensor


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every step: everything so far
    DELTA = "delta"  # every step: only what is new
    FINAL_ONLY = "final"  # once, when the request finishes


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


@dataclass(slots=True, eq=False)
class _Sequence:
    """Engine-side state of one completion: its scheduler request plus text and logprobs."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


@dataclass(slots=True, eq=False)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    output_kind: OutputKind
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    counted_prompt: bool = False
    kv_imported: bool = False
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def _load_predictor(path: str | None):
    """The trained length predictor at `path` (for the `predicted` policy), or None for its default."""
    if path is None:
        return None
    from workers.length_predictor import LinearLengthPredictor

    return LinearLengthPredictor.load(path)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model)
        hf_config = load_hf_config(path)
        files = weight_files(path)
        self.model_path = path
        self.tokenizer = load_tokenizer(path)
        self.dtype = resolve_dtype(config.dtype)
        model_max = getattr(hf_config, "max_position_embeddings", _MAX_DEFAULT_LEN)
        self.max_model_len = config.max_model_len or min(model_max, _MAX_DEFAULT_LEN)
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {model_max}")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"with chunked prefill off, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len}); lower max_model_len or raise the budget")
        self.model = load_model(files, hf_config, self.dtype, self.max_model_len)
        block_bytes = ModelRunner.kv_bytes_per_block(self.model.args, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or parse_memory(config.kv_cache_memory) // block_bytes
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {num_blocks * config.block_size} tokens ({num_blocks} blocks of "
                             f"{config.block_size}), fewer than max_model_len {self.max_model_len}; "
                             "enlarge the cache or lower max_model_len")
        self.num_kv_blocks = num_blocks
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill),
            self.kv_cache, make_request_queue(config.scheduling_policy, _load_predictor(config.length_predictor)))
        attn = get_attention_backend(config.attention_backend)
        # The compiled layer ops come from the same build as the compiled attention: both or neither.
        self.model.ops = get_layer_ops("cpp" if attn.name == "cpp" else "torch")
        self.runner = ModelRunner(self.model, attn, num_blocks, config.block_size, self.dtype, config.seed)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else getattr(hf_config, "eos_token_id", None)
        self.vocab_size = self.model.args.vocab_size
        self._groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._computed_tokens = 0
        self._finished: Counter[str] = Counter()
        self._hold_kv: set[str] = set()
        self._held: dict[str, Request] = {}
        self._kv_import_fallbacks = 0

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
        """Queue a request. Raises ValueError, leaving the engine untouched, if the request is invalid.

        `hold_kv`: keep the prompt's blocks when the request finishes, for `export_kv` / `release_kv`
        (a prefill replica). `kv_import`: start from KV computed elsewhere for the first
        `kv_import.num_tokens` prompt tokens (a decode replica); if the pool has no room for it now, the
        prompt is recomputed instead."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate_prompt(prompt, prompt_token_ids)
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt has {len(ids):,} tokens and max_tokens is {max_tokens:,}, together more than "
                             f"max_model_len {self.max_model_len:,}")
        if (hold_kv or kv_import is not None) and params.n != 1:
            raise ValueError("KV hand-off (hold_kv / kv_import) supports n=1 only")
        if kv_import is not None and not 0 < kv_import.num_tokens < len(ids):
            raise ValueError(f"imported KV covers {kv_import.num_tokens} tokens; the prompt has {len(ids)} "
                             "(at least the last prompt token must be computed here)")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, prompt if isinstance(prompt, str) else None, ids, [], output_kind, arrival)
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, max_tokens, arrival,
                          priority, self.eos_token_id, parent_id=request_id, index=i, seed=seed)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop_strings)
            want_lp = params.logprobs is not None
            seq = _Sequence(req, detok, [] if want_lp else None, 0.0 if want_lp else None)
            group.seqs.append(seq)
            self._seq_of[req.request_id] = (group, seq)
        self._groups[request_id] = group
        reqs = [s.request for s in group.seqs]
        if hold_kv:
            self._hold_kv.add(reqs[0].request_id)
        if kv_import is not None:
            group.kv_imported = self._import_kv(reqs[0], kv_import)
        self.scheduler.add_request(reqs[0], reqs[1:])

    def _import_kv(self, req: Request, kv: KVImport) -> bool:
        from workers.kv_transfer import unpack_kv

        if not self.kv_cache.allocate_slots(req, kv.num_tokens):
            self._kv_import_fallbacks += 1
            return False
        unpack_kv(self.runner.kv_cache, req.block_ids, kv.num_tokens, kv.payload)
        req.num_computed_tokens = kv.num_tokens
        self.kv_cache.cache_computed_blocks(req)
        return True

    def export_kv(self, request_id: str) -> torch.Tensor:
        """The computed prompt KV of a finished `hold_kv` request, packed for transfer."""
        from workers.kv_transfer import pack_kv

        req = self._held.get(request_id)
        if req is None:
            raise KeyError(f"no held KV for request {request_id!r}")
        return pack_kv(self.runner.kv_cache, req.block_ids, req.num_computed_tokens)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks of a held request (transfer confirmed or lease expired). False if unknown."""
        req = self._held.pop(request_id, None)
        if req is None:
            return False
        self.kv_cache.free(req)
        return True

    def holds_kv(self, request_id: str) -> bool:
        return request_id in self._held

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks go back to the pool. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            live = [s for s in group.seqs if s.finish_reason is None]
            for s in live:
                s.finish_reason = "abort"
            self._end([s.request for s in live], RequestStatus.FINISHED_ABORTED)
            self._groups.pop(rid, None)
            self._finished["abort"] += len(live)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report the requests that made progress."""
        sched = self.scheduler.schedule()
        if not sched.requests:
            return []
        started = time.monotonic()
        for req in sched.requests:
            group = self._seq_of[req.request_id][0]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = started
        result = self.runner.execute(sched)
        self._computed_tokens += sched.total_num_tokens
        sampled = self.scheduler.update_from_output(sched, result.token_ids)
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        stopped: list[Request] = []
        length: list[Request] = []
        for req, lp in zip(sampled, result.logprobs):
            group, seq = self._seq_of[req.request_id]
            touched[group.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
            if not group.counted_prompt:
                group.counted_prompt = True
                self._prompt_tokens += len(group.prompt_token_ids)
            self._generation_tokens += 1
            token = req.all_token_ids[-1]
            if lp is not None:
                self._record_logprobs(seq, token, lp)
            reason = self._check_stop(req, seq, token)
            if reason == "stop":
                stopped.append(req)
            elif reason == "length":
                length.append(req)
        self._end(stopped, RequestStatus.FINISHED_STOPPED)
        self._end(length, RequestStatus.FINISHED_LENGTH)
        outputs = []
        for group in touched.values():
            if group.finished:
                group.metrics = {"arrival_time": group.arrival_time, "first_scheduled_time": group.first_scheduled_time,
                                 "first_token_time": group.first_token_time, "finished_time": now,
                                 "kv_imported": group.kv_imported, "kv_handoff": group.request_id in self._held}
                self._groups.pop(group.request_id, None)
            if group.finished or group.output_kind is not OutputKind.FINAL_ONLY:
                outputs.append(self._make_output(group))
        return outputs

    def _check_stop(self, req: Request, seq: _Sequence, token: int) -> str | None:
        p = req.sampling_params
        n_out = req.num_output_tokens
        hit = seq.detokenizer.update([token])
        if n_out > p.min_tokens or n_out == req.max_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif token in p.stop_token_ids:
                seq.finish_reason, req.stop_reason = "stop", token
            elif hit is not None:
                seq.finish_reason, req.stop_reason = "stop", hit
        if seq.finish_reason is None and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            handoff = seq.finish_reason == "length" and req.request_id in self._hold_kv
            self._finished["handoff" if handoff else seq.finish_reason] += 1  # handoff: the decode pool goes on
        return seq.finish_reason

    def _record_logprobs(self, seq: _Sequence, token: int, lp: tuple) -> None:
        chosen_lp, rank, top_ids, top_lps = lp
        entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(zip(top_ids, top_lps))}
        entry[token] = Logprob(chosen_lp, rank)
        for tid, item in entry.items():
            item.decoded_token = self.tokenizer.decode([tid])
        seq.logprobs.append(entry)
        seq.cumulative_logprob += chosen_lp

    def _end(self, requests: list[Request], status: RequestStatus) -> None:
        held = [r for r in requests if r.request_id in self._hold_kv]
        if held:
            self._hold_kv.difference_update(r.request_id for r in held)
            keep = status is not RequestStatus.FINISHED_ABORTED
            self.scheduler.finish_requests(held, status, free_blocks=not keep)
            if keep:
                self._held.update((r.request_id, r) for r in held)
        self.scheduler.finish_requests([r for r in requests if r not in held] if held else requests, status)
        predictor = getattr(self.scheduler.waiting, "predictor", None)
        for req in requests:
            self.runner.release(req.request_id)
            self._seq_of.pop(req.request_id, None)
            if predictor is not None and status is not RequestStatus.FINISHED_ABORTED:
                predictor.observe(req)

    def _make_output(self, group: _Group) -> RequestOutput:
        delta = group.output_kind is OutputKind.DELTA
        outs = []
        for seq in group.seqs:
            req = seq.request
            tokens = req.output_token_ids
            text = seq.detokenizer.output_text
            lps = seq.logprobs
            if delta:
                tokens, text = tokens[seq.sent_tokens:], text[seq.sent_text:]
                lps = None if lps is None else lps[seq.sent_tokens:]
                seq.sent_tokens += len(tokens)
                seq.sent_text += len(text)
            outs.append(CompletionOutput(req.index, text, list(tokens), seq.cumulative_logprob,
                                         None if lps is None else list(lps), seq.finish_reason, req.stop_reason))
        first = group.seqs[0].request
        cached = max(first.num_cached_tokens, 0)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, group.finished, cached,
                             group.metrics)

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            computed_tokens=self._computed_tokens,
            finished=dict(self._finished),
            num_kv_held=len(self._held),
            num_kv_import_fallbacks=self._kv_import_fallbacks,
            num_pending_tokens=sum(s.request.num_tokens - s.request.num_computed_tokens for _, s in self._seq_of.values()),
        )
