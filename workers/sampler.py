"""Turning the step's logits into tokens, vectorised over the rows that sample.

Rows still short of `min_tokens` cannot pick the tokens that would stop them (EOS, stop token ids), nor
the last token of a bad word; rows under a grammar only take the tokens its bitmask allows; then logit
bias and penalties apply (`workers/penalties.py`), to greedy rows too. The logprobs reported are the
model's own, before all that. Greedy rows take the argmax. Random rows apply temperature, min_p, top-k
and top-p, then draw one uniform number each (a seeded row from its own generator, the rest in one draw)
and take the token where it falls in the cumulative distribution. Top-k and top-p look at a row's largest
logits only (`topk`), not at a sort of the whole vocabulary, unless the nucleus reaches past them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.layer_ops import TorchLayerOps
from workers.penalties import History, TokenCounts, adjust_logits, apply_min_p, device_tensor
from workers.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    # per row: (sampled token's logprob, its rank, top-k ids, top-k logprobs), or None if not requested
    logprobs: list[tuple[float, int, list[int], list[float]] | None]
    # request id -> its prompt log-probabilities computed this step (see `workers/prompt_logprobs.py`)
    prompt_logprobs: dict = field(default_factory=dict)
    extra: list[float] = field(default_factory=list)  # the `extra` tensor passed to `sample`, on the host
    # speculation: request id -> how many of its drafts the model agreed with (they come before its token)
    accepted: dict[str, int] = field(default_factory=dict)


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


TOP_P_CANDIDATES = 1024  # a top-p row's nucleus is looked for among its largest logits first
_CDF_BLOCK = 256  # `_inverse_cdf` sums probabilities in blocks of this many tokens


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` ([n, width], non-negative, not necessarily normalised) the first index whose
    cumulative probability exceeds `u` (float64, [n], in [0, 1)) times the row's total: a draw from the
    row's distribution. The blocks of `_CDF_BLOCK` tokens are summed and their running sums (in float64)
    searched first, then the one block the draw falls in, so no float32 sum runs over the whole vocabulary;
    a token of probability 0 is never drawn."""
    n, width = probs.shape
    pad = -width % _CDF_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(n, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(-1).to(torch.float64).cumsum(-1)
    zero = torch.zeros_like(u)
    # each bound below is kept under the sum it searches, so that the first cumulative sum past it exists
    # and steps up there: the token drawn has mass, without a check that would wait for the device
    target = torch.minimum(u * block_cdf[:, -1], torch.nextafter(block_cdf[:, -1], zero))
    j = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(1)
    rows = torch.arange(n, device=probs.device)
    start = torch.where(j > 0, block_cdf[rows, (j - 1).clamp(min=0)], zero)
    inner = blocks[rows, j].to(torch.float64).cumsum(-1)
    rest = torch.minimum(target - start, torch.nextafter(inner[:, -1], zero))
    k = torch.searchsorted(inner, rest[:, None], right=True).squeeze(1)
    return j * _CDF_BLOCK + k


def _sample_filtered(x: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor) -> torch.Tensor:
    """Draw from rows of `x` (float32 logits, [n, vocab]) under each row's top-k and top-p, as
    `_apply_top_k_top_p` masks them, looking only at the row's `width` largest logits: every k, and
    `TOP_P_CANDIDATES` for nucleus rows. A row without top-k whose candidates hold less than its top-p of
    the probability goes through the full sort instead."""
    n, vocab = x.shape
    dev = x.device
    k = device_tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], dev)
    p = device_tensor(top_p, dev, torch.float)
    if dev.type != "cpu":  # a device sorts fast, and this way no step waits for it
        return _inverse_cdf(_apply_top_k_top_p(x, k, p).softmax(-1), u)
    nucleus = TOP_P_CANDIDATES if any(pp < 1 for pp in top_p) else 1
    width = min(vocab, max([min(kk, vocab) for kk in top_k if kk > 0] + [nucleus]))
    vals, ids = x.topk(width, dim=-1)  # largest first
    drop = torch.arange(width, device=dev)[None, :] >= k[:, None]
    masked = vals.masked_fill(drop, float("-inf"))
    with_k = device_tensor([kk > 0 for kk in top_k], dev)
    # the probabilities top-p reads: over the top-k tokens where a row has top-k, else over the vocabulary
    norm = masked.logsumexp(-1)
    no_k = [row for row, kk in enumerate(top_k) if kk <= 0]
    if len(no_k) == n:
        norm = x.logsumexp(-1)
    elif no_k:
        rows = device_tensor(no_k, dev)
        norm[rows] = x[rows].logsumexp(-1)
    probs = (masked - norm[:, None]).exp()
    drop |= (probs.cumsum(-1) - probs) >= p[:, None]
    drop[:, 0] = False
    covered = with_k | (probs.sum(-1) >= p)
    tokens = torch.empty(n, dtype=torch.long, device=dev)
    cov = covered.nonzero().squeeze(1)
    if cov.numel():
        kept = probs[cov].masked_fill(drop[cov], 0.0)
        tokens[cov] = ids[cov].gather(1, _inverse_cdf(kept, u[cov])[:, None]).squeeze(1)
    rest = (~covered).nonzero().squeeze(1)
    if rest.numel():
        full = _apply_top_k_top_p(x[rest], k[rest], p[rest])
        tokens[rest] = _inverse_cdf(full.softmax(-1), u[rest])
    return tokens


def _mask_banned(logits: torch.Tensor, banned: list[list[int] | None],
                 banned_after: list[list[tuple[int, int]] | None] | None = None,
                 inflight: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `logits` with each row's banned tokens at -inf (the same tensor if none are banned).
    `banned_after`: per row, (token, banned) pairs that ban `banned` only if the row's token in flight
    (`inflight`, on the device) is `token` (a bad word's last token, in a step queued ahead of the one that
    samples the token before it). One copy to the device and one `index_add_` (-inf or 0 a pair), so no
    step waits."""
    flat: list[int] = []  # (row, token in flight or -1, banned) triples, flat
    for i, b in enumerate(banned):
        if b:
            for t in b:
                flat += (i, -1, t)
    always = len(flat)
    for i, pairs in enumerate(banned_after or ()):
        if pairs:
            for want, t in pairs:
                flat += (i, want, t)
    if not flat:
        return logits
    dev = logits.device
    rows, want, tokens = device_tensor(flat, dev, torch.long).view(-1, 3).unbind(1)
    hit = want < 0
    if len(flat) > always:
        if inflight is None:
            raise ValueError("bans on the token in flight need the tokens in flight")
        hit |= inflight[rows] == want
    out = logits.clone()
    values = torch.zeros(rows.shape[0], dtype=logits.dtype, device=dev).masked_fill_(hit, float("-inf"))
    out.view(-1).index_add_(0, rows * logits.shape[1] + tokens, values)  # (-inf + x is -inf; 0 + x is x)
    return out


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


@dataclass(slots=True)
class PendingSample:
    """A step's sampling, queued on the device: `tokens` (the sampled ids, [rows] int64) stay there for a
    step queued behind this one (`Engine.async_scheduling`); `result()` waits for the copy back and reads
    everything the step reports."""

    tokens: torch.Tensor
    _host: torch.Tensor  # the step's one device-to-host copy (pinned memory on a GPU)
    _done: object | None  # a CUDA event recorded after that copy; None on the CPU
    _read: Callable[[list], SampleOutput]

    def result(self) -> SampleOutput:
        if self._done is not None:
            self._done.synchronize()
        return self._read(self._host.tolist())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int] | None] | None = None, histories: list[History] | None = None,
           extra: torch.Tensor | None = None, allowed: RowBitmask | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] = TorchLayerOps.argmax,
           before_sync: Callable[[], None] | None = None) -> SampleOutput:
    """`logits`: [rows, vocab] in the model's dtype (argmax needs no upcast; filtering, sampling and
    logprobs run in float32 on the rows that need them); one `params`, optional generator, optional
    list of banned token ids and token history (needed by rows with penalties) per row. `extra`, a flat
    tensor on the device, comes back to the host in the same copy as the tokens (`SampleOutput.extra`);
    `allowed`: the tokens that grammar-constrained rows may take; `argmax`: each row's first maximum (the
    model's layer ops give a compiled one on the CPU); `before_sync`: called once every kernel of the step is
    queued, just before the copy back waits for them (on a GPU, host work done there overlaps the step)."""
    pending = launch_sample(logits, params, generators, banned, histories, extra, allowed, argmax)
    if before_sync is not None:
        before_sync()
    return pending.result()


def launch_greedy(logits: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor] = TorchLayerOps.argmax
                  ) -> PendingSample:
    """`launch_sample` for rows that are all plain greedy ones (no bans, bias, penalties, seeds or logprobs):
    each row's argmax, and the copy back, without `launch_sample`'s passes over the rows' params."""
    tokens = argmax(logits)
    n = logits.shape[0]
    return _copy_back(tokens, tokens, lambda host: SampleOutput(host, [None] * n))


def launch_sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  banned: list[list[int] | None] | None = None, histories: list[History] | None = None,
                  extra: torch.Tensor | None = None, allowed: RowBitmask | None = None,
                  argmax: Callable[[torch.Tensor], torch.Tensor] = TorchLayerOps.argmax,
                  counts: TokenCounts | None = None, request_ids: list[str] | None = None,
                  inflight: torch.Tensor | None = None,
                  banned_after: list[list[tuple[int, int]] | None] | None = None) -> PendingSample:
    """`sample`'s kernels and its copy back, queued without waiting for them (see `PendingSample`).
    `counts`, `request_ids`, `inflight`: penalized rows' token counts kept between steps, and the token of
    each row still in flight (`penalties.adjust_logits`); `banned_after`: bans that hold only if a row's
    token in flight is a given one (`_mask_banned`)."""
    raw = logits
    logits = _mask_banned(logits, banned or [], banned_after, inflight)
    if allowed is not None:
        logits = apply_token_bitmask(logits, allowed)
    logits = adjust_logits(logits, params, histories or [], counts, request_ids, inflight)
    greedy_tokens = argmax(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    tokens = greedy_tokens
    dev = logits.device
    if random_rows:
        idx = device_tensor(random_rows, dev)
        sub = [params[i] for i in random_rows]
        if len(sub) < len(params):
            x = logits[idx].float()  # a copy
        else:  # in place where `logits` is a float32 copy made above (the greedy ids are taken already)
            x = logits.float() if logits is not raw else logits.to(torch.float32, copy=True)
        x.div_(device_tensor([p.temperature for p in sub], dev)[:, None])
        x = apply_min_p(x, [p.min_p for p in sub])
        u = torch.rand(len(sub), dtype=torch.float64, device=dev)
        for row, i in enumerate(random_rows):
            if generators[i] is not None:
                u[row] = torch.rand((), dtype=torch.float64, device=dev, generator=generators[i])
        drawn = torch.empty(len(sub), dtype=torch.long, device=dev)
        for filtered in (False, True):
            part = [row for row, p in enumerate(sub) if (p.top_k > 0 or p.top_p < 1) == filtered]
            if not part:
                continue
            whole = len(part) == len(sub)  # then no copy of the logits
            rows = None if whole else device_tensor(part, dev)
            xs, us = (x, u) if whole else (x[rows], u[rows])
            got = (_sample_filtered(xs, [sub[r].top_k for r in part], [sub[r].top_p for r in part], us) if filtered
                   else _inverse_cdf(xs.softmax(-1), us))
            if whole:
                drawn = got
            else:
                drawn[rows] = got
        tokens = greedy_tokens.clone()
        tokens[idx] = drawn

    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    tail = [] if extra is None else [extra.double()]
    n = len(params)
    if not want:
        if not tail:
            return _copy_back(tokens, tokens, lambda host: SampleOutput(host, [None] * n))
        return _copy_back(tokens, torch.cat([tokens.double(), *tail]),
                          lambda host: SampleOutput([int(t) for t in host[:n]], [None] * n, extra=host[n:]))
    idx = device_tensor(want, dev)
    lp = raw[idx].float().log_softmax(-1)
    chosen = tokens[idx]
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
    ranks = (lp > chosen_lp[:, None]).sum(-1) + 1
    k = max(params[i].logprobs for i in want)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
    # One copy back for everything: float64 holds token ids and ranks exactly, and float32 logprobs too.
    packed = torch.cat([chosen_lp[:, None].double(), ranks[:, None].double(), top_ids.double(), top_lp.double()], 1)
    flat = torch.cat([tokens.double(), packed.flatten(), *tail])
    num_packed = packed.numel()

    def read(host: list) -> SampleOutput:
        rows = host[n:n + num_packed]
        width = 2 + 2 * k
        logprobs: list = [None] * n
        for row, i in enumerate(want):
            m, r = params[i].logprobs, rows[row * width:(row + 1) * width]
            logprobs[i] = (r[0], int(r[1]), [int(t) for t in r[2:2 + m]], r[2 + k:2 + k + m])
        return SampleOutput([int(t) for t in host[:n]], logprobs, extra=host[n + num_packed:])

    return _copy_back(tokens, flat, read)


def _copy_back(tokens: torch.Tensor, flat: torch.Tensor, read: Callable[[list], SampleOutput]) -> PendingSample:
    """`flat` (everything the step reports) queued for the host: on a GPU into pinned memory, with an event
    to wait for; on the CPU it is there already."""
    if flat.device.type != "cuda":
        return PendingSample(tokens, flat, None, read)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return PendingSample(tokens, host, done, read)
