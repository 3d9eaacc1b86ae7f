"""Disaggregated serving, orchestrated from the ingress: a request's prompt runs on a prefill replica
(which samples the first token and holds the prompt's KV), the first token goes to the client at once,
and a decode replica chosen by load fetches the KV by ticket and continues as if it had computed the
prompt. The prefill side frees the blocks when the ingress confirms the hand-off (the decode replica
accepted the request, which it does only after the fetch), or when its lease expires."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from router.registry import known_replica_ids
from serving.engine_client import EngineClient, EngineError, RequestStream, awaited, call
from workers.messages import GenerateRequest
from workers.outputs import RequestOutput

logger = logging.getLogger(__name__)
CONFIRM_TIMEOUT_S = 10.0


class HandoffStream:
    """One request's deltas across the hand-off: the prefill replica's first token, then the decode
    replica's tokens. Same interface as `RequestStream` (async iteration, `close()`)."""

    def __init__(self, client: DisaggregatedClient, request: GenerateRequest, prefill: RequestStream) -> None:
        self.request = request
        self._client, self._prefill = client, prefill
        self._decode: RequestStream | None = None
        self._it = self._run()

    def __aiter__(self) -> HandoffStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._it.__anext__()

    def close(self) -> None:
        self._prefill.close()
        if self._decode is not None:
            self._decode.close()

    async def _run(self):
        req, params = self.request, self.request.params
        first = None
        async for out in self._prefill:
            first = out
        if first is None:
            raise EngineError("the prefill replica ended the request without output")
        ticket, prefill_replica = self._prefill.kv_ticket, self._prefill.replica_id
        c = first.outputs[0]
        first.request_id = req.request_id
        done = (params.max_tokens == 1 or c.finish_reason == "abort"
                or (c.finish_reason == "stop" and params.min_tokens <= 1))
        if done or ticket is None:
            if ticket is not None:
                self._client.confirm(prefill_replica, ticket.meta.request_id)
            if not done:
                raise EngineError("the prefill replica finished the prompt without a KV ticket", 500, "internal_error")
            yield first
            return
        first.finished, c.finish_reason, c.stop_reason = False, None, None
        first.metrics = {}
        yield first
        rest = dataclasses.replace(params, max_tokens=None if params.max_tokens is None else params.max_tokens - 1,
                                   min_tokens=max(0, params.min_tokens - 1), prompt_logprobs=None)  # sent already
        decode_req = GenerateRequest(req.request_id, req.prompt_token_ids + list(c.token_ids), rest, req.priority,
                                     kv_ticket=ticket, stream=req.stream)
        self._decode = await self._client.decode.submit(decode_req)
        self._client.confirm(prefill_replica, ticket.meta.request_id)
        async for out in self._decode:
            yield out


class DisaggregatedClient:
    """`submit` like `EngineClient.submit`, over a prefill pool and a decode pool. Requests with n > 1
    run whole on the decode pool (their siblings share the prompt's blocks there), and so do requests
with structured outputs (their grammar must see every output token, the first one included)."""

    def __init__(self, prefill: EngineClient, decode: EngineClient, prefill_handle) -> None:
        self.prefill, self.decode = prefill, decode
        self._prefill_handle = prefill_handle
        self._confirms: set[asyncio.Task] = set()

    async def submit(self, request: GenerateRequest) -> RequestStream | HandoffStream:
        if request.params.n != 1 or request.params.structured_outputs is not None:
            return await self.decode.submit(request)
        first_only = dataclasses.replace(request.params, max_tokens=1, min_tokens=0)
        prefill_req = dataclasses.replace(request, request_id=f"{request.request_id}/prefill", params=first_only,
                                          hold_kv=True)
        return HandoffStream(self, request, await self.prefill.submit(prefill_req))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def confirm(self, replica_id: str, request_id: str) -> None:
        """Tell the prefill replica its held KV has been taken (fire and forget; the lease is the backstop).
        Skipped for a replica that has left the router's set (dead or stopping): a call pinned to it could
        never be routed and would hold one of the router's few routing tasks."""
        known = known_replica_ids(self.prefill.deployment)
        if known is not None and replica_id not in known:
            return
        task = asyncio.create_task(self._confirm(replica_id, request_id))
        self._confirms.add(task)
        task.add_done_callback(self._confirms.discard)

    async def _confirm(self, replica_id: str, request_id: str) -> None:
        response = call(self._prefill_handle.release_kv, request_id, replica_id=replica_id)
        try:
            await asyncio.wait_for(awaited(response), CONFIRM_TIMEOUT_S)
        except Exception as e:  # the lease frees the blocks
            response.cancel()
            logger.warning("could not confirm the KV hand-off of %s to prefill replica %s: %r", request_id,
                           replica_id, e)
