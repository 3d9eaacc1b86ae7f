"""The soak's request mix: seeded, every shape in its share and range, and bodies each endpoint takes."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.soak_mix import SoakMix, SoakRequest, mix_counts, request_body, soak_requests

TOKENS = list(range(1000, 6000))


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_mix_is_seeded_and_holds_every_shape_in_its_share() -> None:
    reqs = soak_requests(TOKENS, decode, 4000, SoakMix(), seed=7)
    assert reqs == soak_requests(TOKENS, decode, 4000, SoakMix(), seed=7)
    assert reqs != soak_requests(TOKENS, decode, 4000, SoakMix(), seed=8)
    counts = mix_counts(reqs)
    for kind, share in (("chat", 0.5), ("stream", 0.52), ("disconnect", 0.05), ("n_gt_1", 0.095), ("stop", 0.14),
                        ("logprobs", 0.095)):
        assert counts[kind] == pytest.approx(share * 4000, rel=0.15), kind
    assert all(4 <= len(r.prompt_token_ids) <= 64 and 1 <= r.max_tokens <= 32 for r in reqs)
    for r in reqs:
        if r.disconnect_after is not None:
            assert r.stream and r.n == 1 and not r.stop and r.ignore_eos and 1 <= r.disconnect_after < r.max_tokens
        if r.n > 1:
            assert 2 <= r.n <= 3 and r.temperature > 0
        if r.chat:
            assert r.prompt_text == decode(list(r.prompt_token_ids))


def test_request_bodies_follow_each_endpoint() -> None:
    chat = SoakRequest(0, True, True, (1, 2), "hi", 5, n=2, temperature=0.7, stop=(".",), logprobs=3)
    body = request_body(chat, "m")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["stop"] == ["."]
    assert body["logprobs"] is True and body["top_logprobs"] == 3 and body["n"] == 2 and body["top_p"] == 0.95
    assert body["stream_options"] == {"include_usage": True} and "prompt" not in body
    plain = request_body(SoakRequest(1, False, False, (1, 2), None, 4, logprobs=0), "m")
    assert plain["prompt"] == [1, 2] and plain["logprobs"] == 0 and "stream_options" not in plain and "top_p" not in plain
    assert request_body(SoakRequest(2, False, False, (1,), "text", 4), "m")["prompt"] == "text"


@pytest.mark.parametrize("kw", [{"disconnect_share": 1.5}, {"min_prompt_len": 0}, {"max_max_tokens": 0}])
def test_a_bad_mix_is_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SoakMix(**kw)
