"""Runs one scheduled step: flattens every request's new tokens into one unpadded batch, builds
positions, slot mapping and block tables (the step's `CommonAttentionMetadata`, from which the attention
backend builds its own metadata), runs the model, and samples for the requests that finished their chunk.

Device-agnostic: inputs are built on the host and reach the device in one copy (from a pinned buffer on
CUDA), and the sampled ids and logprobs come back in one copy. Decode-only steps replay CUDA graphs when
they are enabled (`enable_decode_graphs`)."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, CommonAttentionMetadata
from workers.cuda_graphs import Capture, DecodeGraphs, cuda_capture
from workers.models.llama import LlamaForCausalLM
from workers.penalties import bad_words_ban
from workers.prompt_logprobs import PromptLogprobsPlan, plan_prompt_logprobs
from workers.request import Request
from workers.sampler import SampleOutput, sample
from workers.scheduler import SchedulerOutput
from workers.step_isolation import RequestsFailed
from workers.structured_output import StructuredOutputManager


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
        self.num_heads, self.num_kv_heads = a.num_heads, a.num_kv_heads
        # One allocation for the whole cache; zeroed so that masked-out slots never hold NaN.
        self.kv_cache = torch.zeros(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype,
                                    device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(a.num_layers)]
        self.generators: dict[str, torch.Generator] = {}
        self.graphs: DecodeGraphs | None = None
        self._staging = torch.empty(0, dtype=torch.long)
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: Capture = cuda_capture) -> None:
        """Capture decode-only steps for a ladder of batch sizes up to `max_batch` (the attention backend
        must be graph-safe: Triton's is)."""
        from kernels.triton_attention import TritonAttentionMetadata

        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self._forward, TritonAttentionMetadata, max_batch, max_blocks, self.device, capture)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, self.attn, meta, logits_indices)

    def _to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """int64 host tensors on the device, in one copy (through a pinned staging buffer on CUDA)."""
        if self.device.type == "cpu":
            return parts
        total = sum(p.numel() for p in parts)
        if self._staging.numel() < total:
            self._staging = torch.empty(max(total, 2 * self._staging.numel()), dtype=torch.long,
                                        pin_memory=self.device.type == "cuda")
        flat = self._staging[:total]
        torch.cat(parts, out=flat)
        dev = flat.to(self.device, non_blocking=True)
        return list(dev.split([p.numel() for p in parts]))

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' seeded generators and grammar matchers."""
        for rid in request_ids:
            self.generators.pop(rid, None)
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
        bs = self.block_size
        reqs = out.requests
        starts = [r.num_computed_tokens for r in reqs]
        input_ids: list[int] = []
        for r, s, n in zip(reqs, starts, out.num_new_tokens):
            input_ids.extend(r.all_token_ids[s:s + n])
        query_lens = torch.tensor(out.num_new_tokens)
        start_t = torch.tensor(starts)
        context_lens = start_t + query_lens
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.long)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        positions = torch.arange(len(input_ids)) + torch.repeat_interleave(start_t - query_start_loc[:-1], query_lens)

        width = max(len(r.block_ids) for r in reqs)
        block_tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs])
        req_idx = torch.repeat_interleave(torch.arange(len(reqs)), query_lens)
        slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs

        samples = [i for i, (r, s, n) in enumerate(zip(reqs, starts, out.num_new_tokens)) if s + n == r.num_tokens]
        logits_indices = query_start_loc[1:][samples] - 1
        plan = plan_prompt_logprobs(reqs, starts, out.num_new_tokens, query_start_loc[:-1].tolist())

        common = CommonAttentionMetadata(query_lens, query_start_loc, context_lens, block_tables, slot_mapping, bs,
                                         self.num_heads, self.num_kv_heads)
        ids = torch.tensor(input_ids)
        targets = None
        if plan is None and self.graphs is not None and len(samples) == len(reqs) and self.graphs.supports(common):
            logits = self.graphs.run(ids, positions, common)
        else:
            parts = [ids, positions, logits_indices]
            if plan is not None:
                parts = [ids, positions, torch.cat([logits_indices, torch.tensor(plan.indices)]), torch.tensor(plan.targets)]
            ids, positions, logits_indices, *targets = self._to_device(parts)
            logits = self._forward(ids, positions, self.attn.build_metadata(common), logits_indices)
        if plan is None:
            return self._sample(logits, [reqs[i] for i in samples])
        return self._sample(logits[:len(samples)], [reqs[i] for i in samples], plan,
                            plan.pack(logits[len(samples):], targets[0]))

    def _sample(self, logits: torch.Tensor, sampled: list[Request], plan: PromptLogprobsPlan | None = None,
                extra: torch.Tensor | None = None) -> SampleOutput:
        """Sample one row per request. Raises `RequestsFailed` naming the requests whose own inputs (seeded
        generator, ban list) could not be built; if sampling fails, seeded generators are put back as they
        were, so a retry draws the same noise. Grammar-constrained rows sample from their allowed tokens."""
        allowed = self.structured.bitmask(sampled) if self.structured is not None else None
        gens: list[torch.Generator | None] = []
        bans: list[list[int] | None] = []
        failures: dict[str, str] = {}
        for r in sampled:
            try:
                gens.append(self._generator(r.request_id, r.seed))
                bans.append(_ban(r))
            except Exception as e:
                failures[r.request_id] = f"{type(e).__name__}: {e}"
        if failures:
            raise RequestsFailed(failures)
        states = [(g, g.get_state()) for g in gens if g is not None]
        histories = [(r.all_token_ids, r.num_prompt_tokens) for r in sampled]
        try:
            result = sample(logits, [r.sampling_params for r in sampled], gens, bans, histories, extra, allowed)
        except BaseException:
            for g, state in states:
                g.set_state(state)
            raise
        if plan is not None:
            result.prompt_logprobs = plan.unpack(result.extra)
        return result


def _ban(req: Request) -> list[int] | None:
    """Tokens the request may not pick now: those that would stop it before its `min_tokens` are out (EOS
    and the stop token ids), and the last tokens of bad words the output would complete."""
    p = req.sampling_params
    banned = []
    if req.num_output_tokens < p.min_tokens:
        banned = ([] if p.ignore_eos or req.eos_token_id is None else [req.eos_token_id]) + p.stop_token_ids
    if req.bad_words_token_ids:
        banned += bad_words_ban(req.output_token_ids, req.bad_words_token_ids)
    return banned or None
