"""Helpers shared by the data-channel tests (no Ray): a raw request/reply, an echo target."""
from __future__ import annotations

import pickle


class EchoTarget:
    """What an endpoint serves: ``send`` echoes its argument and counts its calls."""

    def __init__(self):
        self.calls = 0

    def send(self, x):
        self.calls += 1
        return {"echo": x}


def call(link, method, *args):
    """One request on an established link; its value, or its error raised."""
    link.send_bytes(pickle.dumps((method, args), protocol=5))
    ok, value = pickle.loads(link.recv_bytes())
    if not ok:
        raise value
    return value
