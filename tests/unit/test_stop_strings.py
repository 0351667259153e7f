"""Stop strings over streamed text: held-back partial matches, cuts, and the end of output."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvmesh.coordinator.service.stop_strings import StopStringMatcher


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot() -> None:
    m = StopStringMatcher(["\n\nQ:"])
    first = m.push("The answer is 42\n")
    assert first.text == "The answer is 42" and not first.stopped
    second = m.push("\nA")
    assert second.text == "\n\nA" and not second.stopped


def test_a_stop_string_split_across_pushes_ends_the_output_before_it() -> None:
    m = StopStringMatcher(["\n\nQ:"])
    assert m.push("42\n").text == "42"
    check = m.push("\nQ: next question")
    assert check.stopped and check.text == ""
    assert m.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    m = StopStringMatcher(["END", "stop"])
    check = m.push("a stop then END")
    assert check.stopped and check.text == "a "


def test_flush_releases_the_held_tail_when_the_output_ends_without_a_stop() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.push("done </").text == "done "
    assert m.flush() == "</"


def test_no_stop_strings_pass_everything_through() -> None:
    m = StopStringMatcher([])
    assert m.push("anything").text == "anything"
    assert m.flush() == ""


def test_empty_stop_string_and_push_after_stop_are_misuse() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])
    m = StopStringMatcher(["x"])
    m.push("x")
    with pytest.raises(ValueError, match="after a stop"):
        m.push("more")


@example(["b\n", "a"], ["\n", "b\na"])  # a stop completing first wins over one starting earlier
@given(
    st.lists(st.text(alphabet="ab\n", max_size=6), max_size=8),
    st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_streamed_output_equals_the_whole_text_cut_at_the_first_stop(
    pieces: list[str], stop: list[str]
) -> None:
    whole = "".join(pieces)
    # Generation stops when a stop string is first complete: the smallest end wins.
    cuts = [(i + len(s), i) for s in stop if (i := whole.find(s)) >= 0]
    expected = whole[: min(cuts)[1]] if cuts else whole
    m = StopStringMatcher(stop)
    out = []
    for piece in pieces:
        check = m.push(piece)
        out.append(check.text)
        if check.stopped:
            break
    else:
        out.append(m.flush())
    assert "".join(out) == expected
    assert m.stopped == bool(cuts)
