"""The memory broker packs an ended job's events with marshal, and with JSON what marshal cannot take."""

import enum

from sluice.broker.memory_record import pack_events, unpack_events


class _Kind(enum.StrEnum):
    A = "a"


def test_packed_events_round_trip_and_fall_back_to_json() -> None:
    plain = [["token", {"choices": [{"index": 0, "delta": {"content": "x"}}]}]]
    assert isinstance(pack_events(plain), bytes) and unpack_events(pack_events(plain)) == plain
    # A str subclass (an enum member) is not marshal's: the events go as JSON text, read back plain.
    odd = [["retry", {"reason": _Kind.A}]]
    packed = pack_events(odd)
    assert isinstance(packed, str) and unpack_events(packed) == [["retry", {"reason": "a"}]]
