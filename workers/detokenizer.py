"""Incremental detokenization and stop strings.

Decoding only the newest tokens would break characters split across tokens and drop SentencePiece's
leading spaces, so each step decodes a short window twice (with and without the new tokens) and keeps
the difference; text ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.

With `spaces_between_special_tokens=False` (and special tokens kept), a special token that follows
another one is written as itself, without the space a tokenizer's decoder may put between them (vLLM).

A fast tokenizer whose Rust decode gives `tokenizer.decode`'s text (`raw_decode`) does the same in Rust, one
call a token: `tokenizers`' `DecodeStream`, primed with the prompt's last tokens, keeps the window and its
offsets itself. It was 1.7 against 4.6 us a token on a 2-core Zen 5. Where its text could differ, the
window in Python takes over: a prompt whose last tokens decode to an incomplete character (the stream then
reports the prompt's text too), the special-token spacing above, or a stream that raises.

A request whose text is read only once it ends (`defer`: output kind final, no stop strings) is not decoded a
token at a time: its ids wait, and reading `output_text` decodes them in one window, the text up to its last
whole character (at batch 256 the per-token calls cost ~0.7 ms of host time a decode step on a 2-core Zen 4;
all told 1.6 against 0.3 us a token). That is the steps' text where a decoder maps tokens to bytes and decodes
the bytes once (`ByteLevel`: GPT-2's, Llama-3's, Qwen2's, SmolLM2's): text that ends on a whole character
leaves no state behind. Where byte fallback turns each invalid byte into U+FFFD by itself (SentencePiece's),
the windows' text can differ in those characters, so such tokenizers decode a token at a time."""

from __future__ import annotations

_PROMPT_CONTEXT = 5
_INCOMPLETE = "\ufffd"


def raw_decode(tokenizer):
    """The Rust tokenizer's own `decode` where it gives what `tokenizer.decode` gives, else None. A fast
    tokenizer's `decode` is the Rust one's plus argument conversion (~2 us a call, 4-5x the decode of a few
    ids) and, only with `clean_up_tokenization_spaces`, a clean-up pass; each step decodes twice per
    running request, so at batch 256 the wrapper alone cost ~1 ms of host time a step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    return backend.decode


def can_defer(tokenizer) -> bool:
    """Whether a final-only request may decode its text at the end (the module docstring): the Rust decode
    (`raw_decode`) through a `ByteLevel` decoder."""
    if raw_decode(tokenizer) is None:
        return False
    decoder = tokenizer.backend_tokenizer.decoder
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


def _decode_stream(prompt_tail: list[int], skip_special_tokens: bool):
    """A `DecodeStream` primed with `prompt_tail`, or None where `tokenizers` has none that takes a prompt
    (before 0.22)."""
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=prompt_tail, skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True, defer: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self._added: dict[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._raw_decode = raw_decode(tokenizer)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        # ids wait for `output_text` (see the module docstring); a special token's spacing needs each one seen
        self._defer = defer and not self.stop and not self._added and can_defer(tokenizer)
        self._stream = None  # tokenizers.decoders.DecodeStream, when it gives the window's text
        if (self._raw_decode is not None and not self._added and not self._defer
                and _INCOMPLETE not in self._decode(self._ids)):
            self._backend = tokenizer.backend_tokenizer
            self._stream = _decode_stream(self._ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def output_text(self) -> str:
        if self._defer and self._read_offset < len(self._ids):
            self._flush()
        return self._text

    def _flush(self) -> None:
        """Decode the waiting ids in one window: the text up to the last of them after which it ends on a
        whole character, which the steps one token at a time would have given by then."""
        ids, start = self._ids, self._prefix_offset
        prefix = self._decode(ids[start:self._read_offset])
        for end in range(len(ids), self._read_offset, -1):
            full = self._decode(ids[start:end])
            if full.endswith(_INCOMPLETE):
                continue
            if len(full) > len(prefix):
                self._text += full[len(prefix):]
                self._prefix_offset, self._read_offset = self._read_offset, end
            return

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that ended the text (already cut off), if any."""
        if self._defer:
            self._ids.extend(new_token_ids)
            return None
        if self._stream is not None:
            try:
                new = self._stream.step(self._backend, new_token_ids)
            except Exception:  # the window in Python goes on from the last text the stream gave
                self._stream = None
                self._prefix_offset = max(0, self._read_offset - _PROMPT_CONTEXT)
                return self.update(new_token_ids)
            self._ids.extend(new_token_ids)
            if not new:
                return None
            self._read_offset = len(self._ids)
            before = len(self._text)
            self._text += new
            return self._find_stop(before) if self.stop else None
        self._ids.extend(new_token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return None
        before = len(self._text)
        new = full[len(prefix):]
        if len(new_token_ids) == 1 and new_token_ids[0] in self._added and len(self._ids) > 1 \
                and self._ids[-2] in self._added:
            new = self._added[new_token_ids[0]]
        self._text += new
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._find_stop(before) if self.stop else None

    def _find_stop(self, before: int) -> str | None:
        """The first stop string in the text, searched from where it could start given the `before` old
        characters; cuts the text there."""
        search_from = max(0, before - self._max_stop + 1)
        hits = [(self._text.find(s, search_from), s) for s in self.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return None
        pos, s = min(hits)
        self._text = self._text[:pos + len(s) if self.include_stop_str_in_output else pos]
        return s
