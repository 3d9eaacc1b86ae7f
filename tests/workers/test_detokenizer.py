"""Incremental detokenization across multi-byte characters, and stop strings on text."""

from __future__ import annotations

from workers.detokenizer import IncrementalDetokenizer

TEXT = "Hello 🤗 wörld — ñandú 日本語のテキスト, emoji 👩‍👩‍👧 end"


def test_token_by_token_equals_full_decode(tokenizer):
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the text must split a character across tokens"
    detok = IncrementalDetokenizer(tokenizer, prompt)
    for t in ids:
        assert detok.update([t]) is None
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == tokenizer.decode(ids)


def test_stop_string_cut_and_reported(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["ñandú"])
    hit = None
    for t in ids:
        hit = detok.update([t])
        if hit:
            break
    assert hit == "ñandú"
    assert detok.output_text == "Hello 🤗 wörld — "
