"""The Ray Serve application: an OpenAI-compatible FastAPI ingress in front of engine replicas.

`build_app(args)` is the entry point for `serve run serving.app:build_app key=value ...`, for
`deploy/serve_config.yaml` and for `kvrelay serve`."""


import asyncio
import hmac
import importlib.metadata
import logging
import os
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from router.registry import replica_ids
from serving import direct_ingress
from serving.app_config import AppConfig, parse_app_args
from serving.chat import ChatInputError, ChatTemplateOptions, chat_prompt_ids
from serving.disaggregated import DisaggregatedClient
from serving.engine_client import EngineClient, EngineError, LocalEngineClient, RequestStream, awaited, call
from serving.errors import OpenAIError, from_validation_error, install_error_handlers
from serving.metrics import merge_expositions
from serving.openai_format import ResponseView, sse_response
from serving.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                              ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from serving.structured_outputs import structured_outputs_for
from serving.tool_calls import tool_plan
from workers.messages import GenerateRequest, ModelInfo
from workers.model_loader import load_tokenizer, resolve_model_path
from workers.sampling_params import SamplingParams

WORKER_DEPLOYMENT = "EngineWorker"
PREFILL_DEPLOYMENT = "PrefillWorker"
DECODE_DEPLOYMENT = "DecodeWorker"
logger = logging.getLogger("ray.serve")

app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None)
install_error_handlers(app)


def _default_model_name(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path))


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIIngress:
    """`worker` None: the engine runs in this replica (`AppConfig.engine_in_ingress`)."""

    def __init__(self, worker: DeploymentHandle | None, config: dict, prefill: DeploymentHandle | None = None) -> None:
        if direct_ingress.enabled():  # before Serve starts this replica's own HTTP server, which follows __init__
            direct_ingress.bind_reusing_address()
        self.config = AppConfig(**config)
        self.model_path = resolve_model_path(self.config.engine.model)
        self.model_names = self.config.served_model_name or [_default_model_name(self.model_path)]
        self.model_name = self.model_names[0]
        self.tokenizer = load_tokenizer(self.model_path)
        self.worker, self.local = worker, None
        if worker is None:
            from workers.deployment import EngineWorker

            self.local = EngineWorker(asdict(self.config.engine), self.config.max_waiting_requests,
                                      max_failed_steps=self.config.max_failed_steps,
                                      drain_timeout_s=self.config.drain_timeout_s)
            self.engine = LocalEngineClient(self.local, self.config.replica_wait_timeout_s, self.config.drain_timeout_s)
            self.workers = {}
        else:
            self.engine = self._engine_client(worker)
            self.workers = {WORKER_DEPLOYMENT: worker}
        if prefill is not None:
            self.engine = DisaggregatedClient(self._engine_client(prefill), self.engine, prefill)
            self.workers = {PREFILL_DEPLOYMENT: prefill, DECODE_DEPLOYMENT: worker}
        self._info: ModelInfo | None = None
        self._api_key = self.config.api_key or os.environ.get("KVRELAY_API_KEY") or None

    def __del__(self) -> None:
        """Serve calls this once the ingress has drained; its subscriber streams end with it, and the engine
        if it runs here."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        local = getattr(self, "local", None)
        if local is not None:
            local.shutdown()

    def startup_times(self) -> dict[str, float]:
        """The engine's start, when it runs in this replica (`EngineWorker.startup_times`)."""
        if self.local is None:
            raise RuntimeError("the engine does not run in the ingress (engine_in_ingress is off)")
        return self.local.startup_times()

    async def check_health(self) -> None:
        """Serve's health check: the engine's, when it runs in this replica."""
        if self.local is not None:
            await self.local.check_health()

    # ---- plumbing ------------------------------------------------------------------------------

    def _engine_client(self, handle: DeploymentHandle) -> EngineClient:
        return EngineClient(handle, self.config.replica_wait_timeout_s, self.config.drain_timeout_s)

    async def _model_info(self, refresh: bool = False) -> ModelInfo:
        """The engine's model facts, fetched once; `refresh` asks a replica again (the health check). No
        answer within `replica_wait_timeout_s` is a 503."""
        if self.local is not None:
            if refresh:
                try:
                    await self.local.check_health()
                except Exception as e:
                    raise OpenAIError(503, f"the engine is unhealthy: {e}") from None
            self._info = self._info or self.local.model_info()
            return self._info
        if self._info is None or refresh:
            timeout = self.config.replica_wait_timeout_s
            response = call(self.worker.model_info)
            try:
                self._info = await asyncio.wait_for(awaited(response), timeout)
            except asyncio.TimeoutError:
                response.cancel()
                raise OpenAIError(503, f"no engine replica answered within {timeout:g} s (replica_wait_timeout_s); "
                                       "none is ready yet, or all are being replaced") from None
            except Exception as e:
                raise OpenAIError(503, f"the engine replica failed: {type(e).__name__}") from None
        return self._info

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise OpenAIError(401, "invalid API key", code="invalid_api_key")

    async def _parse(self, request: Request, model: type):
        self._authorize(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise OpenAIError(415, f"content type must be application/json, got {ctype or 'none'!r}",
                              code="unsupported_media_type")
        limit = self.config.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body of {int(declared):,} bytes exceeds the limit of {limit:,} bytes",
                              code="request_too_large")
        body = await request.body()
        if len(body) > limit:
            raise OpenAIError(413, f"request body of {len(body):,} bytes exceeds the limit of {limit:,} bytes",
                              code="request_too_large")
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        if parsed.model is not None and parsed.model not in self.model_names:
            raise OpenAIError(404, f"the model {parsed.model!r} does not exist; this server serves "
                                   f"{', '.join(map(repr, self.model_names))}", param="model", code="model_not_found")
        return parsed

    def _chat_ids(self, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None = None) -> list[int]:
        """The prompt of a chat request: its messages through the chat template, with vLLM's options;
        `tools` (as the template sees them) in place of the body's."""
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise OpenAIError(400, "this server does not accept a chat_template in requests; start it with "
                                   "--trust-request-chat-template to allow that", param="chat_template")
        options = ChatTemplateOptions(
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            chat_template=body.chat_template or self.config.chat_template,
            chat_template_kwargs={**self.config.default_chat_template_kwargs, **(body.chat_template_kwargs or {})},
            tools=body.tools if tools is None else tools, documents=body.documents,
            add_special_tokens=bool(body.add_special_tokens))
        try:
            return chat_prompt_ids(self.tokenizer, [m.model_dump(exclude_none=True) for m in body.messages], options)
        except ChatInputError as e:
            raise OpenAIError(400, str(e), param=e.param) from None

    def _check_prompt(self, ids: list[int], max_tokens: int | None, info: ModelInfo) -> None:
        if not ids:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        if any(t < 0 or t >= info.vocab_size for t in ids):
            raise OpenAIError(400, f"prompt token ids must be in [0, {info.vocab_size})", param="prompt")
        if len(ids) >= info.max_model_len:
            raise OpenAIError(400, f"this model's maximum context length is {info.max_model_len:,} tokens; "
                                   f"the prompt has {len(ids):,} tokens", param="prompt", code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > info.max_model_len:
            raise OpenAIError(400, f"this model's maximum context length is {info.max_model_len:,} tokens; you "
                                   f"requested {len(ids) + max_tokens:,} tokens ({len(ids):,} in the prompt, "
                                   f"{max_tokens:,} for the completion)", param="max_tokens",
                              code="context_length_exceeded")

    def _check_fan_out(self, num_prompts: int, n: int) -> None:
        limit = self.config.max_prompts_per_request
        if num_prompts > limit:
            raise OpenAIError(400, f"prompt is a list of {num_prompts:,} prompts; at most {limit:,} are allowed per "
                                   "request (max_prompts_per_request); send them in several requests", param="prompt")
        limit = self.config.max_sequences_per_request
        if num_prompts * n > limit:
            raise OpenAIError(400, f"{num_prompts:,} prompt(s) with n={n} make {num_prompts * n:,} sequences; at most "
                                   f"{limit:,} are allowed per request (max_sequences_per_request); lower n or send "
                                   "fewer prompts", param="n")

    @staticmethod
    def _sampling_params(body, max_tokens: int | None, logprobs: int | None, info: ModelInfo,
                         prompt_logprobs: int | None = None, plan=None) -> SamplingParams:
        bias = {int(t): b for t, b in (body.logit_bias or {}).items()}
        if any(t >= info.vocab_size for t in bias):
            raise OpenAIError(400, f"logit_bias token ids must be in [0, {info.vocab_size})", param="logit_bias")
        structured = structured_outputs_for(body, plan)
        try:
            return SamplingParams(
                n=body.n, max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k is None else body.top_k,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                logprobs=logprobs, min_tokens=body.min_tokens, presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0, min_p=body.min_p or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=bias or None, bad_words=body.bad_words,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
                prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                structured_outputs=structured)
        except ValueError as e:
            field = str(e).split(" ", 1)[0].split("[")[0]  # SamplingParams' messages start with the field
            raise OpenAIError(400, str(e), param=field if field in type(body).model_fields else None) from None

    async def _submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                      priority: int, stream: bool) -> list[RequestStream]:
        """One engine request per prompt. An unstreamed one (`stream` False) comes back as a single output at
        its end, so the engine sends nothing, and the ingress wakes for nothing, while it runs."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.submit(GenerateRequest(rid, ids, params, priority, stream=stream)))
        except EngineError as e:
            for s in streams:
                s.close()
            raise OpenAIError.from_engine(e) from None
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    # ---- routes --------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        """200 once an engine replica answers; 503 (with an error body) while none does."""
        await self._model_info(refresh=True)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._authorize(request)
        info = await self._model_info()
        return ModelList(data=[ModelCard(id=name, root=info.model_path, max_model_len=info.max_model_len)
                               for name in self.model_names])

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": importlib.metadata.version("kvrelay")}

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await self._parse(request, TokenizeRequest)
        info = await self._model_info()
        if body.messages is not None:
            ids = self._chat_ids(body)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.tokenizer(body.prompt, add_special_tokens=add_special).input_ids
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> DetokenizeResponse:
        body = await self._parse(request, DetokenizeRequest)
        info = await self._model_info()
        if any(t >= info.vocab_size for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {info.vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    @app.get("/metrics")
    async def metrics(self) -> Response:
        if self.local is not None:
            return Response(merge_expositions([self.local.metrics_text()[1]]),
                            media_type="text/plain; version=0.0.4; charset=utf-8")
        calls = []
        for name, handle in self.workers.items():
            ids = replica_ids(name)
            calls += [call(handle.metrics_text, replica_id=rid) for rid in ids] or [call(handle.metrics_text)]
        results = await asyncio.gather(*(asyncio.wait_for(awaited(c), 10.0) for c in calls), return_exceptions=True)
        texts = [r[1] for r in results if isinstance(r, tuple)]
        for r in results:
            if not isinstance(r, tuple):
                logger.warning("could not scrape an engine replica: %r", r)
        return Response(merge_expositions(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        info = await self._model_info()
        prompts = self._completion_prompts(body.prompt, body.n)
        echo_only = body.echo and body.max_tokens == 0  # score the prompt: generate one token, show none
        max_tokens = 1 if echo_only else body.max_tokens
        for ids in prompts:
            self._check_prompt(ids, max_tokens, info)
        echo_lp = body.logprobs if body.echo and body.prompt_logprobs is None else None
        params = self._sampling_params(body, max_tokens, body.logprobs, info, echo_lp)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(request_id, prompts, params, body.priority, body.stream)
        view = ResponseView(request_id, self.model_name, body.n, [len(p) for p in prompts], chat=False, logprobs=body.logprobs)
        if body.echo:
            view.echo([self._prompt_text(body.prompt, i, ids) for i, ids in enumerate(prompts)], prompts, echo_only,
                      self.tokenizer.decode)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return sse_response(view.stream(streams, include_usage))
        return JSONResponse((await view.collect(streams)).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body = await self._parse(request, ChatCompletionRequest)
        self._check_fan_out(1, body.n)
        plan = tool_plan(body, self.config.enable_auto_tool_choice, self.config.tool_call_parser)
        info = await self._model_info()
        ids = self._chat_ids(body, plan.tools or None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        self._check_prompt(ids, max_tokens, info)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, k, info, plan=plan)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._submit(request_id, [ids], params, body.priority, body.stream)
        view = ResponseView(request_id, self.model_name, body.n, [len(ids)], chat=True, logprobs=k, tools=plan)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return sse_response(view.stream(streams, include_usage))
        return JSONResponse((await view.collect(streams)).model_dump())

    def _prompt_text(self, prompt, i: int, ids: list[int]) -> str:
        """The `i`-th prompt as text, for echo: as sent, or decoded from its token ids."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and isinstance(prompt[i], str):
            return prompt[i]
        return self.tokenizer.decode(ids)

    def _completion_prompts(self, prompt, n: int) -> list[list[int]]:
        """The prompts' token ids, once their number is checked (before any is tokenized)."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        self._check_fan_out(len(items), n)
        return [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in items]


def build_app(args: dict[str, Any] | AppConfig | None = None):
    """The Serve application for `serve run serving.app:build_app model=... max_num_seqs=64 ...`:
    engine options by their `EngineConfig` names, serving options by their `AppConfig` names; or for an
    `AppConfig` already parsed (`kvrelay serve`)."""
    config = args if isinstance(args, AppConfig) else parse_app_args(args or {})
    from workers.deployment import worker_deployment

    ingress = OpenAIIngress.options(**config.ingress_deployment_options())
    if config.engine_runs_in_ingress:
        return ingress.bind(None, config.model_dump(mode="python"))
    if not config.disaggregate:
        worker = worker_deployment(WORKER_DEPLOYMENT).options(**config.worker_deployment_options()).bind(
            asdict(config.engine), config.max_waiting_requests, max_failed_steps=config.max_failed_steps,
            drain_timeout_s=config.drain_timeout_s)
        return ingress.bind(worker, config.model_dump(mode="python"))
    pools = {}
    for pool, name in (("prefill", PREFILL_DEPLOYMENT), ("decode", DECODE_DEPLOYMENT)):
        pools[pool] = worker_deployment(name).options(**config.pool_deployment_options(pool)).bind(
            asdict(config.pool_engine(pool)), config.max_waiting_requests, pool, config.kv_transport, config.kv_lease_s,
            config.kv_fetch_delay_s, max_failed_steps=config.max_failed_steps, drain_timeout_s=config.drain_timeout_s)
    return ingress.bind(pools["decode"], config.model_dump(mode="python"), pools["prefill"])
