"""The request mix of `kvrelay bench soak`: many small requests of varied shape (both endpoints, streamed
or not, n>1, stop strings, logprobs, sampling or greedy, some cut off by the client mid-stream), drawn
from a seeded generator so a soak can be replayed exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from loadtest.workloads import prompt_slice

STOP_STRINGS = ("\n", ".", ",", " the", " and", "!")
MAX_LOGPROBS = 5


@dataclass(frozen=True)
class SoakMix:
    """Shares and ranges of the mix. Defaults keep requests small: on 2 cores with the default model a
    request costs about 0.1 s of server time at concurrency 16, so 10,000 take about 20 minutes."""

    chat_share: float = 0.5
    stream_share: float = 0.5
    text_prompt_share: float = 0.25  # of /v1/completions: a string prompt instead of token ids
    min_prompt_len: int = 4
    max_prompt_len: int = 64
    min_max_tokens: int = 1
    max_max_tokens: int = 32
    multi_n_share: float = 0.1  # n in [2, max_n], always sampled (greedy copies would be identical)
    max_n: int = 3
    stop_share: float = 0.15
    logprobs_share: float = 0.1
    sampled_share: float = 0.5  # temperature in [0.5, 1.0] with top_p 0.95; the rest greedy
    ignore_eos_share: float = 0.5
    disconnect_share: float = 0.05  # streamed, n=1, no stop, ignore_eos, closed after 1..max_tokens-1 chunks

    def __post_init__(self) -> None:
        for name in ("chat_share", "stream_share", "text_prompt_share", "multi_n_share", "stop_share",
                     "logprobs_share", "sampled_share", "ignore_eos_share", "disconnect_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(f"prompt lengths need 1 <= min <= max, got {self.min_prompt_len}..{self.max_prompt_len}")
        if not 1 <= self.min_max_tokens <= self.max_max_tokens:
            raise ValueError(f"max_tokens range needs 1 <= min <= max, got {self.min_max_tokens}..{self.max_max_tokens}")
        if self.disconnect_share > 0 and self.max_max_tokens < 2:
            raise ValueError("disconnecting mid-stream needs max_tokens of at least 2")
        if self.max_n < 2 and self.multi_n_share > 0:
            raise ValueError(f"max_n must be >= 2 when multi_n_share > 0, got {self.max_n}")


@dataclass(frozen=True)
class SoakRequest:
    """One request of the mix; `disconnect_after` = close the connection after that many content chunks."""

    index: int
    chat: bool
    stream: bool
    prompt_token_ids: tuple[int, ...]
    prompt_text: str | None  # chat message content, or a string prompt for /v1/completions
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    disconnect_after: int | None = None

    @property
    def path(self) -> str:
        return "/chat/completions" if self.chat else "/completions"


def soak_requests(tokens: list[int], decode: Callable[[list[int]], str], num: int, mix: SoakMix = SoakMix(),
                  seed: int = 0) -> list[SoakRequest]:
    """`num` requests of the mix with prompts cut from `tokens` (the corpus); `decode` turns token ids
    into text for chat messages and string prompts."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        chat = bool(rng.random() < mix.chat_share)
        prompt_len = int(rng.integers(mix.min_prompt_len, mix.max_prompt_len + 1))
        ids = prompt_slice(tokens, i, prompt_len)
        text = decode(ids) if chat or rng.random() < mix.text_prompt_share else None
        max_tokens = int(rng.integers(mix.min_max_tokens, mix.max_max_tokens + 1))
        if rng.random() < mix.disconnect_share:
            max_tokens = max(2, max_tokens)
            out.append(SoakRequest(i, chat, True, tuple(ids), text, max_tokens, ignore_eos=True,
                                   disconnect_after=int(rng.integers(1, max_tokens))))
            continue
        n = int(rng.integers(2, mix.max_n + 1)) if rng.random() < mix.multi_n_share else 1
        sampled = n > 1 or rng.random() < mix.sampled_share
        temperature = round(float(rng.uniform(0.5, 1.0)), 2) if sampled else 0.0
        stop = tuple(rng.choice(STOP_STRINGS, size=int(rng.integers(1, 3)), replace=False).tolist()) \
            if rng.random() < mix.stop_share else ()
        logprobs = int(rng.integers(0, MAX_LOGPROBS + 1)) if rng.random() < mix.logprobs_share else None
        out.append(SoakRequest(i, chat, bool(rng.random() < mix.stream_share), tuple(ids), text, max_tokens, n,
                               temperature, stop, logprobs, bool(rng.random() < mix.ignore_eos_share)))
    return out


def request_body(req: SoakRequest, model: str) -> dict[str, Any]:
    """The JSON body of `req` for its endpoint."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "n": req.n, "temperature": req.temperature,
                            "stream": req.stream, "ignore_eos": req.ignore_eos}
    if req.temperature > 0:
        body["top_p"] = 0.95
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.stop:
        body["stop"] = list(req.stop)
    if req.chat:
        body["messages"] = [{"role": "user", "content": req.prompt_text or ""}]
        if req.logprobs is not None:
            body.update(logprobs=True, top_logprobs=req.logprobs)
    else:
        body["prompt"] = req.prompt_text if req.prompt_text is not None else list(req.prompt_token_ids)
        if req.logprobs is not None:
            body["logprobs"] = req.logprobs
    return body


def mix_counts(requests: list[SoakRequest]) -> dict[str, int]:
    """How many requests of each kind the mix holds (a request can be of several kinds)."""
    return {"total": len(requests), "chat": sum(r.chat for r in requests),
            "completions": sum(not r.chat for r in requests), "stream": sum(r.stream for r in requests),
            "n_gt_1": sum(r.n > 1 for r in requests), "stop": sum(bool(r.stop) for r in requests),
            "logprobs": sum(r.logprobs is not None for r in requests),
            "sampled": sum(r.temperature > 0 for r in requests),
            "disconnect": sum(r.disconnect_after is not None for r in requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "max_tokens": sum(r.max_tokens * r.n for r in requests)}
