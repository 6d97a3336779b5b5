"""Spark inside the RayMQ cluster: ``with spark_session(mq) as spark: ...`` starts Spark
on Ray through RayDP (its executors are Ray actors of the same cluster) and stops it on
exit.

What Spark on Ray needs with Java 17 is set here: the interpreter of this process for
PySpark's workers, and the ``--add-opens`` options in the driver's, the executors' and
RayDP's app master's JVM options.  A missing or too old Java is one line naming the
fix.  Executors leave a CPU to Ray's own tasks (Ray Data's reads and block metadata
need one; Spark on every CPU makes them wait for ever).  Nested ``spark_session``
blocks share the outer session (RayDP runs one per process).

``quiet=True`` (``raymq demo`` without ``--verbose``) sets the log levels, not filters
text: Spark's JVMs get ``log4j2-quiet.properties`` (errors only) and no console progress
bar, and write their own output to a file in Ray's log directory (``jvm_output_to``: the
Ray core worker inside RayDP's app master prints its start-up lines before any level
applies); the JVM's Ray core worker logs warnings and up, Ray Data logs warnings and up
(``quiet_ray_data``), and PySpark's deprecation warning about ``DataFrame.sql_ctx`` (which
RayDP's dataset hand-off uses) is not shown.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import uuid
import warnings

from raymq.storage.errors import JavaMissingError

_OPENS = ("java.lang", "java.lang.invoke", "java.io", "java.net", "java.nio", "java.math",
          "java.text", "java.util", "java.util.concurrent", "java.util.concurrent.atomic",
          "sun.nio.ch", "sun.nio.cs", "sun.security.action", "sun.util.calendar")
JAVA17_OPTIONS = " ".join(["-XX:+IgnoreUnrecognizedVMOptions"] +
                          [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in _OPENS])
JAVA_FIX = "apt-get install openjdk-17-jre-headless (make install does it)"

_active = None

#: Spark's JVMs' log4j2 configuration when quiet: errors only, on stderr
QUIET_LOG4J2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2-quiet.properties")


def quiet_ray_data() -> None:
    """Ray Data at warnings and up, without progress bars: its start-up and per-dataset
    progress lines are INFO (set before ``ray.data`` is imported, the level holds for its
    own logging set-up too: ``RAY_DATA_LOG_LEVEL``); once ``ray.data`` is imported (a
    quiet ``spark_session`` calls this after RayDP imported it) the bars of a terminal
    are switched off, and so is the warning saying they are.  Before, ``ray.data`` is
    not imported for this alone (half a second of every demo's start)."""
    import logging
    os.environ["RAY_DATA_LOG_LEVEL"] = "WARNING"
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    if "ray.data" in sys.modules:
        from ray.data import DataContext
        DataContext.get_current().enable_progress_bars = False


@contextlib.contextmanager
def jvm_output_to(path: str):
    """While Spark's JVMs start, this process's standard error is ``path``: they inherit
    it, so their own output (the Ray core worker's start-up lines in RayDP's app master,
    anything they print later) goes to that file, as Ray's workers' output goes to Ray's
    log files.  This process's standard error is back as it was on exit."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def jvm_log_path() -> str:
    """Where a quiet session's JVMs write their own output: Ray's log directory."""
    from raymq import rpc
    return os.path.join(rpc.logs_dir(), f"raymq-spark-jvm-{os.getpid()}.log")


def quiet_configs() -> dict[str, str]:
    """Spark settings of a quiet session: RayMQ's log4j2 configuration in the driver and in
    RayDP's app master (RayDP passes each as ``-Dlog4j2.configurationFile``), no stage
    progress bar."""
    return {"spark.log4j.config.file.name": QUIET_LOG4J2,
            "spark.ray.log4j.config.file.name": QUIET_LOG4J2,
            "spark.ui.showConsoleProgress": "false"}


def java_major(version_output: str) -> int:
    """The major version in ``java -version``'s output (``1.8.0_x`` is 8); 0 if none."""
    m = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if not m:
        return 0
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def check_java() -> None:
    """``JavaMissingError`` (one line, with the fix) unless ``java`` 17+ is on PATH."""
    java = shutil.which("java")
    if java is None:
        raise JavaMissingError(f"Spark needs Java 17 and there is no `java` on PATH: {JAVA_FIX}")
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    major = java_major(out.stderr + out.stdout)
    if major < 17:
        raise JavaMissingError(f"Spark needs Java 17, `{java}` is Java {major or 'unknown'}: "
                               f"{JAVA_FIX}")


def spark_configs(executors: int, cores: int, extra: dict | None = None) -> dict[str, str]:
    return {"spark.driver.extraJavaOptions": JAVA17_OPTIONS,
            "spark.executor.extraJavaOptions": JAVA17_OPTIONS,
            "spark.ray.raydp_app_master.extraJavaOptions": JAVA17_OPTIONS,
            "spark.pyspark.python": sys.executable,
            "spark.sql.shuffle.partitions": str(max(2, 2 * executors * cores)),
            "spark.sql.session.timeZone": "UTC",
            "spark.ui.enabled": "false",
            **(extra or {})}


@contextlib.contextmanager
def spark_session(mq=None, *, num_executors: int | None = None, executor_cores: int = 1,
                  executor_memory: str = "1g", configs: dict | None = None,
                  quiet: bool = False):
    """A SparkSession on this Ray cluster (``raydp.init_spark``), stopped on exit.  By
    default one 1-core executor per Ray CPU but one (at least one executor).  ``quiet``:
    errors only from Spark, its JVMs and Ray Data (see the module's text)."""
    global _active
    if _active is not None:
        yield _active
        return
    check_java()
    import ray
    import raydp
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if quiet:
        quiet_ray_data()
        os.environ["RAY_BACKEND_LOG_LEVEL"] = "warning"  # (the JVM's Ray core worker)
        warnings.filterwarnings("ignore", message="DataFrame.sql_ctx", category=UserWarning)
        configs = {**quiet_configs(), **(configs or {})}
    cpus = int(ray.cluster_resources().get("CPU", 1))
    executors = num_executors or max(1, (cpus - 1) // executor_cores)
    with jvm_output_to(jvm_log_path()) if quiet else contextlib.nullcontext():
        spark = raydp.init_spark(f"raymq-{os.getpid()}-{uuid.uuid4().hex[:6]}", executors,
                                 executor_cores, executor_memory,
                                 configs=spark_configs(executors, executor_cores, configs))
    _active = spark
    try:
        yield spark
    finally:
        _active = None
        raydp.stop_spark()
