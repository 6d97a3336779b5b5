"""``ray up ray_config.yaml`` end to end on this machine: a one-node local cluster (head
127.0.0.1) reached over ssh, RayMQ deployed with ``ray exec``, and ``ray down`` that
really stops it.

Safe on a shared machine: the "node" is a PID and mount namespace of the test's own,
so the bare ``ray stop`` that ``ray up``/``ray down`` run there sees (and kills) only
that namespace's processes, never the session's Ray or anyone else's; its home
(``~``, where the cluster file installs RayMQ and edits ``~/.bashrc``) and Ray's
``/tmp/ray`` are directories of the test bound over ``/root`` and ``/tmp/ray``
inside it.  ssh reaches the node through ``sshd -i`` entered into the namespace
(``ssh_proxy_command``): no port is opened.  The copy of ``ray_config.yaml`` differs
only in what a one-node run needs: head 127.0.0.1 and no workers, the ssh key and
token made here, a free port instead of 6379, a unique cluster name.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import yaml
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
TOOLS = ("sshd", "ssh", "ssh-keygen", "rsync", "unshare", "nsenter")

#: pid 1 of the node's namespace: reaps orphans (Ray's daemons) so none lingers as a zombie
REAPER = """import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""

#: run by ``unshare`` as the node: its home and Ray's temp dir are the test's
NODE = """set -e
mkdir -p /run/sshd "$T/home/.cache/pip" "$T/home/.config/pip"
if [ -d /root/.cache/pip ]; then mount --bind /root/.cache/pip "$T/home/.cache/pip"; fi
if [ -d /root/.config/pip ]; then mount --bind /root/.config/pip "$T/home/.config/pip"; fi
mount --rbind "$T/home" /root
mount --bind "$T/nsray" /tmp/ray
exec /usr/bin/python3 -c "$REAPER"
"""

SSHD_CONFIG = """HostKey /root/.sshd/host_key
AuthorizedKeysFile /root/.ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
LogLevel ERROR
"""


def _why_not() -> str | None:
    """Why this machine cannot run the test, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs Linux and root (sshd, PID and mount namespaces)"
    missing = [t for t in TOOLS if not shutil.which(t, path=os.environ.get("PATH", "") +
                                                     ":/usr/sbin:/sbin")]
    if missing:
        return (f"{', '.join(missing)} not installed (`apt-get install openssh-server rsync`; "
                ".ci/install.sh does it when CI=true)")
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "true"],
                      capture_output=True).returncode != 0:
        return ("cannot make a PID namespace here: the `ray stop` of `ray up`/`ray down` "
                "would kill every Ray on this machine")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ns_processes(ns: str, but: int) -> list[str]:
    """``pid cmdline`` of the live processes of PID namespace ``ns`` but pid ``but``."""
    import psutil
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["pid"] != but and os.readlink(f"/proc/{p.info['pid']}/ns/pid") == ns \
                    and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or ())[:150]}")
        except OSError:
            continue
    return out


def ray_processes(ns: str, but: int) -> list[str]:
    """The Ray (and RayMQ) processes of the namespace: no sshd, no shell."""
    out = []
    for p in ns_processes(ns, but):
        cmd = p.partition(" ")[2]
        if cmd.startswith(("sshd", "bash", "/bin/bash", "sh ", "/bin/sh")):
            continue
        if re.search(r"gcs_server|raylet|/ray/|ray::|raymq", cmd):
            out.append(p)
    return out


def _keys(tmp: str, home: str) -> str:
    """The node's host key and authorized key, and the client key (its path)."""
    os.makedirs(f"{home}/.sshd")
    os.makedirs(f"{home}/.ssh", mode=0o700)
    for path in (f"{home}/.sshd/host_key", f"{tmp}/client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
    shutil.copy(f"{tmp}/client_key.pub", f"{home}/.ssh/authorized_keys")
    with open(f"{home}/.sshd/sshd_config", "w") as f:
        f.write(SSHD_CONFIG)
    return f"{tmp}/client_key"


@pytest.fixture
def node():
    """A one-machine "node" (see the module doc); at the end everything in it is killed."""
    why = _why_not()
    if why:
        pytest.skip(why)
    tmp = tempfile.mkdtemp(prefix="rqup", dir="/tmp")
    home = f"{tmp}/home"
    os.makedirs(f"{tmp}/nsray")
    os.makedirs("/tmp/ray", exist_ok=True)  # the mount point (Ray makes it anyway)
    key = _keys(tmp, home)
    unshare = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "sh", "-c",
         NODE], env={**os.environ, "T": tmp, "REAPER": REAPER}, start_new_session=True)
    import psutil
    deadline = time.monotonic() + 30
    while not (kids := psutil.Process(unshare.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    init = kids[0].pid
    ns = os.readlink(f"/proc/{init}/ns/pid")
    from types import SimpleNamespace
    yield SimpleNamespace(tmp=tmp, init=init, ns=ns, key=key,
                          proxy=f"nsenter --target {init} --pid --mount "
                                f"{shutil.which('sshd', path='/usr/sbin:/sbin')} -i "
                                "-f /root/.sshd/sshd_config")
    os.kill(init, signal.SIGKILL)  # the namespace's pid 1: the kernel kills all the rest
    unshare.wait(timeout=60)
    deadline = time.monotonic() + 30
    while ns_processes(ns, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    shutil.rmtree(tmp, ignore_errors=True)


def cluster_file(node, port: int) -> tuple[str, int, str]:
    """The one-node copy of ray_config.yaml, the number of shards it places, its name."""
    with open(os.path.join(ROOT, "ray_config.yaml")) as f:
        cfg = yaml.safe_load(f)
    token = f"{node.tmp}/auth_token"
    with open(token, "w") as f:
        f.write(uuid.uuid4().hex)
    cfg["cluster_name"] = f"raymq-test-{uuid.uuid4().hex[:8]}"
    cfg["max_workers"] = 0
    cfg["provider"] = {**cfg["provider"], "head_ip": "127.0.0.1", "worker_ips": []}
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": node.key,
                   "ssh_proxy_command": node.proxy}
    cfg["file_mounts"] = {remote: token if remote.endswith("auth_token") else local
                          for remote, local in cfg["file_mounts"].items()}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cfg[key] = [re.sub(r'RAYMQ_NODES="[^"]*"', 'RAYMQ_NODES="127.0.0.1"', c)
                    .replace("6379", str(port)) for c in cfg[key]]
    [shards] = {int(n) for c in cfg["head_start_ray_commands"]
                for n in re.findall(r"RAYMQ_SHARDS=(\d+)", c)}
    path = f"{node.tmp}/cluster.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path, shards, cfg["cluster_name"]


def ssh_control_dir(cluster_name: str) -> str:
    """Where Ray's ssh keeps its control sockets for this cluster (a directory per name)."""
    import getpass
    import hashlib
    user, name = (hashlib.sha256(s.encode()).hexdigest()[:10]
                  for s in (getpass.getuser(), cluster_name))
    return f"/tmp/ray_ssh_{user}/{name}"


def ray_cli(*args, timeout_s: float = 600, tmp: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # `ray up`'s own files (the local provider's state, its config cache) stay the test's
    env["RAY_TMPDIR"] = env["TMPDIR"] = f"{tmp}/hostray"
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    return subprocess.run([RAY, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture
def sentinel():
    """A process outside the node that any `ray stop` able to see it would stop: its
    command line has ``monitor.py``, one of the names `ray stop` looks for."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)",
                             "raymq-sentinel/monitor.py"])
    yield proc
    proc.kill()
    proc.wait()


def test_ray_up_exec_and_down_on_one_local_node(node, sentinel):
    port = free_port()
    path, shards, name = cluster_file(node, port)
    out = {}
    try:
        up = ray_cli("up", "-y", "--no-config-cache", path, timeout_s=1500, tmp=node.tmp)
        out["up"] = up
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        out["exec"] = ray_cli("exec", path, "raymq up && raymq status", tmp=node.tmp)
        away = f"RAY_ADDRESS=127.0.0.1:{port}"  # a client given the address, as away from the head
        out["away"] = ray_cli("exec", path, f"{away} raymq status", tmp=node.tmp)
        out["away_token"] = ray_cli("exec", path, f"{away} RAY_AUTH_MODE=token raymq status",
                                    tmp=node.tmp)
        running = ray_processes(node.ns, node.init)
    finally:
        out["down"] = ray_cli("down", "-y", path, tmp=node.tmp)
        shutil.rmtree(ssh_control_dir(name), ignore_errors=True)
    deadline = time.monotonic() + 40
    while (left := ray_processes(node.ns, node.init)) and time.monotonic() < deadline:
        time.sleep(1)
    text = {k: (v.stdout + v.stderr)[-3000:] for k, v in out.items()}
    assert len(running) >= 3, running  # Ray ran in the node: gcs_server, raylet, shards...
    problems = []  # all of them, so that one run shows every one
    if out["exec"].returncode != 0 or f"shards: {shards}" not in out["exec"].stdout:
        problems.append(f"`raymq up && raymq status` (shards: {shards} expected):\n{text['exec']}")
    if out["away"].returncode == 0 or "RAY_AUTH_MODE=token" not in text["away"]:
        problems.append(f"a client without RAY_AUTH_MODE=token got in, or no fix said:\n"
                        f"{text['away']}")
    if out["away_token"].returncode != 0:
        problems.append(f"a client with RAY_AUTH_MODE=token and the token:\n{text['away_token']}")
    if out["down"].returncode != 0 or left:
        problems.append("`ray down` left these running:\n" + "\n".join(left) + text["down"])
    assert problems == [], "\n\n".join(problems)
    assert sentinel.poll() is None, "a `ray stop` reached a process outside the node"
