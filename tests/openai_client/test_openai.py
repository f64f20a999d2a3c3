#!/usr/bin/env python3
"""`k3ring serve` with the real `openai` Python client (issue 17).

Starts the server on the tiny model (loopback, a free port, an API key), then uses the client as
an application would: completions and chat completions, streamed and not. The tokens must equal
a solo `k3ring run` with the same settings. Errors must arrive as the client's typed exceptions.

Usage: python3 tests/openai_client/test_openai.py [PATH_TO_K3RING]  (default target/release/k3ring)
Prints one line per check and closes with "N passed, N failed"; exits 1 on any failure.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import openai
from openai import OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "release", "k3ring")
MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "tiny-k3")
MODEL = "tiny-k3"
KEY = "test-key-17"


def start_server():
    """The server and its address, read from its stderr (30 s at most)."""
    proc = subprocess.Popen(
        [BIN, "serve", "--model", MODEL_DIR, "--port", "0", "--threads", "1", "--api-key", KEY],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found = {}
    lines = []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on http://" in line:
                found["addr"] = line.split("listening on http://", 1)[1].strip()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 30
    while "addr" not in found:
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the server did not start: " + "".join(lines))
        time.sleep(0.05)
    return proc, found["addr"], lines


def solo_run(*args):
    """`k3ring run` on the tiny model: (generated ids, text)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [BIN, "run", "--model", MODEL_DIR, "--json", out.name, *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        with open(out.name) as f:
            result = json.load(f)
    return result["generated_ids"], result["text"]


def extra(obj, name):
    """A field beyond the OpenAI schema (k3ring's token ids)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    return value


def main():
    proc, addr, lines = start_server()
    client = OpenAI(base_url=f"http://{addr}/v1", api_key=KEY, max_retries=0, timeout=60)
    results = []

    def check(name, fn):
        try:
            fn()
            results.append(True)
            print(f"ok   {name}")
        except Exception:  # noqa: BLE001 - every failure is reported, then counted
            results.append(False)
            print(f"FAIL {name}")
            traceback.print_exc()

    def models():
        ids = [m.id for m in client.models.list()]
        assert ids == [MODEL], ids

    def completion(stream, **sampling):
        kwargs = dict(model=MODEL, prompt="Hello world", max_tokens=12, **sampling)
        flags = ["--prompt", "Hello world", "--gen", "12"]
        for k, v in sampling.items():
            flags += ["--" + k.replace("_", "-"), str(v)]
        want_ids, want_text = solo_run(*flags)
        if not stream:
            r = client.completions.create(**kwargs)
            choice = r.choices[0]
            assert extra(choice, "token_ids") == want_ids, (extra(choice, "token_ids"), want_ids)
            assert choice.text == want_text, (choice.text, want_text)
            assert r.usage.completion_tokens == len(want_ids), r.usage
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
            return
        text, ids, usage, finish = "", [], None, None
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].text
                ids += extra(chunk.choices[0], "token_ids") or []
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert ids == want_ids, (ids, want_ids)
        assert text == want_text, (text, want_text)
        assert finish in ("length", "stop"), finish
        assert usage is not None and usage.completion_tokens == len(want_ids), usage

    def chat(stream, thinking):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
        kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0.7, seed=11)
        body = {"thinking": thinking, "return_token_ids": True}
        r = client.chat.completions.create(extra_body=body, **kwargs)
        prompt_ids = extra(r, "prompt_token_ids")
        assert prompt_ids and r.usage.prompt_tokens == len(prompt_ids), (prompt_ids, r.usage)
        got = extra(r.choices[0], "token_ids")
        want, _ = solo_run(
            "--ids", ",".join(map(str, prompt_ids)), "--gen", "10", "--temperature", "0.7", "--seed", "11"
        )
        # A chat also stops on <|end_of_msg|> and where the reply leaves the template.
        assert got == want[: len(got)], (got, want)
        if r.choices[0].finish_reason == "length":
            assert got == want, (got, want)
        message = r.choices[0].message
        assert message.role == "assistant"
        reasoning = extra(message, "reasoning_content") or ""
        if not thinking:
            assert reasoning == "", reasoning
        if not stream:
            return
        content, streamed_reasoning, ids, usage = "", "", [], None
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, extra_body=body, **kwargs):
            if chunk.choices:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                streamed_reasoning += extra(delta, "reasoning_content") or ""
                ids += extra(chunk.choices[0], "token_ids") or []
            else:
                usage = chunk.usage
        assert ids == got, (ids, got)
        assert content == (message.content or ""), (content, message.content)
        assert streamed_reasoning == reasoning, (streamed_reasoning, reasoning)
        assert usage is not None and usage.completion_tokens == len(got), usage

    def solo_logprobs(top, *flags):
        """`k3ring run --logprobs top` on the tiny model: [(id, logprob)] of the generated tokens."""
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(
                [BIN, "run", "--model", MODEL_DIR, "--json", out.name, "--logprobs", str(top), *flags],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
            )
            with open(out.name) as f:
                return [(e["id"], e["logprob"]) for e in json.load(f)["logprobs"]]

    def as_f32(x):
        import struct
        return struct.unpack("f", struct.pack("f", x))[0]

    def completion_logprobs(stream):
        want = solo_logprobs(3, "--prompt", "Hello world", "--gen", "8", "--ignore-eos")
        kwargs = dict(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, logprobs=3,
                      extra_body={"ignore_eos": True})
        if not stream:
            lp = client.completions.create(**kwargs).choices[0].logprobs
            values, tokens, tops, offsets = lp.token_logprobs, lp.tokens, lp.top_logprobs, lp.text_offset
        else:
            values, tokens, tops, offsets = [], [], [], []
            for chunk in client.completions.create(stream=True, **kwargs):
                if chunk.choices and chunk.choices[0].logprobs:
                    lp = chunk.choices[0].logprobs
                    values += lp.token_logprobs
                    tokens += lp.tokens
                    tops += lp.top_logprobs
                    offsets += lp.text_offset
        assert [as_f32(v) for v in values] == [as_f32(w[1]) for w in want], (values, want)
        assert len(tokens) == len(tops) == len(offsets) == 8, (tokens, tops, offsets)
        assert all(1 <= len(t) <= 3 and max(t.values()) == v for t, v in zip(tops, values)), tops
        assert offsets == sorted(offsets), offsets

    def chat_logprobs(stream):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0,
                      logprobs=True, top_logprobs=2)
        whole = client.chat.completions.create(**kwargs)
        content = whole.choices[0].logprobs.content
        assert len(content) == whole.usage.completion_tokens, (content, whole.usage)
        for e in content:
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob, e
            assert bytes(e.bytes).decode("utf-8", "replace") == e.token, e
        if not stream:
            return
        streamed = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                streamed += chunk.choices[0].logprobs.content
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content], streamed

    def prefix_reuse():
        system = "You are a careful assistant who answers briefly and checks every step. " * 20
        def ask(question):
            r = client.chat.completions.create(
                model=MODEL, max_tokens=6, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                extra_body={"return_token_ids": True, "thinking": False},
            )
            return r, extra(r, "prompt_token_ids"), extra(r.choices[0], "token_ids")
        ask("What is a ring buffer?")
        r, prompt_ids, got = ask("And what is a pipeline?")
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert len(prompt_ids) > 128 and 128 <= cached < len(prompt_ids), (cached, len(prompt_ids))
        want, _ = solo_run("--ids", ",".join(map(str, prompt_ids)), "--gen", "6", "--temperature", "0")
        assert got == want[: len(got)], (got, want)
        r, _, again = ask("And what is a pipeline?")
        assert cached <= r.usage.prompt_tokens_details.cached_tokens < len(prompt_ids), r.usage
        assert again == got, (again, got)

    def refused(exc, status, **kwargs):
        try:
            client.completions.create(**kwargs)
        except exc as e:
            assert e.status_code == status, e.status_code
            assert isinstance(e.body, dict) and e.body.get("message"), e.body
            return
        raise AssertionError(f"{kwargs} was not refused")

    def wrong_key():
        bad = OpenAI(base_url=f"http://{addr}/v1", api_key="nope", max_retries=0, timeout=30)
        try:
            bad.models.list()
        except openai.AuthenticationError as e:
            assert e.status_code == 401
            return
        raise AssertionError("a wrong key was accepted")

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "days", "unit"],
                "additionalProperties": False,
            },
        },
    }
    reply_schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 16},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["answer", "score", "ok", "tags"],
        "additionalProperties": False,
    }

    def valid_reply(v):
        """The reply against reply_schema, checked by hand (no validator is installed)."""
        assert isinstance(v, dict) and set(v) == {"answer", "score", "ok", "tags"}, v
        assert isinstance(v["answer"], str) and len(v["answer"]) <= 16, v
        assert isinstance(v["score"], int) and not isinstance(v["score"], bool) and 0 <= v["score"] <= 100, v
        assert isinstance(v["ok"], bool), v
        assert isinstance(v["tags"], list) and len(v["tags"]) <= 3 and all(t in "abc" for t in v["tags"]), v

    def valid_weather_args(text):
        a = json.loads(text)
        assert set(a) == {"city", "days", "unit"}, a
        assert isinstance(a["city"], str) and len(a["city"]) <= 12, a
        assert isinstance(a["days"], int) and 1 <= a["days"] <= 14 and a["unit"] in ("celsius", "fahrenheit"), a

    def tool_round_trip(stream):
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        forced = {"type": "function", "function": {"name": "get_weather"}}
        kwargs = dict(model=MODEL, tools=[weather], max_tokens=400, temperature=0.8, seed=5, extra_body={"thinking": False})
        if stream:
            calls, finish = {}, None
            for chunk in client.chat.completions.create(messages=messages, tool_choice=forced, stream=True, **kwargs):
                if not chunk.choices:
                    continue
                for d in chunk.choices[0].delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    c["id"] = d.id or c["id"]
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls", finish
            calls = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(messages=messages, tool_choice=forced, **kwargs)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
        assert calls and all(c["name"] == "get_weather" and c["id"] for c in calls), calls
        for c in calls:
            valid_weather_args(c["arguments"])
        history = messages + [{
            "role": "assistant", "content": None,
            "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls],
        }]
        # The results, last call's first: the server puts them back in call order.
        history += [{"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"} for i, c in reversed(list(enumerate(calls)))]
        r = client.chat.completions.create(messages=history, tool_choice="none", **kwargs)
        final = r.choices[0]
        assert final.finish_reason in ("stop", "length"), final
        assert not final.message.tool_calls, final.message

    def json_schema_reply(seed):
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": reply_schema, "strict": True}}
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Rate this."}], response_format=fmt,
            max_tokens=300, temperature=1.0, seed=seed, extra_body={"thinking": False},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        valid_reply(json.loads(r.choices[0].message.content))

    def json_object_reply(seed):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], response_format={"type": "json_object"},
            max_tokens=400, temperature=0, seed=seed, extra_body={"thinking": False},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content

    def bad_schema_refused():
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], response_format=fmt)
        except openai.BadRequestError as e:
            assert e.body.get("param") == "response_format", e.body
            assert "schema" in e.body.get("message", ""), e.body
            return
        raise AssertionError("an unsatisfiable schema was accepted")

    def constrained_identity():
        """A constrained request gives the same tokens alone and beside others; the mask never
        changes the others' tokens."""
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": reply_schema}}
        constrained = dict(model=MODEL, messages=[{"role": "user", "content": "Rate this."}], response_format=fmt,
                           max_tokens=300, temperature=0.9, seed=21, extra_body={"thinking": False, "return_token_ids": True})
        plain = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me more."}], max_tokens=24,
                     temperature=0.9, seed=22, extra_body={"thinking": False, "return_token_ids": True})
        ids = lambda r: extra(r.choices[0], "token_ids")
        alone_c = ids(client.chat.completions.create(**constrained))
        alone_p = ids(client.chat.completions.create(**plain))
        got = {}
        def ask(name, kw):
            got[name] = ids(client.chat.completions.create(**kw))
        threads = [threading.Thread(target=ask, args=(f"c{i}", constrained)) for i in range(2)]
        threads += [threading.Thread(target=ask, args=(f"p{i}", plain)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got["c0"] == alone_c and got["c1"] == alone_c, (got, alone_c)
        assert got["p0"] == alone_p and got["p1"] == alone_p, (got, alone_p)

    check("models.list", models)
    check("completions greedy", lambda: completion(False, temperature=0))
    check("completions seeded", lambda: completion(False, temperature=0.9, top_p=0.95, seed=7))
    check("completions streamed greedy", lambda: completion(True, temperature=0))
    check("completions streamed seeded", lambda: completion(True, temperature=0.9, top_p=0.95, seed=7))
    check("chat thinking on", lambda: chat(False, True))
    check("chat thinking off, streamed too", lambda: chat(True, False))
    check("chat thinking on, streamed too", lambda: chat(True, True))
    check("completions logprobs equal run's", lambda: completion_logprobs(False))
    check("completions logprobs streamed", lambda: completion_logprobs(True))
    check("chat logprobs", lambda: chat_logprobs(False))
    check("chat logprobs streamed too", lambda: chat_logprobs(True))
    check("prefix reuse: cached_tokens, cold tokens", prefix_reuse)
    check("logprobs above 5 refused", lambda: refused(openai.BadRequestError, 400, model=MODEL, prompt="a", logprobs=6))
    check("n = 2 refused", lambda: refused(openai.BadRequestError, 400, model=MODEL, prompt="a", n=2))
    check("unknown model", lambda: refused(openai.NotFoundError, 404, model="gpt-4o", prompt="a"))
    check("max_tokens over the cap", lambda: refused(openai.BadRequestError, 400, model=MODEL, prompt="a", max_tokens=10**6))
    check("wrong API key", wrong_key)
    check("tool call round trip (forced call, results, answer)", lambda: tool_round_trip(False))
    check("tool call round trip streamed", lambda: tool_round_trip(True))
    for seed in range(4):
        check(f"response_format json_schema valid, seed {seed}", lambda seed=seed: json_schema_reply(seed))
    for seed in range(2):
        check(f"response_format json_object, seed {seed}", lambda seed=seed: json_object_reply(seed))
    check("constrained tokens alone equal those in a mixed batch", constrained_identity)
    check("an unsatisfiable schema is 400 naming response_format", bad_schema_refused)

    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    results.append(code == 0)
    print(("ok  " if code == 0 else "FAIL") + f" SIGTERM ends the server with exit 0 (got {code})")
    if code != 0:
        print("".join(lines))
    passed = sum(results)
    failed = len(results) - passed
    print(f"openai: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
