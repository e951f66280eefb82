"""The agent's GPU bookkeeping (``agent/gpu_book.py``), pure: no agent, no market, no clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefect_spotgpu.agent.gpu_book import GpuBook, Verdict


def test_an_allocation_takes_the_lowest_free_gpus_and_gives_back_only_its_own():
    book = GpuBook(gpu_count=4, patience=30)
    assert book.take(1, 2, now=0).indices == (0, 1)
    assert book.take(2, 1, now=0).indices == (2,)
    assert book.give_back(1) == (0, 1)
    assert book.take(3, 2, now=0).indices == (0, 1)
    assert book.give_back(1) == ()  # a late second release of allocation 1 frees nothing...
    assert book.held() == {2: (2,), 3: (0, 1)}  # ...and allocation 3 keeps GPUs 0 and 1
    assert book.free_count() == 1


def test_too_few_free_waits_for_the_patience_then_gives_up():
    book = GpuBook(gpu_count=1, patience=35)
    book.take(1, 1, now=0)
    waited = book.take(2, 1, now=10)
    assert waited.verdict == Verdict.WAIT and waited.free == 0 and book.waiting() == [2]
    assert book.take(2, 1, now=44.9).verdict == Verdict.WAIT  # counted from the first try
    gave_up = book.take(2, 1, now=45)
    assert gave_up.verdict == Verdict.GIVE_UP and book.waiting() == []
    assert book.held() == {1: (0,)}


def test_a_waiting_allocation_starts_once_a_stop_gives_the_gpus_back():
    book = GpuBook(gpu_count=2, patience=35)
    book.take(1, 2, now=0)
    assert book.take(2, 2, now=1).verdict == Verdict.WAIT
    book.give_back(1)
    taken = book.take(2, 2, now=2)
    assert taken.verdict == Verdict.TAKEN and taken.indices == (0, 1) and book.waiting() == []


def test_an_allocation_that_ends_while_waiting_stops_waiting():
    book = GpuBook(gpu_count=1, patience=35)
    book.take(1, 1, now=0)
    book.take(2, 1, now=0)
    book.stop_waiting(2)
    assert book.waiting() == []


def test_taking_again_returns_what_the_allocation_holds():
    book = GpuBook(gpu_count=2, patience=35)
    assert book.take(1, 1, now=0).indices == (0,)
    assert book.take(1, 1, now=1).indices == (0,)
    assert book.free_count() == 1


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["take", "give_back", "stop_waiting"]),
        st.integers(1, 6),  # allocation
        st.integers(1, 4),  # GPUs asked
        st.floats(0, 5),  # seconds since the last action
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(gpu_count=st.integers(1, 8), actions=ACTIONS)
def test_no_gpu_is_ever_held_twice_and_none_is_lost(gpu_count, actions):
    book = GpuBook(gpu_count=gpu_count, patience=10)
    now = 0.0
    for action, alloc, count, step in actions:
        now += step
        if action == "take":
            held_before = book.held().get(alloc)
            taken = book.take(alloc, count, now=now)
            if taken.verdict == Verdict.TAKEN:
                assert len(taken.indices) == (len(held_before) if held_before else count)
            else:
                assert taken.free < count and alloc not in book.held()
        elif action == "give_back":
            others = {a: g for a, g in book.held().items() if a != alloc}
            book.give_back(alloc)
            assert {a: g for a, g in book.held().items() if a != alloc} == others
        else:
            book.stop_waiting(alloc)
        held = [gpu for gpus in book.held().values() for gpu in gpus]
        assert len(held) == len(set(held)), "a GPU held by two allocations"
        assert len(held) + book.free_count() == gpu_count, "a GPU lost or invented"
        assert set(held) <= set(range(gpu_count))
        assert not set(book.waiting()) & set(book.held())
