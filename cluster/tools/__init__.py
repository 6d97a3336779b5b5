"""RayMQ's tools over the client SDK: the ``raymq`` CLI, the demo and the benchmarks.

Not part of the SDK: nothing in ``raymq`` (the client) or below imports them.
"""
