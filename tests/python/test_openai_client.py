"""The official `openai` Python client against a running `handoff serve`.

Run: HANDOFF_URL=http://127.0.0.1:30000 python -m pytest tests/python
(the base URL without /v1; the server must already be running).
"""

import os

import openai
import pytest

BASE = os.environ.get("HANDOFF_URL", "http://127.0.0.1:30000").rstrip("/")


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_chat_non_stream(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream(client, model):
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=12,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completions_non_stream_and_stream(client, model):
    kwargs = dict(model=model, prompt="The sky is", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason in ("stop", "length")
    text = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
    )
    assert text == whole.choices[0].text


def test_error_is_400_with_message(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=-5,
        )
    err = info.value
    assert err.status_code == 400
    assert "max_tokens must be at least 1, got -5" in err.message
    assert err.body["code"] == "invalid_value"


def test_n_choices(client, model):
    """`n: 4` returns 4 choices; greedy ones equal a single greedy answer
    (through PD each choice pairs its own room); seeded ones sample on
    their own."""
    msgs = [{"role": "user", "content": "Name a colour."}]
    one = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
    four = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in four.choices] == [one.choices[0].message.content] * 4
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    hot = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10, temperature=1.0, seed=3, n=3
    )
    for i, c in enumerate(hot.choices):
        alone = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=10, temperature=1.0, seed=3 + i
        )
        assert c.message.content == alone.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=2, n=99)
    assert info.value.status_code == 400
    assert "n must be between 1 and 16" in info.value.message


def test_logprobs_with_alternatives(client, model):
    """Chat logprobs with top_logprobs and completions logprobs=N, as the
    client parses them; greedy picks the likeliest alternative, and the
    streamed answer carries the same numbers as the whole one."""
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        lps = [t.logprob for t in tok.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert tok.top_logprobs[0].logprob == tok.logprob
        assert tok.top_logprobs[0].token == tok.token
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(t.token, t.logprob, [a.logprob for a in t.top_logprobs]) for t in streamed] == [
        (t.token, t.logprob, [a.logprob for a in t.top_logprobs]) for t in content
    ]
    c = client.completions.create(
        model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completions_echo_scores_the_prompt(client, model):
    """echo=True with logprobs, as loglikelihood harnesses ask: the prompt
    comes back first, its first token unscored, every later one scored."""
    c = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
        echo=True, logprobs=1,
    )
    choice = c.choices[0]
    assert choice.text.startswith("The capital of France is")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == c.usage.prompt_tokens + c.usage.completion_tokens


def test_parse_with_a_pydantic_model_always_validates(client, model):
    """`chat.completions.parse` sends the model's JSON schema (strict) and
    validates each answer with pydantic: 20 seeds at temperature 1."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=20)
        species: Literal["cat", "dog", "fish"]
        age: int = Field(ge=0, le=30)
        vaccinated: bool

    seen = set()
    for seed in range(20):
        r = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": f"Invent pet number {seed} as JSON."}],
            response_format=Pet,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        pet = choice.message.parsed
        assert isinstance(pet, Pet), choice.message.content
        assert Pet.model_validate_json(choice.message.content) == pet
        seen.add(choice.message.content)
    assert len(seen) >= 10, seen


def test_a_bad_schema_is_a_400_naming_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
            max_tokens=4,
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == "response_format"
    assert "nonsense" in e.value.body["message"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_tool_calling_flow(client, model):
    """Call → tool message → answer, as an agent framework drives it; the
    named function's arguments always validate (10 seeds, temperature 1)."""
    import json
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class WeatherArgs(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=30)
        unit: Literal["celsius", "fahrenheit"]

    question = {"role": "user", "content": "What is the weather like in Paris today?"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(10):
        r = client.chat.completions.create(
            model=model,
            messages=[question],
            tools=[WEATHER_TOOL],
            tool_choice=named,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        WeatherArgs.model_validate(json.loads(call.function.arguments))

    # The last call's answer goes back; the model answers in text.
    r2 = client.chat.completions.create(
        model=model,
        messages=[
            question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees celsius and sunny"},
        ],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=40,
    )
    answer = r2.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_streamed_tool_call(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            calls.extend(d.tool_calls or [])
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    import json

    assert set(json.loads(calls[0].function.arguments)) == {"city", "unit"}
