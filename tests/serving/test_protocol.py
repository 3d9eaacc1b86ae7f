"""Request models refuse what the OpenAI API refuses, with a usable message; errors render OpenAI-style."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from serving.app_config import AppConfig, parse_app_args
from serving.engine_client import EngineError
from serving.errors import OpenAIError, from_validation_error
from serving.metrics import merge_expositions
from serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


def parse(model, body: dict):
    return model.model_validate_json(json.dumps(body))


def error_for(model, body) -> dict:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(raw)
    err = from_validation_error(e.value)
    assert err.status == 400
    return err.body().model_dump()["error"]


def test_valid_requests_parse():
    r = parse(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]], "temperature": 0, "n": 2, "stop": "x"})
    assert r.prompt == [[1, 2], [3]] and r.temperature == 0.0 and r.max_tokens == 16
    c = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "logprobs": True, "top_logprobs": 3, "stream": True,
                                      "stream_options": {"include_usage": True}})
    assert c.max_tokens is None and c.top_logprobs == 3 and c.stream_options.include_usage


def test_vllm_sampling_fields_parse():
    r = parse(CompletionRequest, {"model": "m", "prompt": [[1, 2]], "echo": True, "max_tokens": 0, "logprobs": 20,
                                  "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.2,
                                  "min_p": 0.1, "logit_bias": {"50256": -100, "7": 3}, "bad_words": ["x y"],
                                  "include_stop_str_in_output": True, "skip_special_tokens": False,
                                  "spaces_between_special_tokens": False, "prompt_logprobs": 0})
    assert r.echo and r.max_tokens == 0 and r.logit_bias == {"50256": -100.0, "7": 3.0} and r.prompt_logprobs == 0
    c = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "presence_penalty": 1.5, "bad_words": ["no"], "prompt_logprobs": 2})
    assert c.presence_penalty == 1.5 and c.bad_words == ["no"]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": True}, "n"),
    ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "logit_bias": {"12": 101}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"twelve": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "bad_words": [""]}, "bad_words"),
    ({"model": "m", "prompt": "x", "bad_words": "word"}, "bad_words"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"model": "m", "prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "suffix": "!"}, "suffix"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "stop"),
])
def test_bad_values_name_the_field(body, param):
    err = error_for(CompletionRequest, body)
    assert err["param"].startswith(param) and param in err["message"]


@pytest.mark.parametrize("model, extra, param", [
    (CompletionRequest, {"seed": 2**64}, "seed"),
    (CompletionRequest, {"seed": -2**63 - 1}, "seed"),
    (CompletionRequest, {"top_k": 2**63}, "top_k"),
    (CompletionRequest, {"priority": 2**63}, "priority"),
    (CompletionRequest, {"min_tokens": 2**63}, "min_tokens"),
    (CompletionRequest, {"max_tokens": 2**63}, "max_tokens"),
    (CompletionRequest, {"logprobs": 21}, "logprobs"),
    (CompletionRequest, {"stop_token_ids": [3, 2**63]}, "stop_token_ids"),
    (CompletionRequest, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (CompletionRequest, {"stop": ""}, "stop"),
    (CompletionRequest, {"stop": "x" * 1025}, "stop"),
    (ChatCompletionRequest, {"max_completion_tokens": 2**63}, "max_completion_tokens"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (ChatCompletionRequest, {"seed": 2**64}, "seed"),
])
def test_numbers_the_engine_cannot_hold_are_refused(model, extra, param):
    base = {"model": "m", "prompt": "x"} if model is CompletionRequest else \
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    err = error_for(model, base | extra)
    assert err["param"].startswith(param) and param in err["message"] and err["code"] == "invalid_value"


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_floats_must_be_finite(raw, field):
    err = error_for(CompletionRequest, f'{{"model": "m", "prompt": "x", "{field}": {raw}}}')
    assert err["param"] == field


def test_int64_edges_and_one_stop_string_parse():
    r = parse(CompletionRequest, {"model": "m", "prompt": "x", "seed": 2**63 - 1, "top_k": 2**63 - 1,
                                  "priority": -2**63, "stop": "end"})
    assert r.seed == 2**63 - 1 and r.top_k == 2**63 - 1 and r.priority == -2**63 and r.stop == ["end"]
    assert parse(CompletionRequest, {"model": "m", "prompt": "x", "seed": -2**63}).seed == -2**63


def test_unknown_fields_are_ignored_as_vllm_ignores_them_but_known_ones_stay_strict():
    r = parse(CompletionRequest, {"model": "m", "prompt": "x", "best_of_three": 1, "repetition_penalty": 1.0})
    assert "best_of_three" not in r.model_dump()
    c = parse(ChatCompletionRequest, {"model": "m", "frobnicate": {"a": 1}, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                                      "messages": [{"role": "user", "content": "x", "annotations": []}]})
    assert c.stream_options.include_usage and c.messages[0].content == "x"
    err = error_for(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                            "frobnicate": 1, "add_generation_prompt": "yes"})
    assert err["param"] == "add_generation_prompt" and err["code"] == "invalid_value"


def test_missing_field_and_bad_json():
    err = error_for(CompletionRequest, {"model": "m"})
    assert err["code"] == "missing_required_parameter" and err["param"] == "prompt"
    err = error_for(CompletionRequest, '{"model": ')
    assert err["code"] == "invalid_json"


def test_chat_rules():
    assert "messages" in error_for(ChatCompletionRequest, {"model": "m", "messages": []})["param"]
    err = error_for(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert "logprobs" in err["message"]
    err = error_for(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                            "stream_options": {"include_usage": True}})
    assert "stream" in err["message"]


def test_chat_template_options():
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    c = parse(ChatCompletionRequest, {**chat, "add_generation_prompt": False, "continue_final_message": True,
                                      "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "d"}],
                                      "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert c.continue_final_message and c.chat_template_kwargs == {"enable_thinking": False}
    err = error_for(ChatCompletionRequest, {**chat, "continue_final_message": True})
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]
    assert error_for(ChatCompletionRequest, {**chat, "chat_template_kwargs": "x"})["param"] == "chat_template_kwargs"
    err = error_for(ChatCompletionRequest, {**chat, "messages": [{"role": "assistant", "tool_calls": {"id": 1}}]})
    assert err["param"].startswith("messages.0.tool_calls")


def test_tokenize_requests_take_a_prompt_or_messages():
    t = parse(TokenizeRequest, {"model": "m", "prompt": "x", "add_special_tokens": False})
    assert t.prompt == "x" and t.add_special_tokens is False and not t.return_token_strs
    t = parse(TokenizeRequest, {"messages": [{"role": "user", "content": "x"}], "return_token_strs": True})
    assert t.model is None and t.add_generation_prompt and t.add_special_tokens is None
    for body in ({"model": "m"}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        assert "prompt or messages" in error_for(TokenizeRequest, body)["message"]
    assert error_for(DetokenizeRequest, {"tokens": [1, -2]})["param"] == "tokens.1"


def test_serving_options_for_names_and_chat_templates(tmp_path):
    assert parse_app_args({"served_model_name": "a"}).served_model_name == ["a"]
    assert AppConfig(served_model_name=["a", "b"]).served_model_name == ["a", "b"]
    with pytest.raises(ValueError, match="served_model_name"):
        AppConfig(served_model_name=[])
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages | length }}")
    cfg = parse_app_args({"chat_template": str(path), "default_chat_template_kwargs": '{"enable_thinking": false}'})
    assert cfg.chat_template == "{{ messages | length }}"  # the text travels to the ingress, not the path
    assert cfg.default_chat_template_kwargs == {"enable_thinking": False}
    assert AppConfig(**cfg.model_dump()).chat_template == cfg.chat_template
    with pytest.raises(ValueError, match="looks like a file path"):
        parse_app_args({"chat_template": str(tmp_path / "missing.jinja")})


def test_busy_engine_error_becomes_429_with_retry_after():
    busy = OpenAIError.from_engine(EngineError("the server is busy", 429, "server_overloaded", retry_after=1))
    response = busy.response()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"] == {"message": "the server is busy", "type": "server_overloaded",
                                                  "param": None, "code": None}
    assert "retry-after" not in OpenAIError(400, "bad").response().headers


def test_app_args_from_strings():
    cfg = parse_app_args({"max_num_seqs": "64", "enable_prefix_caching": "false", "max_replicas": "3",
                          "api_key": "k", "num_kv_blocks": "none"})
    assert cfg.engine.max_num_seqs == 64 and cfg.engine.enable_prefix_caching is False
    assert cfg.engine.num_kv_blocks is None and cfg.api_key == "k"
    opts = cfg.worker_deployment_options()
    assert opts["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in opts
    assert AppConfig(num_replicas=2).worker_deployment_options()["num_replicas"] == 2
    with pytest.raises(ValueError, match="unknown option.*max_num_seq"):
        parse_app_args({"max_num_seq": "64"})
    with pytest.raises(ValueError, match="max_replicas"):
        parse_app_args({"min_replicas": "3", "max_replicas": "2"})
    with pytest.raises(ValueError, match="scheduling_policy"):
        parse_app_args({"scheduling_policy": "random"})


def test_replica_call_cap_leaves_room_for_every_admitted_sequence():
    assert AppConfig().worker_deployment_options()["max_ongoing_requests"] == 256 + 1024 + 64
    cfg = parse_app_args({"max_num_seqs": "8", "max_waiting_requests": "0"})
    assert cfg.worker_deployment_options()["max_ongoing_requests"] == 8 + 0 + 64
    assert AppConfig(max_ongoing_requests=5).worker_deployment_options()["max_ongoing_requests"] == 5
    pools = AppConfig(disaggregate=True, decode_engine={"max_num_seqs": 512})
    assert pools.pool_deployment_options("decode")["max_ongoing_requests"] == 512 + 1024 + 64


def test_merge_expositions_keeps_one_header_per_family():
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    texts = []
    for replica, value in (("a", 3), ("b", 4)):
        reg = CollectorRegistry()
        Counter("kvrelay:generation_tokens", "doc", ["replica"], registry=reg).labels(replica).inc(value)
        texts.append(generate_latest(reg))
    merged = merge_expositions(texts).decode()
    assert merged.count("# TYPE kvrelay:generation_tokens_total counter") == 1
    samples = {s.labels["replica"]: s.value for f in text_string_to_metric_families(merged) for s in f.samples
               if s.name == "kvrelay:generation_tokens_total"}
    assert samples == {"a": 3.0, "b": 4.0}
