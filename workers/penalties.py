"""Logit adjustments before a row picks its token, with vLLM's meanings: logit bias, repetition penalty
(over prompt and output tokens: positive logits divided, negative multiplied), frequency and presence
penalties (OpenAI's, over output tokens), and bad words (a word's last token is banned when the output so
far ends with the word's other tokens).

Adjustments run on the batched logits: each row's token history becomes index tensors, and counts come
from one scatter over all rows that need them."""

from __future__ import annotations

import torch

from workers.sampling_params import SamplingParams

# Per row: all its token ids (prompt then output) and how many of them are the prompt's.
History = tuple[list[int], int]


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `values` on `device`. On a GPU it goes through pinned memory without waiting: a plain
    `torch.tensor(..., device="cuda")` waits for every kernel queued before it, which would stall a step
    queued behind the one the device is running (`Engine.async_scheduling`)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _token_counts(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 counts of each row's tokens."""
    counts = torch.zeros(len(lists), vocab, device=device)
    lens = torch.tensor([len(x) for x in lists])
    if int(lens.sum()) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(lists)), lens).to(device)
    tokens = torch.tensor([t for x in lists for t in x], device=device)
    return counts.index_put_((rows, tokens), torch.ones((), device=device), accumulate=True)


def _apply_logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    rows = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if not rows:
        return
    dev = x.device
    idx = (torch.tensor([r[0] for r in rows], device=dev), torch.tensor([r[1] for r in rows], device=dev))
    x.index_put_(idx, torch.tensor([r[2] for r in rows], dtype=x.dtype, device=dev), accumulate=True)


def _apply_penalties(x: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> None:
    dev = x.device
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    out_counts = _token_counts([ids[n:] for ids, n in histories], x.shape[1], dev)
    if any(p.repetition_penalty != 1 for p in params):
        seen = (_token_counts([ids[:n] for ids, n in histories], x.shape[1], dev) + out_counts) > 0
        scaled = torch.where(x > 0, x / rep, x * rep)
        x.copy_(torch.where(seen, scaled, x))
    x -= freq * out_counts + pres * (out_counts > 0)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """`logits` with each row's logit bias and penalties applied (float32 if any row has some; the same
    tensor if none has)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    idx = device_tensor(rows, logits.device)
    sub = [params[i] for i in rows]
    x = logits[idx].float()
    _apply_logit_bias(x, sub)
    if any(p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0 for p in sub):
        _apply_penalties(x, sub, [histories[i] for i in rows])
    out = logits.to(torch.float32, copy=True)
    out[idx] = x
    return out


def apply_min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the row's highest (`x`: temperature-scaled
    float32 logits, one `min_p` per row; 0 keeps the row as it is)."""
    if not any(m > 0 for m in min_p):
        return x
    probs = x.softmax(-1)
    threshold = device_tensor(min_p, x.device)[:, None] * probs.max(-1, keepdim=True).values
    return x.masked_fill(probs < threshold, float("-inf"))


def bad_words_ban(output_ids: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """The last tokens of the bad words whose other tokens end `output_ids` (one-token words always)."""
    banned = []
    for word in bad_words_ids:
        k = len(word) - 1
        if k == 0 or (len(output_ids) >= k and output_ids[-k:] == word[:-1]):
            banned.append(word[-1])
    return banned


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids, as vLLM makes them: the word without leading spaces, and also with one
    leading space when that tokenizes to as many tokens but starts differently."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
