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


def _window_only(detok: IncrementalDetokenizer) -> IncrementalDetokenizer:
    detok._stream = detok._bytes = None
    detok._settled = False
    return detok


def _same_text_both_ways(tok, cases, path: str = "stream", **kw) -> int:
    """Feeds each (prompt, output) case token by token to a detokenizer that takes a faster path than the
    window (`path`: "stream", the Rust decode stream; "bytes", each id's bytes) and to one held to the window
    in Python; asserts the same text and stop after every token. Returns how many cases ran on that path."""
    fast = 0
    for prompt, out in cases:
        a = IncrementalDetokenizer(tok, prompt, **kw)
        b = _window_only(IncrementalDetokenizer(tok, prompt, **kw))
        fast += (a._stream if path == "stream" else a._bytes) is not None
        for t in out:
            hit = a.update([t])
            assert hit == b.update([t]) and a.output_text == b.output_text, (prompt, out)
            if hit:
                break
    return fast


def _random_cases(tokenizer, seed: int) -> list[tuple[list[int], list[int]]]:
    """300 (prompt, output) id lists: random ids, a third of them byte tokens that split characters (also
    mid-prompt and left incomplete), every fourth output the text `TEXT`."""
    import random

    rng = random.Random(seed)
    vocab = len(tokenizer)
    byte_ids = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]
    assert len(byte_ids) > 100

    def pick() -> int:
        r = rng.random()
        return rng.choice(byte_ids) if r < 0.3 else rng.randrange(17) if r < 0.4 else rng.randrange(vocab)

    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    return [([pick() for _ in range(rng.randrange(1, 8))], text_ids if i % 4 == 0 else [pick() for _ in range(40)])
            for i in range(300)]


def test_each_ids_bytes_give_the_windows_text(tokenizer):
    """The default tokenizer's `ByteLevel` decoder: each token's text from its bytes (`byte_tables`) where the
    window's prefix is whole characters, else the window: the same text after every token on random ids, a
    third of them byte tokens that split characters (also mid-prompt and left incomplete), special tokens kept
    or skipped, with stop strings."""
    cases = _random_cases(tokenizer, seed=0)
    for skip in (True, False):
        assert _same_text_both_ways(tokenizer, cases, "bytes", skip_special_tokens=skip) == len(cases)
    assert _same_text_both_ways(tokenizer, cases, "bytes", stop=["end", "ñ", "\n"]) == len(cases)


def test_whole_characters_skip_the_window(tokenizer, monkeypatch):
    """Text of whole-character tokens takes no window decode at all; a character split across tokens takes
    the window until the text is whole again."""
    windows: list[list[int]] = []
    real = IncrementalDetokenizer._window

    def window(self, new):
        windows.append(new)
        return real(self, new)

    monkeypatch.setattr(IncrementalDetokenizer, "_window", window)
    plain = tokenizer("The quick brown fox jumps over the lazy dog, twice.", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:").input_ids)
    for t in plain:
        detok.update([t])
    assert detok.output_text == tokenizer.decode(plain) and windows == []
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    split = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    for t in ids:
        detok.update([t])
    assert detok.output_text == tokenizer.decode(plain + ids)
    assert len(split) <= len(windows) < len(ids)


def test_the_decode_stream_gives_the_windows_text(tokenizer, monkeypatch):
    """The Rust `DecodeStream` takes over the window for a decoder without byte tables (here the default
    tokenizer's, its tables turned off): the same text after every token on random ids, special tokens kept or
    skipped, with stop strings."""
    from workers import detokenizer

    monkeypatch.setattr(detokenizer, "byte_tables", lambda tokenizer: None)
    cases = _random_cases(tokenizer, seed=0)
    for skip in (True, False):
        assert _same_text_both_ways(tokenizer, cases, skip_special_tokens=skip) > 50
    assert _same_text_both_ways(tokenizer, cases, stop=["end", "ñ", "\n"]) > 50


def test_byte_tables_follow_the_byte_level_decoder():
    """Each id's bytes are what the Rust decode makes of it, added tokens outside GPT-2's alphabet (a space, a
    non-ASCII letter) included, special tokens none when skipped; a decoder other than `ByteLevel` has none."""
    from transformers import AutoTokenizer

    from workers.detokenizer import byte_tables, raw_decode
    from workers.model_loader import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.add_tokens(["hé llo", "<my token>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|sp é|>"]})
    tables = byte_tables(tok)
    assert tables is not None and byte_tables(tok) is tables  # built once
    decode = raw_decode(tok)
    added = tok.convert_tokens_to_ids(["hé llo", "<my token>", "<|sp é|>"])
    assert len(tables[False]) == len(tok)
    for i in [*range(0, len(tok), 97), *added]:
        for skip in (True, False):
            assert tables[skip][i].decode(errors="replace") == decode([i], skip_special_tokens=skip), i
    assert tables[False][added[0]] == "hé llo".encode() and tables[True][added[2]] == b""
    assert tables[False][added[2]] == "<|sp é|>".encode()
    assert byte_tables(_spacing_tokenizer()) is None


def _deferred_text_is_the_steps_text(tok, cases, defers: bool, **kw) -> None:
    """Each (prompt, output) case fed token by token to a detokenizer that decodes every token and to two that
    may defer (`defer=True`; whether they do: `defers`), one of them also read once partway: the same text
    at the end, and partway the text the steps had given by then."""
    import random

    rng = random.Random(2)
    for prompt, out in cases:
        steps = IncrementalDetokenizer(tok, prompt, **kw)
        deferred = IncrementalDetokenizer(tok, prompt, defer=True, **kw)
        read_midway = IncrementalDetokenizer(tok, prompt, defer=True, **kw)
        assert deferred._defer is defers and (deferred._stream is None or not defers)
        midway = rng.randrange(len(out))
        for i, t in enumerate(out):
            assert steps.update([t]) is None and deferred.update([t]) is None and read_midway.update([t]) is None
            if i == midway:
                assert read_midway.output_text == steps.output_text, (prompt, out[:i + 1])
        assert deferred.output_text == read_midway.output_text == steps.output_text, (prompt, out)


def test_a_deferred_detokenizer_gives_the_steps_text(tokenizer):
    """A final-only request's ids wait and are decoded in one window when its text is read: the same text as
    token by token, characters split across tokens or left incomplete at the end, special tokens kept or
    skipped. Stop strings and special-token spacing need each token seen, so they do not defer."""
    cases = _random_cases(tokenizer, seed=3)
    for skip in (True, False):
        _deferred_text_is_the_steps_text(tokenizer, cases, True, skip_special_tokens=skip)
    assert not IncrementalDetokenizer(tokenizer, [1], stop=["x"], defer=True)._defer
    assert not IncrementalDetokenizer(_spacing_tokenizer(), [1], skip_special_tokens=False,
                                      spaces_between_special_tokens=False, defer=True)._defer


def test_the_decode_stream_with_a_sentencepiece_style_decoder():
    """A tokenizer whose decoder turns a leading ▁ into a space (Metaspace): what a token adds depends on the
    one before, which the stream is primed with (the prompt's last tokens)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import CORPUS

    text = CORPUS.read_text()[:100_000]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"] +
                                  [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator([text[i:i + 1000] for i in range(0, len(text), 1000)] + [TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    assert fast.decode(fast(TEXT).input_ids, skip_special_tokens=True) == TEXT
    rng = random.Random(1)
    cases = [([rng.randrange(len(fast)) for _ in range(rng.randrange(1, 8))],
              fast(TEXT).input_ids if i % 3 == 0 else [rng.randrange(len(fast)) for _ in range(40)]) for i in range(300)]
    for skip in (True, False):
        assert _same_text_both_ways(fast, cases, skip_special_tokens=skip) > 100
        # byte fallback: each invalid byte its own U+FFFD, which a window can render otherwise; no deferring
        _deferred_text_is_the_steps_text(fast, cases, False, skip_special_tokens=skip)


def test_a_prompt_ending_in_part_of_a_character_keeps_the_window(tokenizer, monkeypatch):
    """Primed with a prompt tail that decodes to an incomplete character, the stream would report the
    prompt's text with the first token, and a token's bytes are not its text: such a prompt starts on the
    window."""
    from workers import detokenizer

    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    for tables in (True, False):
        if not tables:
            monkeypatch.setattr(detokenizer, "byte_tables", lambda tokenizer: None)
        detok = IncrementalDetokenizer(tokenizer, ids[:cut])
        assert detok._stream is None and not detok._settled
        for t in ids[cut:]:
            detok.update([t])
        assert detok.output_text.endswith(" end") and "\ufffd" not in detok.output_text
        fresh = IncrementalDetokenizer(tokenizer, tokenizer("Say:").input_ids)
        assert fresh._settled if tables else fresh._stream is not None


def test_a_stream_that_raises_hands_over_to_the_window(tokenizer, monkeypatch):
    """If the Rust stream raises (a decoder it cannot follow), the window goes on from the last text it gave,
    tokens it still held included, and the text is what the window alone would have made."""
    from workers import detokenizer

    monkeypatch.setattr(detokenizer, "byte_tables", lambda tokenizer: None)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    prompt = tokenizer("Say:").input_ids
    split = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i])[-1:])  # mid-character

    class Breaks:
        def __init__(self, stream, after: int) -> None:
            self.stream, self.left = stream, after

        def step(self, backend, new):
            if self.left == 0:
                raise RuntimeError("the stream broke")
            self.left -= 1
            return self.stream.step(backend, new)

    detok = IncrementalDetokenizer(tokenizer, prompt)
    detok._stream = Breaks(detok._stream, split)
    for t in ids:
        detok.update([t])
    assert detok._stream is None
    assert detok.output_text == tokenizer.decode(ids)
