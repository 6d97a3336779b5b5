"""Spark's JVM on RayMQ's quiet log4j2 configuration says nothing on stderr when nothing
went wrong: no "Setting default log level" notice, no WARN lines (``raymq demo``'s Spark
driver runs on it; PySpark alone here, no Ray)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


SCRIPT = """
from pyspark.sql import SparkSession
from raymq.jobs.spark_session import JAVA17_OPTIONS, QUIET_LOG4J2, quiet_configs
b = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
b = b.config("spark.driver.extraJavaOptions",
             JAVA17_OPTIONS + " -Dlog4j2.configurationFile=" + QUIET_LOG4J2)
for k, v in quiet_configs().items():
    b = b.config(k, v)
s = b.getOrCreate()
print(s.range(1000).selectExpr("sum(id)").collect()[0][0])
s.stop()
"""


@pytest.mark.slow
@pytest.mark.spark
def test_a_quiet_spark_driver_prints_nothing_on_stderr():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"},
                               "PYSPARK_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["499500"]
    assert proc.stderr.strip() == ""
