"""Structured outputs through xgrammar (vLLM's default grammar backend): each request's output follows
its JSON schema, regex, choice or EBNF grammar.

The engine's `StructuredOutputManager` compiles each distinct spec once (an LRU cache, with one xgrammar
compiler built from the tokenizer on first use), keeps one matcher per sequence, fills one token bitmask
for the step's constrained rows (the sampler masks those rows only) and advances the matchers with the
tokens the scheduler applied. A matcher is always synced to its request's output tokens before it is
read, so a recomputed (preempted) request or a retried step replays correctly. `validate_structured_outputs`
checks a spec without a tokenizer, for the server to answer 400 before it queues anything."""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from workers.penalties import device_tensor
from workers.request import Request
from workers.sampler import RowBitmask
from workers.structured_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 128
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_WHAT = {"json": "a valid JSON schema", "regex": "a valid regex", "choice": "a valid list of choices",
         "grammar": "a valid EBNF grammar", "json_object": "valid"}


def _xgr():
    import xgrammar  # imported on first use: it costs a second at start-up

    return xgrammar


def _error(kind: str, e: Exception) -> ValueError:
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    message = _XGRAMMAR_PREFIX.sub("", message)
    return ValueError(f"structured_outputs.{kind} is not {_WHAT[kind]}: {message}")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (string literals in JSON's escaping)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_spec(params: StructuredOutputsParams) -> str:
    if params.json_object:
        return '{"type": "object"}'
    return params.json if isinstance(params.json, str) else json.dumps(params.json)


@lru_cache(maxsize=DEFAULT_CACHE_SIZE)
def _validate_key(key: tuple[str, str, bool], spec: str) -> None:
    xgr = _xgr()
    kind = key[0]
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(spec, any_whitespace=not key[2])
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except Exception as e:
        raise _error(kind, e) from None


def _spec(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        return _json_spec(params)
    if kind == "choice":
        return choice_grammar(params.choice)
    return getattr(params, kind)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """ValueError naming the field unless the spec compiles to a grammar (no tokenizer needed)."""
    params.validate()
    _validate_key(params.key(), _spec(params))


@dataclass(slots=True, eq=False)
class _Sequence:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has taken


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, max_rows: int, device: torch.device | str = "cpu",
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.cache_size = cache_size
        self._max_rows = max_rows
        self._compiler = None
        self._batch = None
        self._bits: torch.Tensor | None = None
        self._grammars: OrderedDict[tuple, Any] = OrderedDict()
        self._sequences: dict[str, _Sequence] = {}
        self.num_compiled = 0

    @property
    def active(self) -> bool:
        """Whether any sequence is under a grammar."""
        return bool(self._sequences)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sequences

    def _compiler_for(self):
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
            self._batch = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of `params`, from the cache when the same spec was compiled before.
        Raises ValueError naming the field if the spec is invalid."""
        key = params.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        compiler = self._compiler_for()
        spec = _spec(params)
        try:
            if key[0] in ("json", "json_object"):
                grammar = compiler.compile_json_schema(spec, any_whitespace=not params.disable_any_whitespace)
            elif key[0] == "regex":
                grammar = compiler.compile_regex(spec)
            else:
                grammar = compiler.compile_grammar(spec)
        except Exception as e:
            raise _error(key[0], e) from None
        self.num_compiled += 1
        self._grammars[key] = grammar
        if len(self._grammars) > self.cache_size:
            self._grammars.popitem(last=False)
        return grammar

    def add(self, requests: list[Request], grammar) -> None:
        """One matcher per sequence; the grammar ends on EOS or on one of the request's stop token ids."""
        xgr = _xgr()
        for req in requests:
            stops = req.sampling_params.stop_token_ids
            override = sorted({req.eos_token_id, *stops} - {None}) if stops else None
            self._sequences[req.request_id] = _Sequence(xgr.GrammarMatcher(grammar, override_stop_tokens=override))

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sequences.pop(rid, None)

    def _sync(self, req: Request, seq: _Sequence) -> int | None:
        """Bring the matcher to the request's output tokens; returns the first token it refused, if any."""
        n_out = req.num_output_tokens
        if seq.num_accepted > n_out:
            seq.matcher.reset()
            seq.num_accepted = 0
        for token in req.all_token_ids[req.num_prompt_tokens + seq.num_accepted:]:
            if not seq.matcher.accept_token(token):
                return token
            seq.num_accepted += 1
        return None

    def bitmask(self, requests: list[Request]) -> RowBitmask | None:
        """The allowed next tokens of the constrained rows among `requests` (the step's sampling rows, in
        order), on the device; None when no row is constrained. A finished request's row is left free (a
        step queued ahead samples a row for a request the step before ended: that token is dropped)."""
        if not self._sequences:
            return None
        rows, seqs = [], []
        for i, req in enumerate(requests):
            seq = self._sequences.get(req.request_id)
            if seq is not None and not req.status.finished:
                self._sync(req, seq)
                rows.append(i)
                seqs.append(seq)
        if not rows:
            return None
        bits = self._buffer(len(rows))
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in seqs], bits)
        if self.device.type != "cpu":  # both through pinned memory, without waiting for the device
            return RowBitmask(device_tensor(rows, self.device), bits.to(self.device, non_blocking=True))
        return RowBitmask(torch.tensor(rows), bits)

    def _buffer(self, k: int) -> torch.Tensor:
        """The first `k` rows of the preallocated host bitmask (pinned for a GPU), grown when needed."""
        if self._bits is None or self._bits.shape[0] < k:
            rows = max(k, self._max_rows)
            self._bits = torch.empty(rows, -(-self.vocab_size // 32), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        return self._bits[:k]

    def accept(self, requests: list[Request]) -> tuple[list[Request], dict[Request, str]]:
        """Advance the matchers of the constrained `requests` by their new tokens. Returns the requests
        whose grammar has ended (it took its stop token) and those whose token it refused, with a message."""
        ended: list[Request] = []
        refused: dict[Request, str] = {}
        for req in requests:
            seq = self._sequences.get(req.request_id)
            if seq is None:
                continue
            token = self._sync(req, seq)
            if token is not None:
                refused[req] = (f"token {token} does not fit the request's structured_outputs grammar (was the "
                                "grammar's end banned, e.g. by min_tokens?)")
            elif seq.matcher.is_terminated():
                ended.append(req)
        return ended, refused
