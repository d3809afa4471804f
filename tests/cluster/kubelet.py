"""The kubelet's part: run a planned Ray pod as real processes, probe it, and delete it.

A pod is its container's command, started in the pod's own network namespace (network.py) and
its own mount namespace, where the pod's volumes are mounted at their rendered paths as kubelet
mounts them: emptyDirs (a tmpfs of the rendered size for `medium: Memory`, such as /dev/shm),
ConfigMaps and Secrets in kubelet's layout (the files are links through `..data` to a
timestamped directory, and an update swaps `..data` in one rename). It runs as the rendered
`runAsUser` / `runAsGroup` with exactly the container's env: the rendered variables, those
KubeRay adds (kuberay.py) and the image's own (the Dockerfile's `cpu` stage), where the image's
virtualenv and prepared model are this checkout's `.venv` and model cache (the cache is mounted at
the image's path). Probes and the preStop hook run inside the pod's namespaces, as kubelet's
exec probes and hooks do. Deleting a pod runs its preStop, sends SIGTERM, waits out
`terminationGracePeriodSeconds`, then kills what is left.

Cluster DNS is the hosts file every pod mounts (network.ClusterDNS). A pod's CPU request and memory
limit are its cgroups' (cgroup v1, where this machine has it), as kubelet sets them. Not shown
here: the image itself (its file system, the read-only root, the login shell's PATH), scheduling,
persistent volumes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from kubernetes.utils import parse_quantity

from tests.cluster.kuberay import PodPlan, Probe, quantity_bytes
from tests.cluster.network import Endpoint
from tests.deploy.conftest import ROOT
from tests.deploy.dockerfile import Dockerfile

VENV_BIN = Path(sys.executable).parent
# The image's paths of what this checkout provides instead.
IMAGE_VENV = "/opt/venv"
IMAGE_CACHE = "/opt/specserve/cache"
# The head pod's processes, against the workers' 0 (Pod.start).
HEAD_NICENESS = "-10"
# kubelet weighs each pod's CPU by its requests: a cgroup per pod with `cpu.shares` of
# milliCPU x 1024 / 1000 (cgroup v1), whatever number of threads or sessions its processes
# have. Without it the kernel weighs every session alike (autogroup), niceness counts only
# within a session, and a new head's processes got 3-15 % of a core each beside streaming
# engines: its dashboard agent missed the raylet's 15 s at every start. Weighed by its request
# alone, one pod in five on two cores, a new head still took 23 s: its start is a burst of
# processes (GCS, raylet, dashboard, monitors, agents) that its own 2 CPUs would take in
# a few seconds. The head's weight is raised so that it gets the cores first, as its own would;
# so is every pod's while its container starts (until its startup probe passes): a NewCluster
# roll's new worker, weighed by its request beside the old cluster's streaming engines, missed
# Ray's fixed 30 s for its raylet to register three starts in a row.
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu/specserve-pods")
RAISED_CPU_WEIGHT = 32
# kubelet also puts each pod in a memory cgroup of its limit, and the container sees that cgroup
# as its /sys/fs/cgroup/memory: Ray's memory monitor reads its node's total and use there. Without
# it every pod's Ray took the whole machine for its node, and when two clusters shared it (a
# NewCluster roll) each killed its own engines for the other's memory.
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory/specserve-pods")


def cpu_shares(quantity: str) -> int:
    """kubelet's `cpu.shares` for a CPU request ("2", "500m")."""
    milli = int(parse_quantity(quantity) * 1000)
    return max(2, milli * 1024 // 1000)


def image_env(model_cache: Path) -> dict[str, str]:
    """The Dockerfile `cpu` stage's environment, its virtualenv and cache made this checkout's."""
    dockerfile = Dockerfile.parse((ROOT / "Dockerfile").read_text())
    stage = dockerfile.stage("cpu")
    assert stage is not None
    env = dockerfile.env(stage)
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["PATH"] = f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env.get("SPECSERVE_CACHE_DIR") == IMAGE_CACHE, "the image's model cache moved"
    return env


def write_atomic_volume(directory: Path, files: dict[str, str], uid: int, gid: int) -> None:
    """kubelet's ConfigMap / Secret volume layout: the data in a new timestamped directory,
    `..data` switched to it by one rename, and each file a link through `..data`."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("..%Y_%m_%d_%H_%M_%S.%f")
    payload = directory / stamp
    payload.mkdir()
    for name, text in files.items():
        (payload / name).write_text(text)
        (payload / name).chmod(0o644)
    os.chown(payload, uid, gid)
    old = (directory / "..data").resolve() if (directory / "..data").exists() else None
    tmp_link = directory / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    tmp_link.symlink_to(stamp)
    tmp_link.rename(directory / "..data")
    for name in files:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    if old is not None and old.name != stamp:
        subprocess.run(["rm", "-rf", str(old)], check=False)


@dataclass
class Claim:
    """A PersistentVolumeClaim's volume, played by a local directory. `ownership`: whether its
    volume type lets kubelet apply the pod's fsGroup (block storage does; NFS-style file
    storage does not, and keeps its server's owner and mode)."""

    path: Path
    ownership: bool = False

    def apply_fs_group(self, gid: int) -> None:
        """kubelet's fsGroup with `fsGroupChangePolicy: OnRootMismatch`: when the volume's root
        is not the group's already, every file is given the group, group read-write, and each
        directory the setgid bit."""
        if self.path.stat().st_gid == gid:
            return
        for path in [self.path, *self.path.rglob("*")]:
            os.chown(path, -1, gid)
            mode = path.stat().st_mode | 0o060
            os.chmod(path, mode | (0o2010 if path.is_dir() else 0))


class Pod:
    def __init__(
        self,
        plan: PodPlan,
        endpoint: Endpoint,
        root: Path,
        *,
        env: dict[str, str],
        config_maps: dict[str, dict[str, str]],
        secrets: dict[str, dict[str, str]],
        security: dict[str, Any],
        model_cache: Path,
        hosts: Path,
        claims: dict[str, Claim] | None = None,
    ) -> None:
        self.plan, self.endpoint, self.env = plan, endpoint, env
        self.hosts = hosts
        self.config_maps, self.secrets, self.security = config_maps, secrets, security
        self.dir = root / plan.name
        self.uid = int(security.get("runAsUser", 0))
        self.gid = int(security.get("runAsGroup", self.uid))
        self.model_cache = model_cache
        self.fs_group = security.get("fsGroup")
        self.claims = claims or {}
        self.volume_dirs: dict[str, Path] = {}
        self._lay_out_volumes(config_maps, secrets)
        self.mounts = self._mount_lines(plan.container)  # the Ray container's
        self.process: subprocess.Popen | None = None
        self.prober: Prober | None = None
        self.log = self.dir / "container.log"

    # -- volumes -----------------------------------------------------------------------------

    def _lay_out_volumes(self, config_maps, secrets) -> None:
        """Each of the pod's volumes made once, as kubelet makes it before any container
        starts: emptyDirs, ConfigMaps and Secrets as directories of this pod, a claim as its
        directory (with the pod's fsGroup applied where its volume type lets kubelet)."""
        for volume in self.plan.volumes:
            name, path = volume["name"], self.dir / "volumes" / volume["name"]
            if "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
                continue  # a tmpfs, mounted in each container's namespace
            if "emptyDir" in volume:
                path.mkdir(parents=True, exist_ok=True)
                os.chown(path, self.uid, self.gid)
            elif "configMap" in volume:
                write_atomic_volume(
                    path, config_maps[volume["configMap"]["name"]], self.uid, self.gid
                )
            elif "secret" in volume:
                write_atomic_volume(
                    path, secrets[volume["secret"]["secretName"]], self.uid, self.gid
                )
            elif "persistentVolumeClaim" in volume:
                claim = self.claims[volume["persistentVolumeClaim"]["claimName"]]
                if claim.ownership and self.fs_group is not None:
                    claim.apply_fs_group(self.fs_group)
                path = claim.path
            else:
                raise NotImplementedError(f"volume {name}: {sorted(volume)} not played here")
            self.volume_dirs[name] = path

    def _mount_lines(self, container: dict[str, Any]) -> list[str]:
        """Shell lines that mount a container's volumeMounts in its mount namespace."""
        volumes = {v["name"]: v for v in self.plan.volumes}
        mounts = sorted(container.get("volumeMounts", []), key=lambda m: m["mountPath"])
        lines = []
        for mount in mounts:
            volume, target = volumes[mount["name"]], shlex.quote(mount["mountPath"])
            if "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
                size = volume["emptyDir"].get("sizeLimit")
                option = f"-o size={quantity_bytes(size)}" if size else ""
                lines += [f"mount -t tmpfs {option} tmpfs {target}",
                          f"chown {self.uid}:{self.gid} {target}"]  # fmt: skip
                continue
            self._mount_point(mount["mountPath"], mounts)
            source = shlex.quote(str(self.volume_dirs[volume["name"]]))
            lines.append(f"mount --bind {source} {target}")
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {target}")
        return lines

    def _image_mounts(self) -> list[str]:
        """This checkout standing in for the image's files: the prepared model at the image's
        cache path, the cluster's hosts file, and the interpreter the virtualenv links to (here
        under root's home, which uid 1000 may not enter: the pod sees an empty home with only
        the interpreter in it)."""
        Path(IMAGE_CACHE).mkdir(parents=True, exist_ok=True)
        python = Path(os.path.realpath(VENV_BIN / "python3"))
        lines = [
            f"mount --bind {shlex.quote(str(self.model_cache))} {IMAGE_CACHE}",
            f"mount --bind {shlex.quote(str(self.hosts))} /etc/hosts",  # kubelet's, cluster DNS
        ]
        home = Path.home()
        if home in python.parents:
            top = home / python.relative_to(home).parts[0]  # e.g. ~/.pyenv
            held = self.dir / "interpreter"
            held.mkdir(parents=True, exist_ok=True)
            lines += [
                f"mount --bind {shlex.quote(str(top))} {shlex.quote(str(held))}",
                f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(home))}",
                f"mkdir {shlex.quote(str(top))}",
                f"mount --move {shlex.quote(str(held))} {shlex.quote(str(top))}",
            ]
        return lines

    def _cgroup_mounts(self) -> list[str]:
        """The pod's memory cgroup as the container's /sys/fs/cgroup/memory (`ip netns exec`
        mounts a sysfs of its own, without the machine's cgroup mounts)."""
        path = MEMORY_CGROUPS / self.plan.name
        if not path.is_dir():
            return []
        return [
            "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup",
            "mkdir /sys/fs/cgroup/memory",
            "mount -t cgroup -o memory memory /sys/fs/cgroup/memory",
            f"mount --bind {shlex.quote(str(path))} /sys/fs/cgroup/memory",
        ]

    def _mount_point(self, target: str, mounts: list[dict[str, Any]]) -> None:
        """A nested mount's point inside its parent volume (the runtime creates it there); a
        top-level one on the host, where the pod's mount namespace covers it."""
        for mount in mounts:
            parent = mount["mountPath"]
            if target.startswith(parent.rstrip("/") + "/") and mount["name"] in self.volume_dirs:
                path = self.volume_dirs[mount["name"]]
                (path / Path(target).relative_to(parent)).mkdir(parents=True, exist_ok=True)
                return
        Path(target).mkdir(parents=True, exist_ok=True)

    def update_volume(self, name: str, files: dict[str, str]) -> None:
        """kubelet's update of a mounted ConfigMap or Secret."""
        write_atomic_volume(self.volume_dirs[name], files, self.uid, self.gid)

    # -- processes ---------------------------------------------------------------------------

    def in_pod(
        self, command: str, *, mounts: list[str] | None = None, env: dict[str, str] | None = None
    ) -> list[str]:
        """argv running a shell command inside this pod: its network namespace, a mount
        namespace with the Ray container's volumes (or `mounts`), its user, exactly its env (or
        `env`)."""
        env_words = " ".join(shlex.quote(f"{k}={v}") for k, v in (env or self.env).items())
        user = f"setpriv --reuid={self.uid} --regid={self.gid} --clear-groups"
        script = "\n".join(
            [
                "set -e",
                *self._cgroup_mounts(),
                *self._image_mounts(),
                *(self.mounts if mounts is None else mounts),
                f"cd {shlex.quote((env or self.env).get('HOME', '/'))}",
                f"exec {user} env -i {env_words} bash -c {shlex.quote(command)}",
            ]
        )
        return [
            "ip", "netns", "exec", self.endpoint.netns,
            "unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script,
        ]  # fmt: skip

    def run_init_containers(self, image_env: dict[str, str]) -> subprocess.CompletedProcess | None:
        """kubelet's init containers, in order, each run to its end before the next, with its
        own volumeMounts and env (the image's, then its own); the first that fails is returned:
        the pod stays in Init:Error and its Ray container never starts. None when all pass."""
        for container in self.plan.init_containers:
            env = dict(image_env)
            env |= {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
            command = shlex.join([*container.get("command", []), *container.get("args", [])])
            argv = self.in_pod(command, mounts=self._mount_lines(container), env=env)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                return done
        return None

    def start(self, command: str) -> None:
        self.command = command
        self.dir.mkdir(parents=True, exist_ok=True)
        log = self.log.open("ab")
        cgroups = [c for c in (self._cpu_cgroup(), self._memory_cgroup()) if c is not None]
        argv = self.in_pod(command)
        if self.plan.head:
            # On a cluster the head pod has CPUs of its own (its requests). Here five pods share
            # two cores with busy engines. Niceness only counts against processes outside the
            # head's session and cgroup: on a machine with neither the CPU cgroup (below) nor
            # the kernel's grouping by session (autogroup), it gives the head the CPU first.
            argv = ["nice", "-n", HEAD_NICENESS, *argv]
        if cgroups:  # the container's processes are born in its pod's cgroups
            procs = [shlex.quote(str(c / "cgroup.procs")) for c in cgroups]
            joins = " && ".join(f"echo $$ > {p}" for p in procs)
            argv = ["sh", "-c", f'{joins} && exec "$@"', "sh", *argv]
        self.process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _cpu_cgroup(self) -> Path | None:
        """The pod's CPU cgroup, weighted by its CPU request; None where cgroup v1's cpu
        controller cannot be written (then the kernel's default weighs it)."""
        if self._cpu_request() is None:
            return None
        path = CPU_CGROUPS / self.plan.name
        if not (CPU_CGROUPS.parent / "cpu.shares").exists():  # no cgroup v1 cpu controller
            print(f"{self.plan.name}: no CPU weight from its request (no {CPU_CGROUPS.parent})")
            return None
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.weigh_cpu(starting=True)
        except OSError as error:
            print(f"{self.plan.name}: no CPU weight from its request ({error})")
            return None
        return path

    def _cpu_request(self) -> str | None:
        return self.plan.container.get("resources", {}).get("requests", {}).get("cpu")

    def weigh_cpu(self, starting: bool) -> None:
        """The pod's `cpu.shares`: its request's, raised for the head and while it starts."""
        request = self._cpu_request()
        shares = CPU_CGROUPS / self.plan.name / "cpu.shares"
        if request is None or not shares.parent.is_dir():  # no CPU cgroup (_cpu_cgroup)
            return
        weight = RAISED_CPU_WEIGHT if self.plan.head or starting else 1
        shares.write_text(str(cpu_shares(str(request)) * weight))

    def _memory_cgroup(self) -> Path | None:
        """The pod's memory cgroup, limited to its memory limit; None where it has none or
        cgroup v1's memory controller cannot be written."""
        limit = self.plan.container.get("resources", {}).get("limits", {}).get("memory")
        if limit is None:
            return None
        path = MEMORY_CGROUPS / self.plan.name
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "memory.limit_in_bytes").write_text(str(quantity_bytes(str(limit))))
        except OSError as error:
            print(f"{self.plan.name}: no memory limit ({error})")
            return None
        return path

    def _remove_cgroups(self) -> None:
        """The pod's cgroups, once the last of its killed processes has left them (waits five
        seconds at most; an empty cgroup left behind holds nothing)."""
        for path in (CPU_CGROUPS / self.plan.name, MEMORY_CGROUPS / self.plan.name):
            for _ in range(20):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy: a process still exiting
                    time.sleep(0.25)

    def exec(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """What `kubectl exec`, exec probes and hooks run: the command in the running container's
        namespaces (the runtime enters them; nothing is mounted again), as its user, with its
        env. Raises subprocess.TimeoutExpired past `timeout`."""
        pid = self.container_pid()
        if pid is None:  # not running: a fresh pod view of its volumes
            argv_in = self.in_pod(shlex.join(argv))
        else:
            env = [f"{k}={v}" for k, v in self.env.items()]
            argv_in = [
                "nsenter", f"--target={pid}", "--net", "--mount",
                "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                "env", "-i", *env, *argv,
            ]  # fmt: skip
        return subprocess.run(argv_in, capture_output=True, text=True, timeout=timeout)

    def container_pid(self) -> int | None:
        """The container's main process (the `ip netns exec` we started execs into it)."""
        if self.process is None or self.process.poll() is not None:
            return None
        return self.process.pid

    def check(self, probe: Probe) -> tuple[bool, str]:
        """One run of a probe as kubelet makes it: an HTTP GET from the node to the pod's
        address (2xx/3xx passes), or a command in the container (exit 0 passes); either within
        the probe's timeout."""
        if probe.command is None:
            url = f"http://{self.endpoint.ip}:{probe.http_port}{probe.http_path}"
            argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                    "-m", str(probe.timeout_s), url]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, timeout=probe.timeout_s + 5)
            code = int(done.stdout or 0)
            return 200 <= code < 400, f"GET {url}: {code or 'no answer'}"
        try:
            done = self.exec(probe.command, timeout=probe.timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"{shlex.join(probe.command)}: timed out after {probe.timeout_s} s"
        if done.returncode != 0:
            return (
                False,
                f"{shlex.join(probe.command)}: exit {done.returncode} {done.stderr[-300:]}",
            )
        return True, ""

    def start_probing(self) -> None:
        """kubelet's probe workers for this pod (startup first, then liveness and readiness)."""
        self.prober = Prober(self)
        self.prober.start()

    def processes(self) -> list[psutil.Process]:
        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def all_processes(self) -> list[psutil.Process]:
        """Every process of the pod: those in its network namespace (Ray daemonizes some of its
        own) and the container command's tree."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.endpoint.netns], capture_output=True, text=True
        ).stdout.split()
        found = {p.pid: p for p in self.processes()}
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                found.setdefault(int(pid), psutil.Process(int(pid)))
        return list(found.values())

    def delete(self, *, pre_stop: bool = True) -> dict[str, float]:
        """kubelet's pod deletion: the preStop hook, SIGTERM, the grace period, SIGKILL. Returns
        how long each part took."""
        took: dict[str, float] = {}
        started = time.monotonic()
        if self.prober is not None:
            self.prober.stop()
        hook = (self.plan.container.get("lifecycle") or {}).get("preStop", {}).get("exec")
        if pre_stop and hook:
            done = self.exec(hook["command"], timeout=self.plan.grace_s)
            (self.dir / "prestop.log").write_text(done.stdout + done.stderr)
            took["pre_stop_s"] = time.monotonic() - started
        for process in self.all_processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGTERM)
        left = max(0.0, self.plan.grace_s - (time.monotonic() - started))
        _, alive = psutil.wait_procs(self.all_processes(), timeout=left)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(self.all_processes(), timeout=10)
        self._remove_cgroups()
        took["total_s"] = time.monotonic() - started
        return took

    def kill(self) -> None:
        if self.prober is not None:
            self.prober.stop()
        self.kill_processes()
        self._remove_cgroups()

    def kill_processes(self) -> None:
        for process in self.all_processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(self.all_processes(), timeout=10)


class Prober(threading.Thread):
    """kubelet's care of one pod's Ray container (restartPolicy Always): it probes on the probes'
    own periods, and until the startup probe passes no other runs; readiness then sets `ready`
    (one pass makes it Ready, `failure_threshold` failures in a row NotReady); liveness counts
    its failures in a row, and reaching its threshold is recorded in `restarts` (kubelet would
    restart the container; the tests assert it never does). A container that exits is started
    again after kubelet's back-off (10 s, doubling up to 5 min), its time kept in `exits`."""

    def __init__(self, pod: Pod) -> None:
        super().__init__(name=f"prober-{pod.plan.name}", daemon=True)
        self.pod = pod
        self.probes = pod.plan.probes()
        self.restarts: list[str] = []
        self.exits: list[float] = []
        self._stop = threading.Event()
        self._container_started()

    def _container_started(self) -> None:
        self.ready = False
        self.started = "startup" not in self.probes
        if self.started:  # no startup probe: started as soon as it runs
            with contextlib.suppress(OSError):
                self.pod.weigh_cpu(starting=False)
        self._failures: dict[str, int] = {}
        begun = time.monotonic()
        self._due = {kind: begun + p.initial_delay_s for kind, p in self.probes.items()}

    def _restart_if_exited(self) -> None:
        process = self.pod.process
        if process is None or process.poll() is None:
            return
        self.exits.append(time.time())
        self.ready = False
        # The runtime ends a container with its main process: whatever it left running (Ray
        # daemonizes its GCS, agents and monitors) goes with it, and the restart starts clean.
        self.pod.kill_processes()
        back_off = min(10 * 2 ** (len(self.exits) - 1), 300)
        if self._stop.wait(back_off):
            return
        self.pod.start(self.pod.command)
        self._container_started()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self._restart_if_exited()
            now = time.monotonic()
            for kind in ("startup", "liveness", "readiness"):
                probe = self.probes.get(kind)
                if probe is None or now < self._due[kind] or (kind != "startup") != self.started:
                    continue
                self._due[kind] = now + probe.period_s
                try:
                    ok, why = self.pod.check(probe)
                except (subprocess.SubprocessError, OSError) as error:
                    ok, why = False, repr(error)
                self._record(kind, probe, ok, why)
            self._stop.wait(0.5)

    def _record(self, kind: str, probe: Probe, ok: bool, why: str) -> None:
        failures = 0 if ok else self._failures.get(kind, 0) + 1
        self._failures[kind] = failures
        if kind == "startup" and ok:
            self.started = True
            with contextlib.suppress(OSError):
                self.pod.weigh_cpu(starting=False)
        elif kind == "readiness":
            if ok:
                self.ready = True
            elif failures >= probe.failure_threshold:
                self.ready = False
        elif not ok and failures >= probe.failure_threshold:
            self.restarts.append(f"{kind}: {why}")
            self._failures[kind] = 0
