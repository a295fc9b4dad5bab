"""The request rules: priority, caps, defaults, cost and deadline, each rule at its boundaries."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from sluice.core.cost import estimate_chat_tokens, estimate_prompt_tokens
from sluice.core.job import Endpoint
from sluice.core.model_info import ModelInfo
from sluice.core.ratelimit import TenantLimits
from sluice.core.request import JobPlan, RequestedJob, RequestLimits, RequestRejected, plan_job

NOW = 1_000.0
MSG = [{"role": "user", "content": "hi"}]
LIMITS = RequestLimits(
    classes=("high", "normal", "low"),
    default_priority="normal",
    max_n=4,
    default_max_tokens=512,
    max_tokens_cap=4096,
    max_messages=3,
    max_prompt_tokens=100,
    default_timeout_s=120.0,
    max_timeout_s=600.0,
)
ANYONE = TenantLimits("t")


def chat(**fields: Any) -> RequestedJob:
    return RequestedJob(Endpoint.CHAT, messages=fields.pop("messages", MSG), **fields)


def plan(asked: RequestedJob, limits: RequestLimits = LIMITS, tenant: TenantLimits = ANYONE) -> JobPlan:
    return plan_job(asked, limits, tenant, NOW)


def rejected(
    asked: RequestedJob, limits: RequestLimits = LIMITS, tenant: TenantLimits = ANYONE
) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        plan_job(asked, limits, tenant, NOW)
    return info.value


def test_a_request_that_asks_nothing_gets_the_defaults() -> None:
    p = plan(chat())
    assert p == JobPlan(
        priority="normal",
        engine_max_tokens=512,
        max_tokens=512,
        prompt_tokens=estimate_chat_tokens(MSG),
        deadline=NOW + 120.0,
        sequences=1,
    )
    assert p.cost == p.prompt_tokens + 512


# --- n ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4])
def test_n_up_to_max_n_multiplies_the_reserved_tokens(n: int) -> None:
    p = plan(chat(n=n, max_tokens=10))
    assert (p.engine_max_tokens, p.max_tokens, p.sequences) == (10, 10 * n, n)
    # Each of the n sequences reads the prompt.
    assert p.prompt_tokens == estimate_chat_tokens(MSG) * n
    assert p.cost == p.prompt_tokens + 10 * n


def test_n_above_max_n_is_refused() -> None:
    r = rejected(chat(n=5))
    assert (r.status, r.code, r.param) == (400, None, "n")
    assert r.message == "'n' must be at most 4 on this server."


def test_n_below_one_is_refused() -> None:
    r = rejected(chat(n=0))
    assert (r.status, r.code, r.param) == (400, "invalid_value", "n")


# --- best_of and prompt lists: what the engine runs ---------------------------------------------


@pytest.mark.parametrize(("n", "best_of", "width"), [(None, 3, 3), (2, 4, 4), (3, 1, 3), (2, None, 2)])
def test_best_of_generates_that_many_and_is_charged_for_them(
    n: int | None, best_of: int | None, width: int
) -> None:
    p = plan(RequestedJob(Endpoint.COMPLETIONS, prompt=prompt_of(10), n=n, best_of=best_of, max_tokens=7))
    assert (p.sequences, p.prompt_tokens, p.max_tokens) == (width, 10 * width, 7 * width)


@pytest.mark.parametrize(
    ("value", "status", "code", "message"),
    [
        (5, 400, None, "'best_of' must be at most 4 on this server."),
        (0, 400, "invalid_value", "'best_of' must be at least 1."),
        ("3", 400, "invalid_type", "'best_of' must be an integer."),
        (2.5, 400, "invalid_type", "'best_of' must be an integer."),
        (True, 400, "invalid_type", "'best_of' must be an integer."),
    ],
)
def test_a_bad_best_of_is_refused(value: object, status: int, code: str | None, message: str) -> None:
    r = rejected(RequestedJob(Endpoint.COMPLETIONS, prompt="hi", best_of=value))
    assert (r.status, r.code, r.param, r.message) == (status, code, "best_of", message)


def test_a_prompt_list_runs_one_sequence_per_prompt_and_choice() -> None:
    # The issue's probe: 200 prompts charged as one generation, run as 200 sequences.
    limits = replace(LIMITS, max_prompt_tokens=10_000)
    prompts = [prompt_of(10)] * 200
    p = plan(RequestedJob(Endpoint.COMPLETIONS, prompt=prompts, max_tokens=2048), limits)
    assert (p.sequences, p.prompt_tokens, p.max_tokens) == (200, 2000, 409_600)
    p = plan(RequestedJob(Endpoint.COMPLETIONS, prompt=prompts[:3], n=2, best_of=4, max_tokens=5), limits)
    assert (p.sequences, p.prompt_tokens, p.max_tokens) == (12, 30 * 4, 5 * 12)
    ids = plan(RequestedJob(Endpoint.COMPLETIONS, prompt=[[1, 2, 3], [4, 5]], n=2, max_tokens=5))
    assert (ids.sequences, ids.prompt_tokens, ids.max_tokens) == (4, 5 * 2, 5 * 4)
    one = plan(RequestedJob(Endpoint.COMPLETIONS, prompt=[1, 2, 3], n=2, max_tokens=5))
    assert (one.sequences, one.prompt_tokens) == (2, 6)  # token ids are one prompt


def test_a_prompt_list_is_measured_whole_against_max_prompt_tokens() -> None:
    r = rejected(RequestedJob(Endpoint.COMPLETIONS, prompt=[prompt_of(50), prompt_of(51)]))
    assert (r.code, r.param) == ("context_length_exceeded", "prompt")
    fits = RequestedJob(Endpoint.COMPLETIONS, prompt=[prompt_of(50), prompt_of(50)])
    assert plan(fits).prompt_tokens == 100


# --- max_tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [1, 4096])
def test_max_tokens_within_bounds_is_taken(name: str, value: int) -> None:
    assert plan(chat(**{name: value})).engine_max_tokens == value


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize(
    ("value", "message"),
    [(0, "at least 1"), (-3, "at least 1"), (4097, "at most 4096 on this server")],
)
def test_max_tokens_out_of_bounds_is_refused(name: str, value: int, message: str) -> None:
    r = rejected(chat(**{name: value}))
    assert (r.status, r.code, r.param) == (400, "invalid_value", name)
    assert r.message == f"'{name}' must be {message}."


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    # As vLLM reads them: the newer name first.
    assert plan(chat(max_tokens=7, max_completion_tokens=9)).engine_max_tokens == 9
    assert plan(chat(max_tokens=9, max_completion_tokens=7)).max_tokens == 7
    # Each one sent is checked, whichever wins.
    r = rejected(chat(max_tokens=0, max_completion_tokens=9))
    assert (r.code, r.param) == ("invalid_value", "max_tokens")


# --- no limit: the engine decides, and the cost is an estimate ----------------------------------

UNLIMITED = replace(LIMITS, default_max_tokens=None, max_prompt_tokens=10_000)


def test_without_a_limit_or_a_default_the_engine_gets_none() -> None:
    p = plan(chat(), limits=UNLIMITED)
    assert p.engine_max_tokens is None
    # Nothing known of the model: charged the most a request may ask for.
    assert p.max_tokens == UNLIMITED.max_tokens_cap


def test_without_a_limit_the_charge_is_what_answers_were_measured_to_need() -> None:
    measured = ModelInfo(context_window=32_768, output_tokens=300, output_samples=10)
    p = plan_job(chat(n=2), UNLIMITED, ANYONE, NOW, measured)
    assert (p.engine_max_tokens, p.max_tokens, p.sequences) == (None, 600, 2)


def test_without_a_limit_the_charge_stays_within_the_context_window() -> None:
    prompt = estimate_chat_tokens(MSG)
    small = ModelInfo(context_window=prompt + 50)
    assert plan_job(chat(), UNLIMITED, ANYONE, NOW, small).max_tokens == 50
    learned = ModelInfo(context_window=prompt + 50, output_tokens=3000, output_samples=5)
    assert plan_job(chat(), UNLIMITED, ANYONE, NOW, learned).max_tokens == 50
    # A prompt that fills the window is still charged a token: the engine will say it is too long.
    full = ModelInfo(context_window=prompt)
    assert plan_job(chat(), UNLIMITED, ANYONE, NOW, full).max_tokens == 1


def test_without_a_limit_the_charge_stays_within_the_keys_tpm() -> None:
    prompt = estimate_chat_tokens(MSG)
    tight = TenantLimits("t", tpm=prompt + 100)
    p = plan_job(chat(), UNLIMITED, tight, NOW, ModelInfo(context_window=32_768))
    assert p.cost == prompt + 100


def test_a_limit_asked_is_charged_as_asked_whatever_is_known() -> None:
    measured = ModelInfo(context_window=100, output_tokens=5, output_samples=10)
    assert plan_job(chat(max_tokens=70), UNLIMITED, ANYONE, NOW, measured).max_tokens == 70


# --- messages and the prompt --------------------------------------------------------------------


def test_messages_up_to_max_messages_are_taken() -> None:
    assert plan(chat(messages=MSG * 3)).prompt_tokens == estimate_chat_tokens(MSG * 3)


def test_more_messages_than_max_messages_are_refused() -> None:
    r = rejected(chat(messages=MSG * 4))
    assert (r.status, r.code, r.param) == (400, None, "messages")
    assert r.message == "At most 3 messages per request on this server."


def prompt_of(tokens: int) -> str:
    """A completions prompt the estimate puts at exactly ``tokens`` tokens."""
    text = "abcd" * tokens
    assert estimate_prompt_tokens(text) == tokens
    return text


def test_a_prompt_of_max_prompt_tokens_is_taken() -> None:
    p = plan(RequestedJob(Endpoint.COMPLETIONS, prompt=prompt_of(100)))
    assert p.prompt_tokens == 100


@pytest.mark.parametrize(
    ("endpoint", "param"), [(Endpoint.COMPLETIONS, "prompt"), (Endpoint.CHAT, "messages")]
)
def test_a_prompt_over_max_prompt_tokens_is_refused(endpoint: Endpoint, param: str) -> None:
    text = prompt_of(101)
    asked = RequestedJob(endpoint, prompt=text, messages=[{"role": "user", "content": text}])
    r = rejected(asked)
    tokens = estimate_chat_tokens(asked.messages or []) if endpoint is Endpoint.CHAT else 101
    assert (r.status, r.code, r.param) == (400, "context_length_exceeded", param)
    assert r.message == f"The prompt is about {tokens} tokens; the most this server takes is 100."


def test_tools_functions_and_schemas_count_toward_max_prompt_tokens() -> None:
    description = prompt_of(101)
    tools = [{"type": "function", "function": {"name": "f", "description": description}}]
    for fields in (
        {"tools": tools},
        {"functions": tools[0]["function"]},
        {"response_format": {"type": "json_schema", "json_schema": {"description": description}}},
    ):
        r = rejected(chat(**fields))
        assert (r.status, r.code, r.param) == (400, "context_length_exceeded", "messages"), fields
        assert "of them tool definitions and schemas" in r.message
    # Within the limit, they are charged.
    short = [{"type": "function", "function": {"name": "f", "description": prompt_of(20)}}]
    assert plan(chat(tools=short)).prompt_tokens >= estimate_chat_tokens(MSG) + 20
    # A completions prompt's schema counts too; tools do not (the completions API has none).
    schema = {"type": "json_schema", "json_schema": {"description": description}}
    assert rejected(RequestedJob(Endpoint.COMPLETIONS, prompt="hi", response_format=schema)).param == "prompt"


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "hi", "name": "n" * 404},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "a" * 404}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "a" * 404},
    ],
)
def test_every_message_field_counts_toward_max_prompt_tokens(message: dict[str, Any]) -> None:
    r = rejected(chat(messages=[message]))
    assert (r.code, r.param) == ("context_length_exceeded", "messages")


def test_token_ids_count_one_each() -> None:
    assert plan(RequestedJob(Endpoint.COMPLETIONS, prompt=list(range(100)))).prompt_tokens == 100
    assert rejected(RequestedJob(Endpoint.COMPLETIONS, prompt=list(range(101)))).param == "prompt"


# --- priority -----------------------------------------------------------------------------------


def test_the_body_priority_wins_over_the_header() -> None:
    assert plan(chat(priority="low", priority_header="high")).priority == "low"
    assert plan(chat(priority_header="high")).priority == "high"


def test_an_unknown_priority_is_refused() -> None:
    for asked in (chat(priority="vip"), chat(priority_header="vip")):
        r = rejected(asked)
        assert (r.status, r.code, r.param) == (400, "invalid_value", "priority")
        assert r.message == "Unknown priority 'vip'; use one of high, normal, low."


def test_a_key_may_ask_its_ceiling_and_below_never_above() -> None:
    capped = TenantLimits("t", max_priority="normal")
    assert plan(chat(priority="normal"), tenant=capped).priority == "normal"
    assert plan(chat(priority="low"), tenant=capped).priority == "low"
    r = rejected(chat(priority="high"), tenant=capped)
    assert (r.status, r.code, r.param) == (403, "priority_not_allowed", "priority")
    assert r.message == "This key may use priority 'normal' at most; 'high' is above it."


def test_a_key_capped_below_the_default_gets_its_ceiling_by_default() -> None:
    assert plan(chat(), tenant=TenantLimits("t", max_priority="low")).priority == "low"
    # A ceiling above the server's default leaves the default alone.
    assert plan(chat(), tenant=TenantLimits("t", max_priority="high")).priority == "normal"


# --- the deadline -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "seconds"),
    [
        ({"timeout_s": 5.0}, 5.0),
        ({"timeout_s": 600.0}, 600.0),
        ({"timeout_s": 601.0}, 600.0),
        ({"timeout_header": "7.5"}, 7.5),
        ({"timeout_header": "1e9"}, 600.0),
        ({"timeout_s": 5.0, "timeout_header": "soon"}, 5.0),  # the body wins; the header is not read
    ],
)
def test_the_deadline_is_the_asked_timeout_capped(fields: dict[str, Any], seconds: float) -> None:
    assert plan(chat(**fields)).deadline == NOW + seconds


@pytest.mark.parametrize(
    ("fields", "seconds"),
    [
        ({"client_timeout_header": "600"}, 600.0),
        ({"client_timeout_header": "30.0"}, 30.0),
        ({"client_timeout_header": "1e9"}, 600.0),  # capped
        ({"client_timeout_header": "soon"}, 120.0),  # the library's header is ignored, not refused
        ({"client_timeout_header": "0"}, 120.0),
        ({"client_timeout_header": "nan"}, 120.0),
        ({"client_timeout_header": "30", "timeout_header": "7"}, 7.0),  # the client's own wins
        ({"client_timeout_header": "30", "timeout_s": 5.0}, 5.0),
    ],
)
def test_the_client_librarys_timeout_is_the_deadline_when_none_is_asked(
    fields: dict[str, Any], seconds: float
) -> None:
    assert plan(chat(**fields)).deadline == NOW + seconds


def test_the_default_timeout_is_capped_too() -> None:
    assert plan(chat(), limits=replace(LIMITS, max_timeout_s=60.0)).deadline == NOW + 60.0


@pytest.mark.parametrize("header", ["soon", "", "0", "-1", "nan", "inf", "-inf"])
def test_a_bad_timeout_header_is_refused(header: str) -> None:
    r = rejected(chat(timeout_header=header))
    assert (r.status, r.code, r.param) == (400, None, "X-Request-Timeout")
    assert r.message == "X-Request-Timeout must be a positive number of seconds."


# --- order --------------------------------------------------------------------------------------


def test_the_first_rule_broken_is_the_one_reported() -> None:
    long = [{"role": "user", "content": prompt_of(101)}]
    # Each fault, in the order the rules check them: its (param, code), what makes it, what mends it.
    faults: list[tuple[tuple[str, str | None], dict[str, Any], dict[str, Any]]] = [
        (("n", None), {"n": 5}, {"n": None}),
        (("best_of", None), {"best_of": 5}, {"best_of": None}),
        (("max_tokens", "invalid_value"), {"max_tokens": 0}, {"max_tokens": None}),
        (("messages", None), {"messages": long * 4}, {"messages": long}),
        (("messages", "context_length_exceeded"), {}, {"messages": MSG}),
        (("priority", "invalid_value"), {"priority": "vip"}, {"priority": None}),
        (("X-Request-Timeout", None), {"timeout_header": "soon"}, {"timeout_header": None}),
    ]
    asked = chat(**{k: v for _, fault, _ in faults for k, v in fault.items()})
    for expected, _, mend in faults:
        r = rejected(asked)
        assert (r.param, r.code) == expected, r.message
        asked = asked._replace(**mend)
    assert plan(asked).priority == "normal"


def test_the_rules_do_not_need_the_web_framework() -> None:
    code = (
        "import sys, sluice.core.request; "
        "print(sorted(m for m in ('fastapi', 'starlette', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_what_was_asked_and_its_plan_cannot_change() -> None:
    # Both are NamedTuples (made for every request, in a fifth of a frozen dataclass's time), as
    # immutable as the frozen dataclasses they were.
    asked = chat()
    p = plan(asked)
    with pytest.raises(AttributeError):
        asked.n = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.priority = "high"  # type: ignore[misc]
    assert p.cost == p.prompt_tokens + p.max_tokens
