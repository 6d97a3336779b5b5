"""Tests of RayDP and Spark pipelines over committed messages (``raymq.jobs``)."""
