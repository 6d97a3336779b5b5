"""Time: RocketMQ's delay levels on the schedule topic (``delay``) and timer messages of
any deliver-at time on the timer wheel -- indexing, delivery, cancelling (``timers``).
"""
