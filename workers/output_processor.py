"""Turning sampled tokens into what callers see: incremental text, stop strings, logprobs, `n > 1`
groups and `RequestOutput`s (cumulative, delta or final-only), plus the token and finish counters.

The scheduler owns requests' tokens and blocks; this module only reads them. A stop string is found here,
so the requests it ends are handed back to the engine, which finishes them in the scheduler."""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field

from workers.detokenizer import IncrementalDetokenizer
from workers.outputs import CompletionOutput, Logprob, RequestOutput
from workers.prompt_logprobs import PromptLogprobsChunk
from workers.request import Request, RequestStatus


_MAX_UNTAKEN_GAPS = 1 << 16


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every step: everything so far
    DELTA = "delta"  # every step: only what is new
    FINAL_ONLY = "final"  # once, when the request finishes


@dataclass(slots=True, eq=False)
class _Sequence:
    """One completion: its scheduler request plus text and logprobs."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    seen_tokens: int = 0  # output tokens detokenized so far


@dataclass(slots=True, eq=False)
class _Group:
    """The completions of one request (`n` of them), reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    output_kind: OutputKind
    arrival_time: float
    kv_imported: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    counted_prompt: bool = False
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False
    live: int = 0  # sequences without a finish reason

    @property
    def finished(self) -> bool:
        return self.live == 0


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # by finish reason; "handoff": a prefill replica's hand-off
        # Seconds between a request's successive token steps, not yet taken. The engine loop takes them every
        # step; a reader that never does (the offline `LLM`) keeps only the latest.
        self._token_gaps: deque[float] = deque(maxlen=_MAX_UNTAKEN_GAPS)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def request_ids(self) -> list[str]:
        return list(self._groups)

    def add_request(self, request_id: str, prompt: str | None, requests: list[Request], output_kind: OutputKind,
                    arrival_time: float, kv_imported: bool) -> None:
        """Track a request whose completions are `requests` (one per `n`, sharing the prompt)."""
        ids = requests[0].prompt_token_ids
        group = _Group(request_id, prompt, ids, [], output_kind, arrival_time, kv_imported)
        if requests[0].sampling_params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for req in requests:
            p = req.sampling_params
            # a final-only request's text is read once, when it ends: decoded then, in one window
            detok = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.stop_strings,
                                           p.include_stop_str_in_output, p.spaces_between_special_tokens,
                                           defer=output_kind is OutputKind.FINAL_ONLY)
            want_lp = p.logprobs is not None
            seq = _Sequence(req, detok, [] if want_lp else None, 0.0 if want_lp else None)
            group.seqs.append(seq)
            self._seq_of[req.request_id] = (group, seq)
        group.live = len(group.seqs)
        self._groups[request_id] = group

    def tracks(self, request_id: str) -> bool:
        return request_id in self._seq_of

    def tracks_all(self, requests: list[Request]) -> bool:
        """Whether every one of `requests` is tracked (the common case: none aborted since its step)."""
        seq_of = self._seq_of
        return all(r.request_id in seq_of for r in requests)

    def mark_scheduled(self, requests: list[Request], now: float) -> None:
        for req in requests:
            group = self._seq_of[req.request_id][0]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now

    def abort(self, request_id: str) -> list[Request]:
        """Forget a request; returns its unfinished sequences' requests for the scheduler to finish."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        live = [s for s in group.seqs if s.finish_reason is None]
        for s in live:
            s.finish_reason = "abort"
            self._seq_of.pop(s.request.request_id, None)
        group.live = 0
        self.finished["abort"] += len(live)
        return [s.request for s in live]

    def process(self, sampled: list[Request], logprobs: list, now: float,
                prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None) -> tuple[list[RequestOutput], list[Request]]:
        """Record prompt logprobs, detokenize each request's new token and check its stop strings. Returns
        the outputs of the requests that made progress, and the requests a stop string ended (still running
        in the scheduler)."""
        for rid, chunk in (prompt_logprobs or {}).items():
            if rid in self._seq_of:
                self._record_prompt_logprobs(self._seq_of[rid][0], chunk)
        touched: dict[str, _Group] = {}
        stopped: list[Request] = []
        seq_of = self._seq_of
        generated = 0
        for req, lp in zip(sampled, logprobs):
            group, seq = seq_of[req.request_id]
            touched[group.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
            if not group.counted_prompt:
                group.counted_prompt = True
                self.prompt_tokens += len(group.prompt_token_ids)
            ids = req.all_token_ids
            n_out = len(ids) - len(group.prompt_token_ids)
            new = n_out - seq.seen_tokens  # more than one after accepted drafts
            seq.seen_tokens = n_out
            generated += new
            token = ids[-1]
            if new > 1:
                for t in ids[-new:-1]:  # speculation: its requests have no stop strings, so only
                    seq.detokenizer.update([t])  # the last token can stop one
            if lp is not None:
                self._record_logprobs(seq, token, lp)
            hit = seq.detokenizer.update([token])
            if (hit is not None or req.status.finished) and self._finish(req, seq, hit, n_out):
                group.live -= 1
                if not req.status.finished:
                    stopped.append(req)
        self.generation_tokens += generated
        outputs = []
        gaps, interval = self._token_gaps, self.stream_interval
        final_only, delta = OutputKind.FINAL_ONLY, OutputKind.DELTA
        for group in touched.values():  # every step at batch 256: kept lean
            last = group.last_token_time
            if last is not None:
                gaps.append(now - last)
            group.last_token_time = now
            if group.live == 0:  # finished
                group.metrics = {"arrival_time": group.arrival_time, "first_scheduled_time": group.first_scheduled_time,
                                 "first_token_time": group.first_token_time, "finished_time": now,
                                 "kv_imported": group.kv_imported,
                                 "kv_handoff": any(s.request.hold_kv for s in group.seqs)}
                del self._groups[group.request_id]
                for s in group.seqs:
                    self._seq_of.pop(s.request.request_id, None)
                outputs.append(self._make_output(group))
            elif group.output_kind is delta and len(group.seqs) == 1:  # a stream's: `_due` and `_make_output`'s
                seq = group.seqs[0]
                unsent = seq.seen_tokens - seq.sent_tokens
                if unsent >= interval or (unsent and not seq.sent_tokens):
                    outputs.append(self._make_delta(group, seq))
            elif group.output_kind is not final_only and self._due(group):
                outputs.append(self._make_output(group))
        return outputs, stopped

    def take_token_gaps(self) -> list[float]:
        """The inter-token gaps recorded since the last call: one per request per step that gave it tokens
        (after its first), whatever its output kind and `stream_interval`, so a request reported only at its
        end still counts one gap per token step."""
        gaps = list(self._token_gaps)
        self._token_gaps.clear()
        return gaps

    def _due(self, group: _Group) -> bool:
        """Whether an unfinished request reports this step: cumulative ones every step; delta ones on their
        first token, then once `stream_interval` new tokens wait (the rest go with the final output)."""
        if group.output_kind is OutputKind.CUMULATIVE:
            return True
        if group.output_kind is OutputKind.FINAL_ONLY:
            return False
        for s in group.seqs:
            unsent = s.seen_tokens - s.sent_tokens
            if unsent >= self.stream_interval or (unsent and not s.sent_tokens):
                return True
        return False

    def _finish(self, req: Request, seq: _Sequence, hit: str | None, n_out: int) -> bool:
        """Set the finish reason of a sequence that the scheduler finished or whose new token (its `n_out`-th)
        completed stop string `hit`; True if the sequence finished. A token-level stop (the scheduler's) comes
        first, then a stop string, then length."""
        p = req.sampling_params
        if req.status is RequestStatus.FINISHED_STOPPED:
            seq.finish_reason = "stop"
        elif hit is not None and (n_out > p.min_tokens or n_out == req.max_tokens):
            seq.finish_reason, req.stop_reason = "stop", hit
        elif req.status is RequestStatus.FINISHED_LENGTH:
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        handoff = seq.finish_reason == "length" and req.hold_kv
        self.finished["handoff" if handoff else seq.finish_reason] += 1  # handoff: the decode pool goes on
        return True

    def _logprob_entry(self, token: int, lp: tuple) -> dict[int, Logprob]:
        """vLLM's per-position dict: the top-k by rank, plus the actual token with its own rank."""
        chosen_lp, rank, top_ids, top_lps = lp
        entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(zip(top_ids, top_lps))}
        entry[token] = Logprob(chosen_lp, rank)
        for tid, item in entry.items():
            item.decoded_token = self.tokenizer.decode([tid])
        return entry

    def _record_logprobs(self, seq: _Sequence, token: int, lp: tuple) -> None:
        seq.logprobs.append(self._logprob_entry(token, lp))
        seq.cumulative_logprob += lp[0]

    def _record_prompt_logprobs(self, group: _Group, chunk: PromptLogprobsChunk) -> None:
        """Append a chunk's scores; positions already recorded (a recomputed prompt, a sibling) are skipped."""
        have = len(group.prompt_logprobs) - 1
        ids = group.prompt_token_ids
        for pos in range(max(have, chunk.start), chunk.start + len(chunk.entries)):
            group.prompt_logprobs.append(self._logprob_entry(ids[pos + 1], chunk.entries[pos - chunk.start]))

    def _make_delta(self, group: _Group, seq: _Sequence) -> RequestOutput:
        """`_make_output` for an unfinished delta request of one sequence (a stream's every step)."""
        req = seq.request
        text, sent = seq.detokenizer.output_text, seq.sent_tokens
        ids = req.all_token_ids
        tokens = ids[len(group.prompt_token_ids) + sent:]
        lps = seq.logprobs
        out = CompletionOutput(req.index, text[seq.sent_text:], tokens, seq.cumulative_logprob,
                               None if lps is None else lps[sent:], None, req.stop_reason)
        seq.sent_tokens, seq.sent_text = sent + len(tokens), len(text)
        prompt_lps = group.prompt_logprobs
        if prompt_lps is not None:
            prompt_lps, group.sent_prompt_logprobs = None if group.sent_prompt_logprobs else prompt_lps, True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, [out], False,
                             max(req.num_cached_tokens, 0), group.metrics, prompt_lps)

    def _make_output(self, group: _Group) -> RequestOutput:
        delta = group.output_kind is OutputKind.DELTA
        outs = []
        num_prompt = len(group.prompt_token_ids)
        for seq in group.seqs:
            req = seq.request
            text = seq.detokenizer.output_text
            lps = seq.logprobs
            if delta:
                tokens, text = req.all_token_ids[num_prompt + seq.sent_tokens:], text[seq.sent_text:]
                lps = None if lps is None else lps[seq.sent_tokens:]
                seq.sent_tokens += len(tokens)
                seq.sent_text += len(text)
            else:
                tokens = req.all_token_ids[num_prompt:]
                lps = None if lps is None else list(lps)
            outs.append(CompletionOutput(req.index, text, tokens, seq.cumulative_logprob, lps, seq.finish_reason,
                                         req.stop_reason))
        first = group.seqs[0].request
        cached = max(first.num_cached_tokens, 0)
        prompt_lps = group.prompt_logprobs
        if delta and prompt_lps is not None:
            prompt_lps, group.sent_prompt_logprobs = None if group.sent_prompt_logprobs else prompt_lps, True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, group.finished, cached,
                             group.metrics, prompt_lps)
