"""bench/suite/measure.py's interleaved timing, on the CPU with CUDA events stood in for: how often each call runs
(a warm-up, then per round an untimed lead and the timed calls) and in which order (reversed every round)."""

import torch

from bench.suite import measure


class FakeEvent:
    """A CUDA event whose elapsed time is the number of calls made between its record and the other's."""
    log = None

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = len(FakeEvent.log)

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return float(end.at - self.at)


def test_time_interleaved_lead_and_order(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    calls = {name: (lambda name=name: FakeEvent.log.append(name)) for name in "abc"}
    ms = measure.time_interleaved(calls, rounds=3, iters=4, lead=2)
    assert ms == {"a": 1.0, "b": 1.0, "c": 1.0}  # only the timed calls fall between the events: 4 of 4 per call
    log = "".join(FakeEvent.log)
    assert log == "abc" + "aaaaaabbbbbbcccccc" + "ccccccbbbbbbaaaaaa" + "aaaaaabbbbbbcccccc"


def test_time_interleaved_lead_defaults_to_iters(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    measure.time_interleaved({"a": lambda: FakeEvent.log.append("a")}, rounds=2, iters=3)
    assert len(FakeEvent.log) == 1 + 2 * (3 + 3)
