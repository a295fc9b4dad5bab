"""The scripts as one Redis Functions library (redis_library): built from the lua/*.lua files, loaded
at start, loaded again by any call that finds a server without it, side by side with another
version's library, and a clear error from a Redis without Functions."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice.broker.redis import SCRIPT_NAMES, RedisBroker
from sluice.broker.redis_library import SHARED_FILES, build_library, script_parts
from sluice.core.admission import Refused
from sluice.core.job import JobState
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job
from tests.redis_server import RedisServer


def _libraries(listed: Any) -> dict[str, set[str]]:
    """FUNCTION LIST's answer (RESP2: flat name, value lists) as library → its function names."""
    out = {}
    for entry in listed:
        lib = dict(zip(entry[::2], entry[1::2], strict=True))
        out[lib["library_name"]] = {dict(zip(f[::2], f[1::2], strict=True))["name"] for f in lib["functions"]}
    return out


def test_the_library_defines_each_shared_file_once_and_a_function_per_script() -> None:
    library = build_library(SCRIPT_NAMES)
    assert library.source.startswith(f"#!lua name={library.name}\n")
    assert set(library.functions) == set(SCRIPT_NAMES)
    for name in SCRIPT_NAMES:
        includes, body = script_parts(name)
        assert set(includes) <= set(SHARED_FILES)
        assert library.source.count(f"redis.register_function('{library.functions[name]}',") == 1
        assert body in library.source
    for shared in SHARED_FILES:
        assert library.source.count(f"-- {shared}\n") == 1
    # Another text, another name: two versions' libraries can be loaded side by side.
    assert build_library(SCRIPT_NAMES[:-1]).name != library.name


#: A Lua comment (long or to the end of the line) or string literal (quoted or long): what
#: :func:`_code` blanks out, so that only code is searched.
_LUA_NOT_CODE = re.compile(
    r"""--\[(=*)\[.*?\]\1\]|--[^\n]*|\[(=*)\[.*?\]\2\]|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""",
    re.S,
)
#: ``redis`` used other than as ``redis.<name>``: aliased, indexed, or ``redis.call``/``redis.pcall``.
_DIRECT = re.compile(r"\bredis\b(?!\s*\.\s*(?!p?call\b)[A-Za-z_])")


def _code(text: str) -> str:
    """``text`` without its comments, and with its strings emptied (a line still a line)."""

    def blank(m: re.Match[str]) -> str:
        gone = m.group(0)
        return "\n" * gone.count("\n") + ("" if gone.startswith("--") else "''")

    return _LUA_NOT_CODE.sub(blank, text)


def _direct_calls(text: str) -> list[str]:
    """The lines of Lua ``text`` that reach Redis's commands other than through ``rcall``."""
    return [line.strip() for line in _code(text).splitlines() if _DIRECT.search(line)]


def test_the_scripts_call_redis_only_through_the_shared_rcall() -> None:
    # The checker itself: what it must find, and what it must let be.
    found = "local a = redis.call('GET', k)\nlocal r = redis\nredis.pcall('X')\nlocal b = redis['call']\n"
    assert len(_direct_calls(found)) == 4
    fine = "-- redis.call in a comment\n--[[ redis.call\n]] local s = 'redis.call' .. \"redis.pcall\"\n"
    assert _direct_calls(fine + "return redis.error_reply('x'), redis.log, rcall('GET', k)\n") == []
    # Every script and shared file: a command is sent through _keys.lua's rcall upvalue (the global
    # `redis` is a lookup through the globals' __index at each call); nothing else names redis.call.
    lua = resources.files("sluice") / "lua"
    for file in sorted(f for f in lua.iterdir() if f.name.endswith(".lua")):
        text = file.read_text(encoding="utf-8")
        assert _direct_calls(text) == [], file.name
        declared = re.findall(r"\blocal\s+rcall\b", _code(text))
        assert len(declared) == (file.name == "_keys.lua"), f"{file.name} declares its own rcall"
    # In the library, redis.call is named only where each function sets rcall as it starts.
    library = build_library(SCRIPT_NAMES)
    direct = _direct_calls(library.source)
    assert len(direct) == len(SCRIPT_NAMES)
    assert all(line.endswith("function(KEYS, ARGV) rcall = redis.call") for line in direct), direct


async def test_a_server_without_the_library_gets_it_again(redis_url: str) -> None:
    clock = FakeClock()
    async with RedisBroker(redis_url, make_settings(clock)) as broker:
        admin = Redis.from_url(redis_url, decode_responses=True)
        try:
            assert broker.library.name in _libraries(await admin.function_list())  # loaded at start
            await admin.function_flush()  # as a master restarted without persistence, or a new one
            first = make_job(clock)
            await broker.admit(first)  # the call that found no function loaded the library and ran
            assert set(_libraries(await admin.function_list())[broker.library.name]) == set(
                broker.library.functions.values()
            )
            await admin.function_flush()
            claimed = await broker.claim("w", ["m"], timeout=1)
            assert claimed is not None and claimed.id == first.id
            await admin.function_flush()
            done = await broker.finish(first.id, "w", JobState.SUCCEEDED, result={"ok": True})
            assert done is not None and done.state is JobState.SUCCEEDED
        finally:
            await admin.aclose()


async def test_another_versions_library_stays_beside_this_one(redis_url: str) -> None:
    admin = Redis.from_url(redis_url, decode_responses=True)
    try:
        await admin.function_flush()
        other = "sluice_0000000000000000"  # as an older version's: its own digest, its own names
        await admin.function_load(
            f"#!lua name={other}\nredis.register_function('{other}_admit', function() return 0 end)"
        )
        clock = FakeClock()
        async with RedisBroker(redis_url, make_settings(clock)) as broker:
            await broker.admit(make_job(clock))
            libraries = _libraries(await admin.function_list())
            assert set(libraries) == {other, broker.library.name}
            assert await admin.fcall(f"{other}_admit", 0) == 0
    finally:
        await admin.aclose()


async def test_a_redis_without_functions_is_named_at_start() -> None:
    # FUNCTION renamed away answers as a Redis before 7.0 does: unknown command. (The option's two
    # words in its name: the test server passes each option as a name and one value.)
    with RedisServer(extra={"rename-command FUNCTION": "FUNCTION_RENAMED"}) as server:
        broker = RedisBroker(server.url, make_settings(FakeClock()))
        try:
            with pytest.raises(RuntimeError, match=r"Redis 7\.0 or later"):
                await broker.start()
        finally:
            await broker.close()


async def test_each_gateways_settings_are_its_own(redis_url: str) -> None:
    # admit and claim take what every call passes the same as one text, parsed once per text and
    # kept by the library (settings_of): two gateways of one version, configured apart, share the
    # library and each call is decided by its own gateway's settings.
    clock = FakeClock()
    tight = make_settings(clock)
    roomy = dataclasses.replace(tight, limits={}, lease_s=9.0)
    async with RedisBroker(redis_url, tight) as a, RedisBroker(redis_url, roomy) as b:
        for _ in range(3):
            await b.admit(make_job(clock, model="small"))
        with pytest.raises(Refused):  # 'small' holds 3 jobs at most for a
            await a.admit(make_job(clock, model="small"))
        await b.admit(make_job(clock, model="small"))  # not for b
        with pytest.raises(Refused):
            await a.admit(make_job(clock, model="small"))
        claimed_a = await a.claim("wa", ["small"], timeout=1)
        claimed_b = await b.claim("wb", ["small"], timeout=1)
        assert claimed_a is not None and claimed_b is not None
        admin = Redis.from_url(redis_url, decode_responses=True)
        try:
            active = dict(await admin.zrange(a.keys.active, 0, -1, withscores=True))
        finally:
            await admin.aclose()
        # each claim leased its job for its own gateway's lease_s
        assert active[claimed_a.id] == pytest.approx(clock() + tight.lease_s)
        assert active[claimed_b.id] == pytest.approx(clock() + roomy.lease_s)


#: Run after lua/_keys.lua in one EVAL: its memos, filled past their bounds.
_MEMO_CHECK = r"""
local m = new_memo(3)
for _, k in ipairs({ 'a', 'b', 'c', 'd', 'a' }) do
  if not m.t[k] then memo_put(m, k, k .. '!') end
end
local first = part('t:1')
for i = 1, PARTS_MAX + 10 do part('t:' .. i) end
local parsed = 0
local function parse(v) parsed = parsed + 1; return v end
local s = settings_of('check', 'u\31v%1Fw%25', parse)
settings_of('check', 'u\31v%1Fw%25', parse)
return { m.n, m.t['b'] or '', m.t['a'], first, part('t:1'), part('t:' .. (PARTS_MAX + 10)), PARTS.n,
  parsed, s[1], s[2] }
"""


async def test_the_librarys_memos_stay_bounded_and_right(redis_url: str) -> None:
    """The memos the library keeps between calls (lua/_keys.lua's new_memo: names, parsed settings)
    start again when full, and what they hand back is what building it anew gives."""
    keys_lua = (resources.files("sluice") / "lua" / "_keys.lua").read_text(encoding="utf-8")
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        reply = await client.eval(keys_lua + _MEMO_CHECK, 0)
    finally:
        await client.aclose()
    n, b, a, first, again, last, parts_n, parsed, u, vw = reply
    assert (n, b, a) == (2, "", "a!")  # a fourth entry emptied the memo of three: it holds d and a
    assert first == again == "t%3A1" and last == "t%3A4106"
    assert 0 < parts_n <= 4096  # the names' memo never holds more than its bound
    assert (parsed, u, vw) == (1, "u", "v\x1fw%")  # parsed once, the separator and '%' unescaped
