"""Logit adjustments before a row picks its token, with vLLM's meanings: logit bias, repetition penalty
(over prompt and output tokens: positive logits divided, negative multiplied), frequency and presence
penalties (OpenAI's, over output tokens), and bad words (a word's last token is banned when the output so
far ends with the word's other tokens).

Adjustments run on the batched logits. Penalized rows read their token counts from `TokenCounts`, kept on
the device between steps and brought up to date with each row's new tokens, so that a step's host work does
not grow with the histories, and a step queued behind the one in flight counts that step's token from the
device (`adjust_logits`'s `inflight`)."""

from __future__ import annotations

import torch

from workers.sampling_params import SamplingParams

# Per row: all its token ids (prompt then output) and how many of them are the prompt's.
History = tuple[list[int], int]


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `values` on `device`. On a GPU it goes through pinned memory without waiting: a plain
    `torch.tensor(..., device="cuda")` waits for every kernel queued before it, which would stall a step
    queued behind the one the device is running (`Engine.async_scheduling`)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)  # (no `device=`: `pageable_copies` finds the calls that pass one)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class TokenCounts:
    """The token counts that penalties read, kept on the device between steps: per penalized request a row of
    its output tokens' counts (float32) and a row marking its prompt's tokens, in buffers that grow as
    requests come (`rows`). Each call brings a request's rows up to date with the tokens its history gained
    since the one before (one a decode step), so the host's work a step is the new tokens, not the whole
    histories; a request seen first, or whose history no longer extends the one counted, is counted anew.
    `release` frees finished requests' rows."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # [capacity, vocab] float32: output tokens' counts
        self.prompt: torch.Tensor | None = None  # [capacity, vocab] bool: the prompt's tokens
        self._rows: dict[str, list[int]] = {}  # request id -> [row, prompt length, output tokens counted]
        self._free: list[int] = []
        self._used = 0  # rows ever taken
        self.span: slice | None = None  # the last call's rows as a slice, when they are consecutive and in order

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            entry = self._rows.pop(rid, None)
            if entry is not None:
                self._free.append(entry[0])

    def rows(self, request_ids: list, histories: list[History], vocab: int, device: torch.device) -> torch.Tensor:
        """The row of each request (int64, on `device`), its counts brought up to date with its history; when
        the rows are consecutive and in order (a batch that came together), `span` holds them as a slice, for
        views instead of gathers."""
        if self.out is None or self.out.shape[1] != vocab or self.out.device != device:
            self._rows, self._free, self._used = {}, [], 0
            self.out = torch.zeros(0, vocab, device=device)
            self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        fresh: list[int] = []
        added: list[int] = []  # flat positions (row * vocab + token) of the output tokens to count
        marked: list[int] = []  # and of the prompt tokens to mark
        rows: list[int] = []
        for rid, (ids, n) in zip(request_ids, histories):
            entry = self._rows.get(rid)
            if entry is None:
                entry = self._rows[rid] = [self._take(), -1, 0]
            base = entry[0] * vocab
            if entry[1] != n or n + entry[2] > len(ids):  # new, or not the history counted
                entry[1], entry[2] = n, 0
                fresh.append(entry[0])
                marked += [base + t for t in ids[:n]]
            counted = n + entry[2]
            if counted < len(ids):
                added += [base + t for t in ids[counted:]]
                entry[2] = len(ids) - n
            rows.append(entry[0])
        if self._used > self.out.shape[0]:
            grow = max(8, self.out.shape[0], self._used - self.out.shape[0])
            self.out = torch.cat([self.out, self.out.new_zeros(grow, vocab)])
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, vocab)])
        self.span = slice(rows[0], rows[-1] + 1) if rows and rows[-1] - rows[0] == len(rows) - 1 and all(
            b - a == 1 for a, b in zip(rows, rows[1:])) else None
        parts = [fresh, added, marked, rows]
        packed = device_tensor([v for part in parts for v in part], device, torch.long)  # one copy
        fresh_t, added_t, marked_t, rows_t = packed.split([len(p) for p in parts])
        # kernels that never wait for the device (a sorting `index_put_` might)
        if fresh:
            self.out.index_fill_(0, fresh_t, 0.0)
            self.prompt.index_fill_(0, fresh_t, False)
        if added:
            self.out.view(-1).index_add_(0, added_t, torch.ones(len(added), device=device))
        if marked:
            self.prompt.view(-1).index_fill_(0, marked_t, True)
        return rows_t

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        self._used += 1
        return self._used - 1


def _apply_logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    rows = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if not rows:
        return
    packed = device_tensor(rows, x.device, torch.float64)  # one copy: ids below 2**53 are exact in float64
    # `index_add_` on the flat logits (`x` is a contiguous float32 copy): atomic adds, no sort, never a wait
    x.view(-1).index_add_(0, packed[:, 0].long() * x.shape[1] + packed[:, 1].long(), packed[:, 2].to(x.dtype))


def _apply_penalties(x: torch.Tensor, params: list[SamplingParams], out_counts: torch.Tensor,
                     prompt: torch.Tensor, gather: bool | None = None) -> None:
    """Penalties on `x` (float32 logits, contiguous) in place, from each row's output tokens' counts and its
    prompt's tokens; repetition first, then frequency, then presence, each only if some row needs it. A positive
    logit is multiplied by the penalty's reciprocal rather than divided by it (within an ulp).

    On a GPU (`gather` false) each is one in-place pass over the logits (`mul_`, `addcmul_`): a batch-256 step's
    rows are 50 MB a pass in float32 at a 49,152-token vocabulary. On the CPU (`gather`, its default there with a
    repetition or presence penalty) the logits of the tokens seen are gathered (`nonzero`, which on a GPU would
    wait for the device), adjusted and put back by the same operations in the same order: the same bits, and no
    pass over the logits but the masks' (batch 256 on a 2-core EPYC, a greedy step's sampling with a repetition
    penalty: 126-149 -> 60-62 ms, one run 98; docs/results/sampler-copies-20261208)."""
    coef = device_tensor([[p.frequency_penalty, p.presence_penalty, p.repetition_penalty] for p in params], x.device,
                         torch.float)  # one copy
    freq, pres, rep = coef[:, 0:1], coef[:, 1:2], coef[:, 2:3]
    any_rep = any(p.repetition_penalty != 1 for p in params)
    any_freq = any(p.frequency_penalty != 0 for p in params)
    any_pres = any(p.presence_penalty != 0 for p in params)
    if gather is None:  # (frequency alone: one pass, as fast as finding the tokens seen)
        gather = x.device.type == "cpu" and (any_rep or any_pres)
    present = out_counts > 0 if any_rep or any_pres or gather else None
    if gather:
        flat, vocab = x.view(-1), x.shape[1]
        if any_rep:
            at = (prompt | present).view(-1).nonzero().squeeze(1)
            v, r = flat[at], at // vocab
            flat[at] = v * torch.where(v > 0, 1 / rep[r, 0], rep[r, 0])
        if any_freq or any_pres:
            at = present.view(-1).nonzero().squeeze(1)
            v, r = flat[at], at // vocab
            if any_freq:
                v.addcmul_(out_counts.reshape(-1)[at], freq[r, 0], value=-1)  # (one rounding, as below)
            if any_pres:
                v.sub_(pres[r, 0])
            flat[at] = v
        return
    if any_rep:
        x.mul_(torch.where(prompt | present, torch.where(x > 0, 1 / rep, rep), 1.0))
    if any_freq:
        x.addcmul_(out_counts, freq, value=-1)
    if any_pres:
        x.addcmul_(present, pres, value=-1)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[History | None],
                  counts: TokenCounts | None = None, request_ids: list[str] | None = None,
                  inflight: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` with each row's logit bias and penalties applied (float32 if any row has some; the same
    tensor if none has). A penalized row needs its history; `counts` keeps those rows' token counts between
    calls, under `request_ids` (without it they are counted anew). `inflight`: a token per row, on the device,
    that comes after each row's history and is not in it yet (a step queued behind the step that samples it,
    whose sampled ids are its input ids: `Engine.async_scheduling`)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    dev = logits.device
    every = len(rows) == len(params)  # then the rows are adjusted in the copy returned, not gathered apart
    idx = None if every else device_tensor(rows, dev)
    sub = [params[i] for i in rows]
    x = logits.to(torch.float32, copy=True) if every else logits[idx].float()
    _apply_logit_bias(x, sub)
    pen = [j for j, p in enumerate(sub) if p.penalizes]
    if pen:
        batch_rows = [rows[j] for j in pen]
        counts = counts if counts is not None else TokenCounts()
        keys = request_ids if request_ids is not None else list(range(len(params)))
        slots = counts.rows([keys[i] for i in batch_rows], [histories[i] for i in batch_rows], x.shape[1], dev)
        span = counts.span
        # the kept rows themselves where they are consecutive (no 50 MB gather at batch 256), else a gathered copy
        if span is not None:
            out_counts, prompt = counts.out[span], counts.prompt[span]
        else:
            out_counts, prompt = counts.out[slots], counts.prompt[slots]
        one = None
        if inflight is not None:  # each row's token in flight: counted in the copy, or in the kept rows and out again
            ids = (inflight if len(batch_rows) == len(params) else inflight[device_tensor(batch_rows, dev)])[:, None]
            one = torch.ones(len(pen), 1, device=dev)
            out_counts.scatter_add_(1, ids, one)
        whole = len(pen) == len(sub)
        pen_idx = None if whole else device_tensor(pen, dev)
        y = x if whole else x[pen_idx]
        _apply_penalties(y, [sub[j] for j in pen], out_counts, prompt)
        if one is not None and span is not None:
            out_counts.scatter_add_(1, ids, one.neg_())  # (whole numbers in float32: exactly as they were)
        if not whole:
            x[pen_idx] = y
    if every:
        return x
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


class BadWords:
    """A request's bad words (token ids, `bad_words_token_ids`), split once by length so that a step's bans
    cost little: one-token words are always banned, a two-token word's last token after its first, a longer
    word's after its other tokens. `ids[start:]` is the output so far (only output tokens make a word)."""

    __slots__ = ("always", "pairs", "longer")

    def __init__(self, words: list[list[int]]) -> None:
        self.always = [w[0] for w in words if len(w) == 1]
        self.pairs = [(w[0], w[1]) for w in words if len(w) == 2]
        self.longer = [(w[:-2], w[-2], w[-1]) for w in words if len(w) > 2]

    def ban(self, ids: list[int], start: int) -> list[int]:
        """The last tokens of the words whose other tokens end the output."""
        banned = list(self.always)
        n = len(ids) - start
        if n:
            last = ids[-1]
            banned += [b for a, b in self.pairs if a == last]
            for prefix, a, b in self.longer:
                k = len(prefix)
                if a == last and n > k and ids[-k - 1:-1] == prefix:
                    banned.append(b)
        return banned

    def ban_after(self, ids: list[int], start: int) -> tuple[list[int], list[tuple[int, int]]]:
        """`ban` for the token after one still in flight (a step queued ahead, whose host does not know that
        token yet): the one-token words, banned whatever it is, and a (next-to-last, last) pair for each longer
        word whose tokens before those two end the output: its last token is banned if the token in flight is
        its next-to-last (`sampler._mask_banned` compares them on the device). The first list, and the second
        where there is no longer word, are the object's own: not to be changed."""
        if not self.longer:
            return self.always, self.pairs
        pairs = list(self.pairs)
        n = len(ids) - start
        for prefix, a, b in self.longer:
            k = len(prefix)
            if n >= k and ids[-k:] == prefix:
                pairs.append((a, b))
        return self.always, pairs


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
