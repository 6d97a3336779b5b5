"""Tests of the operators' web console (``raymq.tools.console``)."""
