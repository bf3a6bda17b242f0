"""The OpenAI API as a user's official client sees it, against a live `kvledger serve` (SmolLM2).

Outputs are short and greedy unless a test is about sampling; every comparison is between two answers
of the same server, so the tests hold whatever the model says.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

pytestmark = pytest.mark.model


def unique(text: str) -> str:
    """A prompt no earlier test has cached."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def test_models_and_health(server) -> None:
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    assert httpx.get(f"{server.url}/health", trust_env=False).json() == {"status": "ok"}


def test_completion_streaming_equals_non_streaming(server) -> None:
    client = server.client()
    prompt = unique("The three primary colors are")
    full = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0)
    assert full.object == "text_completion"
    assert len(full.choices) == 1 and full.choices[0].text
    assert full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_equals_non_streaming(server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": unique("Name one planet.")}]
    full = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=10, temperature=0)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    # The chat template wraps the message: far more prompt tokens than the message's own words.
    assert full.usage.prompt_tokens > 20
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_stops_at_end_of_turn(server) -> None:
    """Without a length limit the model ends its turn itself: finish_reason stop, no special token text."""
    client = server.client()
    out = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=200,
                                         messages=[{"role": "user", "content": "Reply with just: OK"}])
    assert out.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in out.choices[0].message.content


def test_n2_with_seed_is_deterministic(server) -> None:
    client = server.client()
    kw = dict(model="smollm2-135m", prompt=unique("Once upon a time"), max_tokens=8, temperature=1.0, n=2,
              seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 16  # both choices, at most max_tokens each
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in a.choices]
    other = client.completions.create(**{**kw, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_stop_strings_cut_the_text(server) -> None:
    client = server.client()
    prompt = unique("Count: one, two, three, four, five, six,")
    free = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert free.usage.completion_tokens == 16  # ignore_eos: exactly max_tokens
    text = free.choices[0].text
    assert len(text) > 6
    stop = text[3:6]  # a few characters from inside the greedy answer
    cut = text[:text.index(stop)]
    stopped = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0,
                                        stop=[stop, "never-appears-here"], extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 16
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut


def test_cached_tokens_on_a_repeated_prefix(server) -> None:
    client = server.client()
    prompt = unique("In the beginning " + "the quick brown fox jumps over the lazy dog " * 12)
    first = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0)
    plen = first.usage.prompt_tokens
    assert plen > 3 * server.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0)
    # Every full block of the prompt was retained; the last prompt token is always computed again.
    expected = min((plen // server.block_size) * server.block_size, plen - 1)
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert second.choices[0].text == first.choices[0].text


def test_unknown_key_is_401(server) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(key="sk-not-a-key").completions.create(model="smollm2-135m", prompt="hi", max_tokens=1)
    assert err.value.status_code == 401
    assert httpx.post(f"{server.v1}/completions", json={"prompt": "hi"}, trust_env=False).status_code == 401


def test_never_fitting_requests_are_400_with_the_reason(server) -> None:
    client = server.client()
    # Longer than the model length the pool allows (160 blocks x 16 tokens).
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=server.pool_blocks * 16)
    assert "maximum context length" in err.value.message
    # Fits the length, but two samples of it never fit the pool.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2000, n=2)
    assert "pool is too small" in err.value.message
    for word in ("free", "active", "retained", "promised", "acme", "globex"):
        assert word not in err.value.message  # the reason names the request, never the pool's state
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=4, logprobs=21)
    assert "logprobs" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=4, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)


def test_token_id_prompts_and_batches(server) -> None:
    client = server.client()
    ids = client.completions.create(model="smollm2-135m", prompt=[504, 3575, 282, 4649, 314], max_tokens=4,
                                    temperature=0)
    text = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                                     temperature=0)
    assert ids.choices[0].text == text.choices[0].text
    batch = client.completions.create(model="smollm2-135m", prompt=["The capital of France is", "Hello"],
                                      max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text.choices[0].text  # greedy: n copies
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2-135m", prompt=[10**9], max_tokens=1)
