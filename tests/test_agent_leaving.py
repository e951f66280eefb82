"""A stopping agent's turns (agent/leaving.py), on plain data: it waits while its jobs save,
kills what is left at its deadline or at a second signal, exits once nothing is left; and no
notice it passes on runs past its own deadline."""

from prefect_spotgpu.agent.leaving import Leaving, Turn


def test_a_stopping_agent_waits_then_kills_at_its_deadline():
    leaving = Leaving(grace_seconds=10)
    assert not leaving.asked and leaving.deadline(500.0) == 500.0
    leaving.ask(now=100.0)
    assert leaving.asked and leaving.by == 110.0
    assert leaving.turn(busy=True, now=105.0) is Turn.WAIT
    assert leaving.turn(busy=False, now=105.0) is Turn.EXIT
    assert leaving.turn(busy=True, now=110.0) is Turn.KILL
    assert leaving.deadline(400.0) == 110.0  # the market's notice is longer: the agent's own
    assert leaving.deadline(108.0) == 108.0


def test_a_second_signal_kills_at_once():
    leaving = Leaving(grace_seconds=30)
    leaving.ask(now=0.0)
    leaving.ask(now=1.0)
    assert leaving.by == 30.0  # the deadline stays; the turn is now
    assert leaving.turn(busy=True, now=1.0) is Turn.KILL
    assert leaving.turn(busy=False, now=1.0) is Turn.EXIT
