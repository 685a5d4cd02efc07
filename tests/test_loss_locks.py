"""The per-module forward locks (``tracinfunc.loss._LOCKS``): re-entrant, and a wait that
would close a cycle between threads is refused instead of hanging. Threads are ordered with
events and joined with a timeout; nothing depends on timing."""

from __future__ import annotations

import threading

import pytest
from torch import nn

from tracinfunc.errors import LossFunctionError
from tracinfunc.loss import _LOCKS


def _run(*targets):
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"


def test_two_threads_nesting_two_models_the_other_way_round_do_not_hang():
    """Each thread holds one model and asks for the other: the second to ask is refused (its
    wait would close the cycle), the first then gets its model; no lock is left held."""
    first, second = nn.Linear(1, 1), nn.Linear(1, 1)
    inside = {"a": threading.Event(), "b": threading.Event()}
    got = {}

    def nest(me, other, outer, inner):
        def run():
            with _LOCKS.held(outer):
                inside[me].set()
                inside[other].wait(30)  # both hold their outer model before asking
                try:
                    with _LOCKS.held(inner):
                        got[me] = "nested"
                except LossFunctionError as error:
                    got[me] = error
        return run

    _run(nest("a", "b", first, second), nest("b", "a", second, first))
    errors = [value for value in got.values() if isinstance(value, LossFunctionError)]
    assert len(errors) == 1 and "wait for ever" in str(errors[0]), got
    assert sorted(value for value in got.values() if isinstance(value, str)) == ["nested"]
    assert _LOCKS._owners == {} and _LOCKS._waiting == {}


def test_a_lock_is_reentrant_and_released_by_an_exception():
    model = nn.Linear(1, 1)
    with pytest.raises(RuntimeError), _LOCKS.held(model), _LOCKS.held(model):
        raise RuntimeError("inside")
    assert _LOCKS._owners == {}
    done = []

    def other():
        with _LOCKS.held(model):  # another thread gets it: nothing was left held
            done.append(True)

    _run(other)
    assert done == [True] and _LOCKS._owners == {}


def test_a_thread_waits_for_another_that_holds_the_model_and_then_gets_it():
    model = nn.Linear(1, 1)
    holding, release, order = threading.Event(), threading.Event(), []

    def holder():
        with _LOCKS.held(model):
            holding.set()
            release.wait(30)
            order.append("holder")

    def waiter():
        holding.wait(30)
        release.set()  # the holder may leave before or after this thread asks: both are fine
        with _LOCKS.held(model):
            order.append("waiter")

    _run(holder, waiter)
    assert sorted(order) == ["holder", "waiter"] and _LOCKS._owners == {}
