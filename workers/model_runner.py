"""Runs one scheduled step: its `StepInputs` (`workers/step_inputs.py`: one unpadded batch with positions,
slot mapping and block tables, the `CommonAttentionMetadata` from which the attention backend builds its
own metadata) go through the model, and the requests that finished their chunk sample. Under tensor
parallelism every rank runs one of these over its shard of the model and of the KV cache.

Device-agnostic: inputs are built on the host and reach the device in one copy (from a pinned buffer on
CUDA), except a decode step queued ahead over the graph step before's rows, advanced on the device
(`DecodeGraphs.advance`), and the sampled ids and logprobs come back in one copy. Decode-only steps replay CUDA graphs when
they are enabled (`enable_decode_graphs`)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, CommonAttentionMetadata
from workers.cuda_graphs import Capture, DecodeGraphs, cuda_capture
from workers.huge_pages import zeros_on_huge_pages
from workers.models.llama import LlamaForCausalLM
from workers.ngram import accept_drafts
from workers.penalties import TokenCounts, device_tensor
from workers.prompt_logprobs import PromptLogprobsPlan
from workers.request import Request
from workers.sampler import PendingSample, RowBitmask, SampleOutput, launch_greedy, launch_sample
from workers.scheduler import SchedulerOutput
from workers.step_inputs import (SampleSpec, StepInputs, ahead_specs, build_ahead_inputs, build_step_inputs,
                                 sampled_requests)
from workers.step_isolation import RequestsFailed
from workers.structured_output import StructuredOutputManager


# a request's kept spec: where every request of a step has one, the step sampled with them
_SAMPLE_SPEC = operator.attrgetter("sample_spec")


@dataclass(slots=True)
class _GraphStep:
    """A decode step queued from a CUDA graph without waiting: its sampling, and each row's count of block ids
    in the graph's buffers."""

    pending: PendingSample
    blocks: list[int]
    specs: list[SampleSpec]
    plain: bool  # every spec plain greedy (`SampleSpec.plain`)
    kept: bool  # every spec its request's for good (`Request.sample_spec`); else one changes (`min_tokens`)


@dataclass(slots=True)
class AheadForward:
    """A decode step queued ahead whose forward pass is on the device and whose sampling is not queued yet
    (`ModelRunner.launch_ahead(defer_sample=True)`): a grammar's mask needs the token in flight on the host,
    so the rows sample once the step in front has been applied (`ModelRunner.sample_ahead`)."""

    reqs: list[Request]
    logits: torch.Tensor
    specs: list[SampleSpec]
    plain: bool
    inflight: torch.Tensor  # each row's token from the step in front (its input id), on the device
    blocks: list[int] | None  # a graph step's rows' block counts in the graph's buffers (None: not a graph's)
    kept: bool


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu",
                 structured: StructuredOutputManager | None = None) -> None:
        a = model.args
        self.structured = structured
        self.model = model
        self.attn = attn
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_heads, self.num_kv_heads = model.part.num_heads, model.part.num_kv_heads  # this rank's heads
        # One allocation for the whole cache, on huge pages on the CPU (`workers/huge_pages.py`); zeroed so
        # that masked-out slots never hold NaN.
        self.kv_cache = zeros_on_huge_pages(a.num_layers, 2, num_blocks, block_size, self.num_kv_heads, a.head_dim,
                                            dtype=dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(a.num_layers)]
        self.generators: dict[str, torch.Generator] = {}
        self.token_counts = TokenCounts()  # penalized requests' token counts, kept on the device
        self.graphs: DecodeGraphs | None = None
        self._graph_step: _GraphStep | None = None  # the last step queued from a graph (`launch_ahead`)
        self._replayed = False  # whether the last forward pass replayed a graph
        # Two pinned staging buffers taken in turn: a step's inputs are written into one while the copy
        # from the other may still be queued behind the step in flight (`Engine.async_scheduling`).
        self._staging = [torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)]
        self._turn = 0
        # called once a step's kernels are queued, before the step waits for them (see `Engine.step`)
        self.before_sync: Callable[[], None] | None = None
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: Capture = cuda_capture) -> None:
        """Capture decode-only steps for a ladder of batch sizes up to `max_batch` (the attention backend
        must be graph-safe: Triton's is, and those built on it)."""
        max_blocks = -(-max_model_len // self.block_size)
        prepare = None  # a backend without host work per graph step is not called (two views a step saved)
        if type(self.attn).prepare_graph_step is not AttentionBackend.prepare_graph_step:
            prepare = functools.partial(self.attn.prepare_graph_step, block_size=self.block_size)
        self._graph_step = None
        self.graphs = DecodeGraphs(self._forward, self.attn.graph_metadata, max_batch, max_blocks, self.device,
                                   capture, prepare)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, self.attn, meta, logits_indices)

    def _to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """int64 host tensors on the device, in one copy (through a pinned staging buffer on CUDA)."""
        if self.device.type == "cpu":
            return parts
        total = sum(p.numel() for p in parts)
        self._turn ^= 1
        staging = self._staging[self._turn]
        if staging.numel() < total:
            staging = self._staging[self._turn] = torch.empty(max(total, 2 * staging.numel()), dtype=torch.long,
                                                               pin_memory=self.device.type == "cuda")
        flat = staging[:total]
        torch.cat(parts, out=flat)
        dev = flat.to(self.device, non_blocking=True)
        return list(dev.split([p.numel() for p in parts]))

    @property
    def unavailable(self) -> str | None:
        """Why no step can run any more (see `TPModelRunner`); a model in this process always can."""
        return None

    async def check_alive(self, timeout_s: float = 10.0) -> None:
        """A model in this process is alive while the process is (see `TPModelRunner.check_alive`)."""

    def close(self) -> None:
        """Nothing to stop (see `TPModelRunner.close`)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' seeded generators, token counts and grammar matchers."""
        for rid in request_ids:
            self.generators.pop(rid, None)
        self.token_counts.release(request_ids)
        if self.structured is not None:
            self.structured.release(request_ids)

    def check_kv_payload(self, num_tokens: int, payload: torch.Tensor) -> None:
        """Raise ValueError unless `payload` is `num_tokens` tokens of KV in this cache's layout."""
        num_layers, _, _, _, num_kv_heads, head_dim = self.kv_cache.shape
        expected = (num_layers, 2, num_tokens, num_kv_heads, head_dim)
        if tuple(payload.shape) != expected or payload.dtype != self.kv_cache.dtype:
            raise ValueError(f"KV payload {tuple(payload.shape)} {payload.dtype} does not fit this cache: "
                             f"expected {expected} {self.kv_cache.dtype}")

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: torch.Tensor) -> None:
        """Write KV computed elsewhere into the blocks the scheduler allocated for it."""
        from workers.kv_transfer import unpack_kv

        unpack_kv(self.kv_cache, block_ids, num_tokens, payload)

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` tokens' KV from `block_ids`, packed for transfer."""
        from workers.kv_transfer import pack_kv

        return pack_kv(self.kv_cache, block_ids, num_tokens)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(self.device).manual_seed(seed)
        return gen

    def profile(self, num_tokens: int, num_logits: int) -> None:
        """One forward pass as large as a step gets (a `num_tokens` prompt chunk over blocks 0.., logits for
        its last `num_logits` tokens), to measure peak memory. Needs a cache of `num_tokens` slots."""
        q = torch.tensor([num_tokens])
        positions = torch.arange(num_tokens)
        common = CommonAttentionMetadata(q, torch.tensor([0, num_tokens]), q.clone(),
                                         torch.arange(-(-num_tokens // self.block_size))[None], positions.clone(),
                                         self.block_size, self.num_heads, self.num_kv_heads)
        parts = [torch.zeros(num_tokens, dtype=torch.long), positions, torch.arange(num_tokens - num_logits, num_tokens)]
        ids, positions, logits_indices = self._to_device(parts)
        self._forward(ids, positions, self.attn.build_metadata(common), logits_indices)

    def execute(self, out: SchedulerOutput) -> SampleOutput:
        step = build_step_inputs(out, self.block_size, self.num_heads, self.num_kv_heads)
        logits, targets = self._forward_step(step)
        if self.structured is not None and self.structured.active:
            # filled on the host while the device runs the forward pass
            step.allowed = self.structured.bitmask(sampled_requests(out))
        return self._sample(logits, step.samples, step.prompt_logprobs, step.allowed, step.drafts, targets)

    def launch(self, out: SchedulerOutput) -> PendingSample:
        """A decode-only step without drafts, queued on the device and not waited for (see
        `Engine.async_scheduling`); grammar-constrained rows take their masks now (every token is applied)."""
        step = build_step_inputs(out, self.block_size, self.num_heads, self.num_kv_heads)
        logits, _ = self._forward_step(step)
        allowed = self._allowed(out.requests)
        return self._launched(out.requests, step.samples,
                              self._sample(logits, step.samples, allowed=allowed, defer=True))

    def _allowed(self, reqs: list[Request]) -> RowBitmask | None:
        """The grammar masks of `reqs`' rows (one row each), on the device; None without a grammar."""
        if self.structured is None or not self.structured.active:
            return None
        return self.structured.bitmask(reqs)

    def launch_ahead(self, reqs: list[Request], after: PendingSample, rows: list[int] | None,
                     defer_sample: bool = False) -> PendingSample | AheadForward:
        """The decode step of `reqs` after the step `after` (still on the device), queued behind it: each
        request's input is its token from `after` (row `rows[i]` of its sampled ids; all rows in order when
        `rows` is None), read on the device (`build_ahead_inputs`). When `after` was the last graph replayed
        and every one of its rows goes on, its graph's buffers are advanced on the device instead
        (`DecodeGraphs.advance`). `defer_sample`: queue the forward pass only, and return it for
        `sample_ahead` once `after`'s tokens are applied (a grammar's mask reads them on the host)."""
        last, self._graph_step = self._graph_step, None
        ahead = None
        if rows is None and last is not None and last.pending is after:
            logits = self._advance(reqs, after, last.blocks)
            if logits is not None:  # the same requests, with the same specs unless one's bans change
                specs, plain, kept = last.specs, last.plain, last.kept
                if not kept:
                    specs = ahead_specs(reqs)
                    plain, kept = all(s.plain for s in specs), all(map(_SAMPLE_SPEC, reqs))
                ahead = AheadForward(reqs, logits, specs, plain, after.tokens, last.blocks, kept)
        if ahead is None:
            step = build_ahead_inputs(reqs, self.block_size, self.num_heads, self.num_kv_heads)
            ids = after.tokens if rows is None else after.tokens[device_tensor(rows, self.device)]
            logits, _ = self._forward_step(step, ids)
            specs = step.samples
            ahead = AheadForward(reqs, logits, specs, all(s.plain for s in specs), ids,
                                 [len(r.block_ids) for r in reqs] if self._replayed else None,
                                 all(map(_SAMPLE_SPEC, reqs)))
        return ahead if defer_sample else self.sample_ahead(ahead)

    def sample_ahead(self, ahead: AheadForward) -> PendingSample:
        """Queue the sampling of a step queued ahead (`launch_ahead`), grammar-constrained rows under their
        masks as their requests stand now (a request finished since samples unconstrained: its row is
        dropped); a graph's step is remembered for the step after to advance."""
        allowed = self._allowed(ahead.reqs)
        pending = self._sample(ahead.logits, ahead.specs, allowed=allowed, defer=True, plain=ahead.plain,
                               inflight=ahead.inflight)
        if ahead.blocks is not None:
            self._graph_step = _GraphStep(pending, ahead.blocks, ahead.specs, ahead.plain, ahead.kept)
        return pending

    def _launched(self, reqs: list[Request], specs: list[SampleSpec], pending: PendingSample) -> PendingSample:
        """Remember a step queued from a graph (`launch_ahead` may advance it), with each row's block ids in
        the graph's buffers and its sampling specs."""
        if self._replayed:
            self._graph_step = _GraphStep(pending, [len(r.block_ids) for r in reqs], specs,
                                          all(s.plain for s in specs), all(map(_SAMPLE_SPEC, reqs)))
        return pending

    def _advance(self, reqs: list[Request], after: PendingSample, blocks: list[int]) -> torch.Tensor | None:
        """The logits of the step after `after` over the same rows, by `DecodeGraphs.advance`, with the block
        ids the rows took since (`blocks`, each row's count in the buffers, is brought up to date); None when
        it cannot (a backend that plans on the host, a row over the buffers' width or with blocks fewer, more
        new blocks than the staging holds)."""
        graphs = self.graphs
        if not graphs.advances:
            return None
        width = graphs.max_blocks
        new: list[int] = []
        for i, r in enumerate(reqs):  # every step at batch 256: a length compared, most rows
            ids = r.block_ids
            have = blocks[i]
            if len(ids) != have:
                if not have < len(ids) <= width:
                    return None
                for c in range(have, len(ids)):
                    new += (i * width + c, ids[c])
                blocks[i] = len(ids)
        if len(new) > 2 * graphs.max_new_blocks:
            return None
        return graphs.advance(len(reqs), new, after.tokens, self.block_size)

    def run(self, step: StepInputs) -> SampleOutput:
        """Forward the step's batch and sample its `samples` rows (after forgetting `step.released`); a
        grammar bitmask that came with the step (on the host) moves to this runner's device."""
        self.release(step.released)
        logits, targets = self._forward_step(step)
        if step.allowed is not None and step.allowed.rows.device != self.device:
            step.allowed = RowBitmask(step.allowed.rows.to(self.device), step.allowed.bits.to(self.device))
        return self._sample(logits, step.samples, step.prompt_logprobs, step.allowed, step.drafts, targets)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """The logits of the step's `logits_indices` rows, then of its prompt-logprobs rows if any (a
        decode-only step replays a CUDA graph when one is captured for its size)."""
        return self._forward_step(step)[0]

    def _forward_step(self, step: StepInputs, input_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits and, with a prompt-logprobs plan, the prompt tokens its extra rows score (on
        the device, in the same copy as the inputs). `input_ids`, on the device, replace the step's own."""
        common, plan = step.common, step.prompt_logprobs
        self._graph_step = None  # the graphs' buffers are rewritten, or the step is not one `launch_ahead` advances
        self._replayed = (plan is None and self.graphs is not None and len(step.samples) == common.query_lens.shape[0]
                          and self.graphs.supports(common))
        if self._replayed:
            return self.graphs.run(step.input_ids, step.positions, common, input_ids), None
        parts = [step.input_ids, step.positions, step.logits_indices]
        if plan is not None:
            parts = [step.input_ids, step.positions, torch.cat([step.logits_indices, torch.tensor(plan.indices)]),
                     torch.tensor(plan.targets)]
        ids, positions, logits_indices, *targets = self._to_device(parts)
        if input_ids is not None:
            ids = input_ids
        logits = self._forward(ids, positions, self.attn.build_metadata(common), logits_indices)
        return logits, targets[0] if targets else None

    def _sample(self, logits: torch.Tensor, specs: list[SampleSpec], plan: PromptLogprobsPlan | None = None,
                allowed: RowBitmask | None = None, drafts: list[list[int]] | None = None,
                targets: torch.Tensor | None = None, defer: bool = False, plain: bool | None = None,
                inflight: torch.Tensor | None = None):
        """Sample one row per `specs` (the first rows of `logits`; the rest, with `targets`, are the
        prompt-logprobs `plan`'s; `drafts`, a step's per sampling request, if any). Raises `RequestsFailed`
        naming the requests whose seeded generator could not be built; if sampling fails, seeded generators are
        put back as they were, so a retry draws the same noise. Grammar-constrained rows sample from their
        allowed tokens. `defer`: return the `PendingSample` without waiting for it (a step without drafts or
        prompt logprobs). `plain`: whether every spec is plain greedy, if known. `inflight`: each row's token from
        the step in flight, which its history (for penalties) does not hold yet (a step queued ahead)."""
        extra = None
        if plan is not None:
            extra = plan.pack(logits[len(specs):], targets)
            logits = logits[:len(specs)]
        # a batch of plain greedy rows (`LLM.generate`'s default, the GPU check's batch) skips the passes over
        # each row's params and generator: host time every step, which at batch 256 sets a GPU's step
        if plain is None:
            plain = all(s.plain for s in specs)
        plain = plain and extra is None and allowed is None
        gens: list[torch.Generator | None] = []
        failures: dict[str, str] = {}
        for spec in () if plain else specs:
            try:
                gens.append(self._generator(spec.request_id, spec.seed))
            except Exception as e:
                failures[spec.request_id] = f"{type(e).__name__}: {e}"
        if failures:
            raise RequestsFailed(failures)
        states = [(g, g.get_state()) for g in gens if g is not None]
        try:
            if plain:
                pending = launch_greedy(logits, self.model.ops.argmax)
            else:
                histories = [s.history for s in specs]
                ids = [s.request_id for s in specs] if any(h is not None for h in histories) else None
                after = [s.ban_after for s in specs] if inflight is not None else None
                pending = launch_sample(logits, [s.params for s in specs], gens, [s.ban for s in specs], histories,
                                        extra, allowed, self.model.ops.argmax, self.token_counts, ids, inflight,
                                        after if after and any(after) else None)
            if defer:
                assert plan is None and not drafts, "only a step without drafts or prompt logprobs is deferred"
                return pending
            if self.before_sync is not None:
                self.before_sync()
            result = pending.result()
        except BaseException:
            for g, state in states:
                g.set_state(state)
            raise
        if plan is not None:
            result.prompt_logprobs = plan.unpack(result.extra)
        if drafts:
            result = accept_drafts(result, [s.request_id for s in specs], drafts)
        return result
