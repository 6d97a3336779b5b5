"""RayMQ's data pipelines (``raymq.jobs``): RayDP / Spark jobs over committed messages.

Empty for now: read_committed datasets and transactional write-back come with the Spark issue.
"""
