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

import weakref

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


def _byte_level_alphabet() -> dict[int, int]:
    """GPT-2's map of bytes to printable characters, which a `ByteLevel` decoder inverts: as `str.translate`
    takes it, each character's code to its byte's (whose latin-1 encoding is the byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + sum(1 for c in range(b) if c not in printable)
    return {char: byte for byte, char in chars.items()}


_BYTE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_tables(tokenizer) -> dict[bool, list[bytes]] | None:
    """Each token id's bytes where the Rust decode maps tokens to bytes and decodes them once (`can_defer`), by
    `skip_special_tokens` (skipped: no bytes): one table lookup and one strict UTF-8 decode give a token's text
    where the window would decode twice. Built once per tokenizer (~80 ms for SmolLM2's 49,152 ids on a 2-core
    Zen 4) and checked against the Rust decode of each id alone; None for other decoders."""
    try:
        return _BYTE_TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable
        return None
    tables = _build_byte_tables(tokenizer) if can_defer(tokenizer) else None
    _BYTE_TABLES[tokenizer] = tables
    return tables


def _build_byte_tables(tokenizer) -> dict[bool, list[bytes]] | None:
    """See `byte_tables`. A `ByteLevel` decoder turns a token whose every character is in GPT-2's alphabet into
    those bytes, any other into its UTF-8; a token whose text alone differs from its bytes' is taken as its
    text where that is whole characters, else there is no table."""
    backend = tokenizer.backend_tokenizer
    added = getattr(backend, "get_added_tokens_decoder", None)  # which are special: tokenizers 0.14 and later
    if added is None:
        return None
    n = backend.get_vocab_size(with_added_tokens=True)
    alphabet = _byte_level_alphabet()
    table: list[bytes] = []
    for i in range(n):
        piece = backend.id_to_token(i)
        if piece is None:
            table.append(b"")
        elif all(ord(c) in alphabet for c in piece):
            table.append(piece.translate(alphabet).encode("latin-1"))
        else:
            table.append(piece.encode())
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    for i, text in enumerate(texts):
        if table[i].decode(errors="replace") != text:
            if _INCOMPLETE in text:
                return None
            table[i] = text.encode()
    special = [i for i, t in added().items() if t.special and i < n]
    skipping = list(table)
    for i in special:
        skipping[i] = b""
    return {False: table, True: skipping}


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
        # each id's bytes (`byte_tables`), for a `ByteLevel` decoder; `_settled`: a token's text is its bytes'
        self._bytes: list[bytes] | None = None
        self._settled = False
        if self._raw_decode is not None and not self._added and not self._defer:
            tables = byte_tables(tokenizer)
            if tables is not None:
                self._bytes = tables[skip_special_tokens]
                self._settled = self._window_settled()
            elif _INCOMPLETE not in self._decode(self._ids):
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

    def _append(self, new: str) -> None:
        """`_text += new` at the cost of the new text: CPython grows a string no one else refers to in place,
        where the same `+=` on the attribute copies the whole text (every step of a stream, O(n) in its length)."""
        text, self._text = self._text, ""
        text += new
        self._text = text

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
                self._append(full[len(prefix):])
                self._prefix_offset, self._read_offset = self._read_offset, end
            return

    def _window_settled(self) -> bool:
        """Whether the window's next step would give a token's text as its bytes decode: no ids wait, and the
        window's prefix (the text last added) is whole characters (with a `ByteLevel` decoder, the window's
        text is then the prefix's followed by the token's)."""
        ids, table = self._ids, self._bytes
        if self._read_offset != len(ids):
            return False
        try:
            b"".join([table[i] for i in ids[self._prefix_offset:self._read_offset]]).decode()
        except (IndexError, UnicodeDecodeError):
            return False
        return True

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that ended the text (already cut off), if any."""
        if self._defer:
            self._ids.extend(new_token_ids)
            return None
        if self._settled and len(new_token_ids) == 1:
            # what the window gives, without decoding it: a token whose bytes are whole characters (not ending in
            # U+FFFD, on which the window waits) adds them; any other goes through the window
            token = new_token_ids[0]
            try:
                new = self._bytes[token].decode()
            except (IndexError, UnicodeDecodeError):
                new = ""
            if new and new[-1] != _INCOMPLETE:
                ids = self._ids
                ids.append(token)
                self._prefix_offset, self._read_offset = self._read_offset, len(ids)
                before = len(self._text)
                self._append(new)
                return self._find_stop(before) if self.stop else None
        if self._bytes is not None:
            hit = self._window(new_token_ids)
            self._settled = self._window_settled()
            return hit
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
            self._append(new)
            return self._find_stop(before) if self.stop else None
        return self._window(new_token_ids)

    def _window(self, new_token_ids: list[int]) -> str | None:
        """The window in Python (the module docstring): `update`'s step."""
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
        self._append(new)
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
