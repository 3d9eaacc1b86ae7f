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


def _spacing_tokenizer():
    """A real fast tokenizer whose decoder puts a space between tokens, special ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<x>", "<y>"]})
    return fast


def test_spaces_between_special_tokens():
    tok = _spacing_tokenizer()
    ids = tok("a <x> <y> b <y>").input_ids

    def text(**kw) -> str:
        detok = IncrementalDetokenizer(tok, ids[:1], **kw)
        for t in ids[1:]:
            detok.update([t])
        return detok.output_text

    assert text(skip_special_tokens=False) == " <x> <y> b <y>"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == " <x><y> b <y>"
    assert text(spaces_between_special_tokens=False) == text() == " b"


def test_stop_string_kept_when_asked(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["ñandú"], include_stop_str_in_output=True)
    for t in ids:
        if detok.update([t]):
            break
    assert detok.output_text == "Hello 🤗 wörld — ñandú"


def test_the_rust_decode_is_used_only_where_it_gives_the_same_text(tokenizer):
    """The default model's fast tokenizer decodes through its Rust tokenizer directly (the wrapper cost
    ~1 ms a step at batch 256), with the same text as `tokenizer.decode` on every window the detokenizer
    decodes; a tokenizer that cleans up spaces after decoding keeps the wrapper."""
    import copy

    from workers.detokenizer import raw_decode

    ids = tokenizer("Say:").input_ids + tokenizer(TEXT, add_special_tokens=False).input_ids
    ids += [tokenizer.eos_token_id, *ids[:5]]
    decode = raw_decode(tokenizer)
    assert decode is not None
    for skip in (True, False):
        for start in range(0, len(ids), 3):
            for stop in range(start + 1, len(ids) + 1, 4):
                window = ids[start:stop]
                assert decode(window, skip_special_tokens=skip) == tokenizer.decode(window, skip_special_tokens=skip)
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert raw_decode(cleaning) is None and raw_decode(object()) is None
    assert IncrementalDetokenizer(cleaning, [1])._raw_decode is None
