"""Turning the step's logits into tokens, vectorised over the rows that sample.

Rows still short of `min_tokens` cannot pick the tokens that would stop them (EOS, stop token ids), nor
the last token of a bad word; rows under a grammar only take the tokens its bitmask allows; then logit
bias and penalties apply (`workers/penalties.py`), to greedy rows too. The logprobs reported are the
model's own, before all that. Greedy rows take the argmax. Random rows apply temperature, min_p, top-k
and top-p, then sample by the
exponential-race trick (argmax of p / q with q ~ Exp(1)), which lets seeded rows draw their noise from
their own generator while the rest share one draw."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.layer_ops import TorchLayerOps
from workers.penalties import History, adjust_logits, apply_min_p
from workers.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    # per row: (sampled token's logprob, its rank, top-k ids, top-k logprobs), or None if not requested
    logprobs: list[tuple[float, int, list[int], list[float]] | None]
    # request id -> its prompt log-probabilities computed this step (see `workers/prompt_logprobs.py`)
    prompt_logprobs: dict = field(default_factory=dict)
    extra: list[float] = field(default_factory=list)  # the `extra` tensor passed to `sample`, on the host


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); rows with k=-1/p=1 are untouched."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=x.device).expand_as(sorted_x)
    drop = ranks >= k[:, None]
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly before this token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    return x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))


def _mask_banned(logits: torch.Tensor, banned: list[list[int] | None]) -> torch.Tensor:
    """A copy of `logits` with each row's banned tokens at -inf (the same tensor if none are banned)."""
    rows = [i for i, b in enumerate(banned) if b]
    if not rows:
        return logits
    dev = logits.device
    row_idx = torch.tensor([i for i in rows for _ in banned[i]], device=dev)
    tok_idx = torch.tensor([t for i in rows for t in banned[i]], device=dev)
    return logits.index_put((row_idx, tok_idx), torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))


@dataclass(slots=True)
class RowBitmask:
    """The tokens some rows may take (a grammar's next tokens): `bits[i]` packs row `rows[i]`'s allowed
    tokens as xgrammar does, int32 words with bit j of word w standing for token 32 * w + j."""

    rows: torch.Tensor  # [k] int64, on the logits' device
    bits: torch.Tensor  # [k, ceil(vocab / 32)] int32, on the logits' device


def apply_token_bitmask(logits: torch.Tensor, allowed: RowBitmask) -> torch.Tensor:
    """A copy of `logits` with the tokens each listed row may not take at -inf; other rows are untouched.
    The listed rows are masked by xgrammar's kernel (C++ on the CPU, CUDA or Triton on a GPU)."""
    from xgrammar import apply_token_bitmask_inplace

    rows = logits[allowed.rows]
    apply_token_bitmask_inplace(rows, allowed.bits, vocab_size=logits.shape[-1])
    return logits.index_put((allowed.rows,), rows)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int] | None] | None = None, histories: list[History] | None = None,
           extra: torch.Tensor | None = None, allowed: RowBitmask | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] = TorchLayerOps.argmax) -> SampleOutput:
    """`logits`: [rows, vocab] in the model's dtype (argmax needs no upcast; filtering, sampling and
    logprobs run in float32 on the rows that need them); one `params`, optional generator, optional
    list of banned token ids and token history (needed by rows with penalties) per row. `extra`, a flat
    tensor on the device, comes back to the host in the same copy as the tokens (`SampleOutput.extra`);
    `allowed`: the tokens that grammar-constrained rows may take; `argmax`: each row's first maximum (the
    model's layer ops give a compiled one on the CPU)."""
    raw = logits
    logits = _mask_banned(logits, banned or [])
    if allowed is not None:
        logits = apply_token_bitmask(logits, allowed)
    logits = adjust_logits(logits, params, histories or [])
    greedy_tokens = argmax(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    tokens = greedy_tokens
    dev = logits.device
    if random_rows:
        idx = torch.tensor(random_rows, device=dev)
        sub = [params[i] for i in random_rows]
        x = logits[idx].float() / torch.tensor([p.temperature for p in sub], device=dev)[:, None]
        x = apply_min_p(x, [p.min_p for p in sub])
        top_k = [p.top_k for p in sub]
        top_p = [p.top_p for p in sub]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            x = _apply_top_k_top_p(x, torch.tensor(top_k, device=dev), torch.tensor(top_p, dtype=torch.float, device=dev))
        probs = x.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for row, i in enumerate(random_rows):
            if generators[i] is not None:
                noise[row].exponential_(generator=generators[i])
        tokens = greedy_tokens.clone()
        tokens[idx] = (probs / noise).argmax(dim=-1)

    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    tail = [] if extra is None else [extra.double()]
    if not want:
        if not tail:
            return SampleOutput(tokens.tolist(), [None] * len(params))  # the step's one device-to-host copy
        host = torch.cat([tokens.double(), *tail]).tolist()
        return SampleOutput([int(t) for t in host[:len(params)]], [None] * len(params), extra=host[len(params):])
    idx = torch.tensor(want, device=dev)
    lp = raw[idx].float().log_softmax(-1)
    chosen = tokens[idx]
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
    ranks = (lp > chosen_lp[:, None]).sum(-1) + 1
    k = max(params[i].logprobs for i in want)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
    # One copy back for everything: float64 holds token ids and ranks exactly, and float32 logprobs too.
    packed = torch.cat([chosen_lp[:, None].double(), ranks[:, None].double(), top_ids.double(), top_lp.double()], 1)
    host = torch.cat([tokens.double(), packed.flatten(), *tail]).tolist()
    token_list = [int(t) for t in host[:len(params)]]
    rows = host[len(params):len(params) + packed.numel()]
    width = 2 + 2 * k
    logprobs: list = [None] * len(params)
    for row, i in enumerate(want):
        n, r = params[i].logprobs, rows[row * width:(row + 1) * width]
        logprobs[i] = (r[0], int(r[1]), [int(t) for t in r[2:2 + n]], r[2 + k:2 + k + n])
    return SampleOutput(token_list, logprobs, extra=host[len(params) + packed.numel():])
