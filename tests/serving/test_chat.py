"""Chat messages to prompts as vLLM builds them, with the default model's real tokenizer: content parts
flattened, message keys and template options reaching the template, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from serving import LLM, SamplingParams
from serving.chat import ChatInputError, ChatTemplateOptions, chat_prompt_ids, load_chat_template, render_chat

# Renders what the template receives, so tests can read it back.
ECHO_TEMPLATE = ("{{ {'messages': messages, 'tools': tools, 'documents': documents, 'mood': mood, "
                 "'generation_prompt': add_generation_prompt} | tojson }}")


def echo(tokenizer, messages, **options) -> dict:
    kwargs = options.pop("chat_template_kwargs", {})
    opts = ChatTemplateOptions(chat_template=ECHO_TEMPLATE, chat_template_kwargs={"mood": None, **kwargs}, **options)
    return json.loads(render_chat(tokenizer, messages, opts))


def test_text_parts_are_joined_by_newlines_like_one_string(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}, "Be brief.",
                                          {"type": "input_text", "text": "Yellow."}]}]
    joined = [{"role": "user", "content": "Name a fruit.\nBe brief.\nYellow."}]
    assert chat_prompt_ids(tokenizer, parts) == chat_prompt_ids(tokenizer, joined)
    expected = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_prompt_ids(tokenizer, joined) == list(expected)  # the tokenizer's own rendering
    assert echo(tokenizer, [{"role": "user", "content": None}])["messages"][0]["content"] == ""


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "messages.0.content.1.type", "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages.0.content.1.type", "input_audio"),
    ({"text": "no type"}, "messages.0.content.1.type", "type"),
    ({"type": "text", "text": 5}, "messages.0.content.1.text", "string"),
    (7, "messages.0.content.1", "content part"),
])
def test_other_content_parts_are_refused_naming_the_field(tokenizer, part, param, words):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(ChatInputError) as e:
        chat_prompt_ids(tokenizer, messages)
    assert e.value.param == param and words in str(e.value)


def test_name_tool_calls_tool_results_and_reasoning_reach_the_template(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?", "name": "ann", "ignored_key": 1},
                {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "use the tool"},
                {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "call_1"}]
    seen = echo(tokenizer, messages)["messages"]
    assert seen[0] == {"role": "user", "content": "Weather?", "name": "ann"}
    assert seen[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}
    assert seen[1]["reasoning"] == "use the tool" and seen[1]["content"] == ""
    assert seen[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the request is not changed


def test_tools_documents_and_template_kwargs_reach_the_template(tokenizer):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    docs = [{"title": "t", "text": "body"}]
    seen = echo(tokenizer, [{"role": "user", "content": "x"}], tools=tools, documents=docs,
                chat_template_kwargs={"mood": "calm"}, add_generation_prompt=False)
    assert seen["tools"] == tools and seen["documents"] == docs and seen["mood"] == "calm"
    assert seen["generation_prompt"] is False
    # vLLM lets chat_template_kwargs override the named options
    assert echo(tokenizer, [{"role": "user", "content": "x"}],
                chat_template_kwargs={"add_generation_prompt": False})["generation_prompt"] is False


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn(tokenizer):
    messages = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
    text = render_chat(tokenizer, messages, ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nOne, two,")
    closed = render_chat(tokenizer, messages, ChatTemplateOptions(add_generation_prompt=False))
    assert closed.endswith("One, two,<|im_end|>\n")
    with pytest.raises(ChatInputError) as e:
        render_chat(tokenizer, messages, ChatTemplateOptions(continue_final_message=True))
    assert e.value.param == "continue_final_message" and "add_generation_prompt" in str(e.value)


@pytest.mark.parametrize("key", ["tokenize", "chat_template"])
def test_template_kwargs_that_would_change_rendering_are_refused(tokenizer, key):
    with pytest.raises(ChatInputError) as e:
        render_chat(tokenizer, [{"role": "user", "content": "x"}], ChatTemplateOptions(chat_template_kwargs={key: "x"}))
    assert e.value.param == f"chat_template_kwargs.{key}"


def test_template_errors_and_bad_messages_are_chat_input_errors(tokenizer):
    broken = ChatTemplateOptions(chat_template="{{ raise_exception('no system messages here') }}")
    with pytest.raises(ChatInputError, match="no system messages here") as e:
        render_chat(tokenizer, [{"role": "user", "content": "x"}], broken)
    assert e.value.param == "chat_template"
    with pytest.raises(ChatInputError) as e:
        render_chat(tokenizer, [{"content": "x"}], ChatTemplateOptions())
    assert e.value.param == "messages.0.role"
    with pytest.raises(ChatInputError, match="empty"):
        render_chat(tokenizer, [], ChatTemplateOptions())


def test_add_special_tokens_tokenizes_the_rendered_text_with_them(tokenizer):
    messages = [{"role": "user", "content": "x"}]
    text = render_chat(tokenizer, messages, ChatTemplateOptions())
    assert chat_prompt_ids(tokenizer, messages, ChatTemplateOptions(add_special_tokens=True)) == \
        tokenizer(text, add_special_tokens=True).input_ids
    assert chat_prompt_ids(tokenizer, messages) == tokenizer(text, add_special_tokens=False).input_ids


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_offline_chat_takes_the_template_options(tiny_model_dir, tmp_path):
    llm = LLM(tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids = llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(ids).endswith("assistant\nHello")
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ suffix }}\n{% endfor %}")
    ids = llm.apply_chat_template(messages, chat_template=str(path), chat_template_kwargs={"suffix": "!"})
    assert llm.tokenizer.decode(ids) == "user: Hi!\nassistant: Hello!\n"
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0), add_generation_prompt=False,
                   continue_final_message=True)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(messages, continue_final_message=True)
