"""A real one-node Kubernetes on loopback for chaosgpu's tests: etcd, kube-apiserver, containerd
with runc, and a registered kubelet.

    python -m tests.k8s.real.cluster up|down|status|build

What it owns, all under tests/k8s/real/.build/ (ignored by git):

- `bin/`: etcd, kube-apiserver and kubelet built from the wrapper module node/ with
  `go build -trimpath`, reused while the hash of go.mod, go.sum and node/cmd/ is unchanged;
- `debs/`, `root/`: containerd (2.x, Debian sid), runc and busybox-static (Debian bookworm),
  fetched with a private apt configuration (own sources list, lists and cache: the system's
  sources are not used nor changed) and unpacked with dpkg -x;
- `images/`: the pause and node images (images.py);
- `run/`: this cluster's state (certificates, tokens, etcd data, containerd root/state/socket,
  kubelet root) and `logs/`: the components' journals, kept after teardown.

Everything listens on 127.0.0.1 only. The apiserver runs RBAC (Node,RBAC) with a token file naming
an admin, the runner (the ServiceAccount of experiments/k8s/manifests/runner-rbac.yaml), the agent
and the node. There is no scheduler, controller-manager or CNI: pods set spec.nodeName and
hostNetwork. Teardown stops every process it started, kills what is left of the containers,
unmounts what the runtime and the kubelet mounted, removes the kubelet's cgroups in every
hierarchy, restores the sysctls the kubelet sets, then checks that nothing is left (`leftovers`).
"""

import argparse
import ctypes
import hashlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["AlreadyRunning", "ClusterError", "build_binaries", "build_images", "ctr", "down",
           "fetch_packages", "info", "kubeconfig", "kubernetes_version", "leftovers", "say",
           "source_key", "status", "up"]

HERE = Path(__file__).resolve().parent
BUILD = HERE / ".build"
BIN = BUILD / "bin"
ROOT = BUILD / "root"
RUN = BUILD / "run"
LOGS = BUILD / "logs"
MODULE = HERE / "node"
NODE_NAME = "chaosgpu-node"
ETCD_PORT, ETCD_PEER_PORT = 23790, 23800
API_PORT = 16443
KUBELET_PORT, KUBELET_HEALTHZ_PORT = 20250, 20248
BINARIES = ("etcd", "kube-apiserver", "kubelet")
DEBS = ("containerd/sid", "runc/bookworm", "busybox-static/bookworm")
SOURCES = ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
           "http://deb.debian.org/debian {suite} main\n")
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
                   "kernel/panic_on_oops", "kernel/keys/root_maxkeys",
                   "kernel/keys/root_maxbytes")
SHIM_DIR = Path("/run/containerd")
_STARTED = time.monotonic()


class ClusterError(RuntimeError):
    """The cluster could not be built, started or torn down; the message says which step."""


class AlreadyRunning(ClusterError):
    """up() found this cluster's processes alive (started by hand, or by another session)."""


def say(message: str) -> None:
    """Print one progress line (seconds since this process started)."""
    print(f"[k8s-real {time.monotonic() - _STARTED:6.1f}s] {message}", flush=True)


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(argv[:3])}... exited {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-2000:]}")
    return done


# -- build ------------------------------------------------------------------------------------

def kubernetes_version() -> str:
    """The k8s.io/kubernetes version the wrapper module requires (from node/go.mod)."""
    for line in (MODULE / "go.mod").read_text().splitlines():
        parts = line.replace("require ", "").split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes" and "=>" not in parts:
            return parts[1]
    raise ClusterError("node/go.mod does not require k8s.io/kubernetes")


def _ldflags() -> str:
    # Without these the binaries report v0.0.0-master (the Kubernetes build sets them).
    version = kubernetes_version()
    major, minor = version.lstrip("v").split(".")[:2]
    package = "k8s.io/component-base/version"
    return (f"-s -w -X {package}.gitVersion={version} -X {package}.gitMajor={major} "
            f"-X {package}.gitMinor={minor} -X {package}.gitTreeState=clean")


def source_key() -> str:
    """Hash of what the binaries are built from: go.mod, go.sum, every file under node/cmd and
    the linker flags."""
    digest = hashlib.sha256(_ldflags().encode())
    files = [MODULE / "go.mod", MODULE / "go.sum"] + sorted(
        p for p in (MODULE / "cmd").rglob("*") if p.is_file())
    for path in files:
        digest.update(str(path.relative_to(MODULE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_binaries() -> dict[str, Any]:
    """Build etcd, kube-apiserver and kubelet into bin/ unless the cached ones match source_key."""
    key = source_key()
    stamp = BIN / "build.json"
    if stamp.exists() and all((BIN / name).exists() for name in BINARIES):
        record = json.loads(stamp.read_text())
        if record.get("key") == key:
            say(f"binaries: cached (built in {record.get('seconds')} s)")
            return {**record, "cached": True}
    if not shutil.which("go"):
        raise ClusterError("binaries: `go` is not on PATH and bin/ holds no matching build")
    BIN.mkdir(parents=True, exist_ok=True)
    say("binaries: go build -trimpath ./cmd/... (cold: several minutes)")
    started = time.monotonic()
    env = dict(os.environ, CGO_ENABLED="0")
    _run(["go", "build", "-trimpath", f"-ldflags={_ldflags()}", "-o", str(BIN) + "/",
          "./cmd/..."], cwd=MODULE, env=env)
    record = {"key": key, "seconds": round(time.monotonic() - started, 1),
              "go": _run(["go", "version"]).stdout.strip()}
    stamp.write_text(json.dumps(record, indent=1))
    say(f"binaries: built in {record['seconds']} s")
    return {**record, "cached": False}


def fetch_packages() -> dict[str, str]:
    """Fetch containerd, runc and busybox-static with a private apt configuration, unpack them
    into root/ (reused when already there); return {package: version}."""
    versions_file = BUILD / "packages.json"
    wanted = [ROOT / "usr/bin/containerd", ROOT / "usr/sbin/runc", ROOT / "bin/busybox"]
    if versions_file.exists() and all(p.exists() for p in wanted):
        versions: dict[str, str] = json.loads(versions_file.read_text())
        say(f"packages: cached {versions}")
        return versions
    apt = BUILD / "apt"
    for folder in ("lists/partial", "cache/archives/partial", "etc"):
        (apt / folder).mkdir(parents=True, exist_ok=True)
    sources = apt / "etc/sources.list"
    sources.write_text("".join(SOURCES.format(suite=s) for s in ("sid", "bookworm")))
    options = ["-o", f"Dir::Etc::SourceList={sources}", "-o", "Dir::Etc::SourceParts=/nonexistent",
               "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
               "-o", "APT::Sandbox::User=root", "-qq"]
    say("packages: apt-get update (private sources list: sid, bookworm)")
    _run(["apt-get", *options, "update"])
    debs = BUILD / "debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir()
    say(f"packages: apt-get download {' '.join(DEBS)}")
    _run(["apt-get", *options, "download", *DEBS], cwd=debs)
    shutil.rmtree(ROOT, ignore_errors=True)
    versions = {}
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(ROOT)])
        fields = _run(["dpkg-deb", "-f", str(deb), "Package", "Version"]).stdout.split("\n")
        versions[fields[0].split(": ")[1]] = fields[1].split(": ")[1]
    if not versions.get("containerd", "").startswith("2."):
        raise ClusterError(f"packages: expected containerd 2.x from sid, got {versions}")
    versions_file.write_text(json.dumps(versions, indent=1))
    return versions


def build_images() -> dict[str, Any]:
    """Build (or reuse) the pause and node image archives."""
    from . import images

    return images.build(BUILD / "images", ROOT / "bin/busybox")


# -- certificates, tokens, configuration -----------------------------------------------------

def _openssl(*args: str) -> None:
    _run(["openssl", *args])


def _certificates(pki: Path) -> None:
    pki.mkdir(parents=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=chaosgpu-test-ca", "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"))
    for name, subject, extensions in (
            ("apiserver", "/CN=kube-apiserver",
             "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n"
             "extendedKeyUsage=serverAuth"),
            ("kubelet", f"/CN={NODE_NAME}",
             "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
            ("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
             "extendedKeyUsage=clientAuth")):
        (pki / f"{name}.ext").write_text(extensions + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                 "-keyout", str(pki / f"{name}.key"), "-out", str(pki / f"{name}.csr"))
        _openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"),
                 "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "2",
                 "-extfile", str(pki / f"{name}.ext"), "-out", str(pki / f"{name}.crt"))
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


RUNNER_USER = "system:serviceaccount:chaosgpu-experiments:chaosgpu-runner"
AGENT_USER = "system:serviceaccount:chaosgpu-system:chaosgpu-agent"


def _tokens(path: Path) -> dict[str, str]:
    users = {"admin": ("chaosgpu-admin", "system:masters"),
             "runner": (RUNNER_USER, "system:serviceaccounts,"
                        "system:serviceaccounts:chaosgpu-experiments"),
             "agent": (AGENT_USER, "system:serviceaccounts,system:serviceaccounts:chaosgpu-system"),
             "node": (f"system:node:{NODE_NAME}", "system:nodes")}
    tokens = {role: secrets.token_urlsafe(24) for role in users}
    path.write_text("".join(f'{tokens[r]},{u},{r}-uid,"{g}"\n' for r, (u, g) in users.items()))
    path.chmod(0o600)
    return tokens


def kubeconfig(path: Path, token: str, ca: Path, user: str = "user") -> Path:
    """Write a kubeconfig for the apiserver on loopback, authenticating with `token`."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "real",
        "clusters": [{"name": "real", "cluster": {
            "server": f"https://127.0.0.1:{API_PORT}", "certificate-authority": str(ca)}}],
        "contexts": [{"name": "real", "context": {"cluster": "real", "user": user}}],
        "users": [{"name": user, "user": {"token": token}}]}, indent=1))
    path.chmod(0o600)
    return path


def _containerd_config(run: Path) -> str:
    cni = run / "cni"
    (cni / "net.d").mkdir(parents=True, exist_ok=True)
    return f"""version = 3
root = '{run}/containerd/root'
state = '{run}/containerd/state'
[grpc]
  address = '{run}/containerd.sock'
[ttrpc]
  address = ''
[debug]
  address = ''
[metrics]
  address = ''
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'chaosgpu.test/pause:1'
  [plugins.'io.containerd.cri.v1.runtime']
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{ROOT}/usr/sbin/runc'
          Root = '{run}/runc'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{cni}/bin']
      conf_dir = '{cni}/net.d'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
"""


def _kubelet_config(run: Path) -> str:
    return json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": "127.0.0.1", "port": KUBELET_PORT, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": KUBELET_HEALTHZ_PORT,
        "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{run}/containerd.sock",
        "tlsCertFile": str(run / "pki/kubelet.crt"),
        "tlsPrivateKeyFile": str(run / "pki/kubelet.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(run / "pki/ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},
        "podLogsDir": str(run / "pod-logs"),
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "24h",
        "syncFrequency": "5s", "nodeStatusUpdateFrequency": "5s",
        "serializeImagePulls": False, "resolvConf": "/etc/resolv.conf",
        "hairpinMode": "none", "registerNode": True,
    }, indent=1)


# -- processes ---------------------------------------------------------------------------------

def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _records() -> dict[str, dict[str, int]]:
    path = RUN / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _start(name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{name}.log", "ab")  # noqa: SIM115 - kept open by the child
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               env={k: v for k, v in (env or os.environ).items()
                                    if k != "CHAOSGPU_TEST_ID"})
    log.close()
    records = _records()
    records[name] = {"pid": process.pid, "start_time": _start_time(process.pid) or 0}
    (RUN / "pids.json").write_text(json.dumps(records, indent=1))
    say(f"{name}: started (pid {process.pid}, log logs/{name}.log)")
    return process.pid


def _alive(record: dict[str, int]) -> bool:
    start = _start_time(record["pid"])
    if start is None or start != record["start_time"]:
        return False
    try:
        with open(f"/proc/{record['pid']}/stat", "rb") as handle:
            stat = handle.read()
        if stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z":
            return True
        # A Go program's main thread is Z while its other threads still run (and may still
        # act: the kubelet recreates its cgroups): alive until the last thread is gone.
        return len(os.listdir(f"/proc/{record['pid']}/task")) > 1
    except OSError:
        return False


def _signal(record: dict[str, int], signum: int) -> None:
    """Signal a recorded process through a pidfd after checking its start time."""
    try:
        fd = os.pidfd_open(record["pid"])
    except ProcessLookupError:
        return
    try:
        if _start_time(record["pid"]) == record["start_time"]:
            signal.pidfd_send_signal(fd, signum)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _stop(name: str, grace: float = 10.0) -> None:
    record = _records().get(name)
    if not record:
        return
    if not _alive(record):
        _reap(record)
        return
    _signal(record, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(record) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(record):
        say(f"{name}: still alive {grace:g} s after SIGTERM: SIGKILL")
        _signal(record, signal.SIGKILL)
        while _alive(record):
            time.sleep(0.05)
    _reap(record)
    say(f"{name}: stopped")


def _reap(record: dict[str, int]) -> None:
    """Collect the exit status of a stopped process of ours, so no zombie stays behind."""
    # A Go program's main thread shows Z while its other threads still exit: until they have,
    # waitpid(WNOHANG) returns 0. Poll for a few seconds.
    deadline = time.monotonic() + 10
    while _start_time(record["pid"]) == record["start_time"]:
        try:
            if os.waitpid(record["pid"], os.WNOHANG)[0]:
                return
        except ChildProcessError:
            pass  # not our child (the `up` command exited): init reaps it; wait for that
        if time.monotonic() > deadline:
            say(f"pid {record['pid']}: exited but not reaped after 10 s")
            return
        time.sleep(0.02)


def _wait(what: str, check: Any, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        record = _records().get(log)
        if record and not _alive(record):
            tail = (LOGS / f"{log}.log").read_text(errors="replace")[-3000:]
            raise ClusterError(f"{log} exited while waiting for {what}:\n{tail}")
        try:
            if check():
                say(f"{what}: ready")
                return
        except Exception as error:  # noqa: BLE001 - reported when the wait times out
            last = str(error)
        time.sleep(0.5)
    tail = (LOGS / f"{log}.log").read_text(errors="replace")[-3000:]
    raise ClusterError(f"{what}: not ready after {timeout:g} s ({last}); {log} log:\n{tail}")


def _https(path: str, token: str, ca: Path, method: str = "GET",
           body: dict[str, Any] | None = None,
           content_type: str = "application/json") -> Any:
    context = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(
        f"https://127.0.0.1:{API_PORT}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
    with urllib.request.urlopen(request, context=context, timeout=5) as response:
        text = response.read().decode()
    return json.loads(text) if text.startswith("{") else text


def ctr(*args: str) -> str:
    """Run containerd's ctr against this cluster's containerd, namespace k8s.io."""
    return _run([str(ROOT / "usr/bin/ctr"), "--address", str(RUN / "containerd.sock"),
                 "--namespace", "k8s.io", *args]).stdout


# -- up / down -------------------------------------------------------------------------------

def info() -> dict[str, Any]:
    """Return this cluster's description (URL, CA, tokens, kubeconfigs) written by up()."""
    path = RUN / "cluster.json"
    if not path.exists():
        raise ClusterError("no cluster is up (run `python -m tests.k8s.real.cluster up`)")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def up() -> dict[str, Any]:
    """Build what is missing, start etcd, kube-apiserver, containerd and the kubelet, wait
    until the node is registered and the images imported; return info()."""
    if _records() and any(_alive(r) for r in _records().values()):
        raise AlreadyRunning("a cluster is already running: `down` first")
    if os.geteuid() != 0:
        raise ClusterError("the kubelet and containerd need root")
    started = time.monotonic()
    timings: dict[str, float] = {}
    build = build_binaries()
    timings["binaries_s"] = round(time.monotonic() - started, 1)
    versions = fetch_packages()
    timings["packages_s"] = round(time.monotonic() - started - sum(timings.values()), 1)
    archives = build_images()
    timings["images_s"] = round(time.monotonic() - started - sum(timings.values()), 1)
    left = down(quiet=True)
    if left:
        raise ClusterError(f"an earlier node left things behind: {left}")
    RUN.mkdir(parents=True)
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True)
    sysctls = {name: Path("/proc/sys", name).read_text().strip() for name in KUBELET_SYSCTLS}
    (RUN / "sysctls.json").write_text(json.dumps(sysctls))
    # The runc shim puts its sockets in /run/containerd/s whatever containerd's state dir is.
    (RUN / "host.json").write_text(json.dumps({"shim_dir_existed": SHIM_DIR.exists()}))
    pki = RUN / "pki"
    _certificates(pki)
    tokens = _tokens(RUN / "tokens.csv")
    ca = pki / "ca.crt"
    bring_up = time.monotonic()

    _start("etcd", [str(BIN / "etcd"), "--name", "default", "--data-dir", str(RUN / "etcd"),
                    "--listen-client-urls", f"http://127.0.0.1:{ETCD_PORT}",
                    "--advertise-client-urls", f"http://127.0.0.1:{ETCD_PORT}",
                    "--listen-peer-urls", f"http://127.0.0.1:{ETCD_PEER_PORT}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{ETCD_PEER_PORT}",
                    "--initial-cluster", f"default=http://127.0.0.1:{ETCD_PEER_PORT}",
                    "--listen-metrics-urls", "", "--log-level", "warn"])
    _wait("etcd", lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{ETCD_PORT}/health", timeout=2).status == 200, 60, "etcd")
    _start("kube-apiserver", [
        str(BIN / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
        f"--secure-port={API_PORT}", f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={ca}", f"--token-auth-file={RUN / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC", "--allow-privileged=true",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-cluster-ip-range=10.96.0.0/24", "--endpoint-reconciler-type=none",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={ca}",
        "--kubelet-preferred-address-types=InternalIP", "--profiling=false", "-v=1"])
    _wait("kube-apiserver", lambda: _https("/readyz", tokens["admin"], ca) == "ok", 180,
          "kube-apiserver")
    config = RUN / "containerd.toml"
    config.write_text(_containerd_config(RUN))
    path = f"{ROOT}/usr/bin:{ROOT}/usr/sbin:{os.environ.get('PATH', '/usr/bin:/bin')}"
    _start("containerd", [str(ROOT / "usr/bin/containerd"), "--config", str(config)],
           env=dict(os.environ, PATH=path))
    _wait("containerd", lambda: bool(ctr("version")), 60, "containerd")
    for name, (archive, tags) in archives.items():
        ctr("images", "import", "--label", "io.cri-containerd.pinned=pinned", str(archive))
        say(f"image {name}: imported {', '.join(tags)}")
    (RUN / "kubelet").mkdir()
    kubelet_config = RUN / "kubelet.json"
    kubelet_config.write_text(_kubelet_config(RUN))
    node_kubeconfig = kubeconfig(RUN / "kubelet.kubeconfig", tokens["node"], ca, "node")
    _start("kubelet", [str(BIN / "kubelet"), f"--config={kubelet_config}",
                       f"--kubeconfig={node_kubeconfig}", f"--root-dir={RUN / 'kubelet'}",
                       f"--cert-dir={RUN / 'kubelet/pki'}", f"--hostname-override={NODE_NAME}",
                       "--node-ip=127.0.0.1", "-v=2"], env=dict(os.environ, PATH=path))
    _wait("kubelet registered", lambda: _https(f"/api/v1/nodes/{NODE_NAME}", tokens["admin"],
                                               ca)["metadata"]["name"] == NODE_NAME,
          180, "kubelet")
    _wait("kubelet healthz", lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{KUBELET_HEALTHZ_PORT}/healthz", timeout=2).status == 200,
        60, "kubelet")
    # The kubelet refuses a loopback node IP ("nodeIP can't be loopback address") and then
    # leaves the node's addresses alone: give the node 127.0.0.1 so the apiserver reaches the
    # kubelet (exec, logs) on loopback instead of an address picked from eth0.
    _https(f"/api/v1/nodes/{NODE_NAME}/status", tokens["admin"], ca, method="PATCH",
           body={"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                          {"type": "Hostname", "address": NODE_NAME}]}},
           content_type="application/merge-patch+json")
    timings["bring_up_s"] = round(time.monotonic() - bring_up, 1)
    description = {
        "url": f"https://127.0.0.1:{API_PORT}", "ca": str(ca), "node": NODE_NAME,
        "tokens": tokens, "run": str(RUN), "logs": str(LOGS),
        "kubeconfigs": {role: str(kubeconfig(RUN / f"{role}.kubeconfig", tokens[role], ca, role))
                        for role in ("admin", "runner", "agent")},
        "packages": versions, "binaries": build, "timings": timings,
    }
    (RUN / "cluster.json").write_text(json.dumps(description, indent=1))
    say(f"cluster up in {round(time.monotonic() - started, 1)} s: {timings}")
    return description


def _kubepods_cgroups() -> list[Path]:
    found = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        for candidate in (hierarchy / "kubepods", hierarchy / "kubepods.slice"):
            if candidate.is_dir():
                found.append(candidate)
    return found


def _cgroup_pids(folder: Path) -> list[int]:
    pids = []
    for procs in folder.rglob("cgroup.procs"):
        try:
            pids.extend(int(line) for line in procs.read_text().split())
        except OSError:
            continue
    return pids


def _our_mounts() -> list[str]:
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            point = line.split()[4].replace("\\040", " ")
            if point == str(RUN) or point.startswith(str(RUN) + "/"):
                mounts.append(point)
    return mounts


def _our_processes() -> list[str]:
    found = []
    # Recorded processes that still exist, zombies included (a zombie of ours is a leftover too).
    recorded = {r["pid"] for r in _records().values()
                if _start_time(r["pid"]) == r["start_time"]}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            exe = ""
        if pid in recorded or exe.startswith(str(BUILD) + "/"):
            found.append(f"pid {pid} ({exe})")
    for folder in _kubepods_cgroups():
        found.extend(f"pid {pid} in {folder}" for pid in _cgroup_pids(folder))
    return found


def leftovers() -> list[str]:
    """Everything of this cluster still there: processes, mounts under run/, kubepods cgroups."""
    host = RUN / "host.json"
    shim = (host.exists() and not json.loads(host.read_text())["shim_dir_existed"]
            and SHIM_DIR.exists())
    return (_our_processes() + [f"mount {m}" for m in _our_mounts()]
            + [f"cgroup {c}" for c in _kubepods_cgroups()]
            + ([f"directory {SHIM_DIR} (made by the runc shim)"] if shim else []))


def _kill_containers() -> None:
    if not (RUN / "containerd.sock").exists():
        return
    try:
        tasks = ctr("tasks", "list", "--quiet").split()
    except ClusterError:
        return
    for task in tasks:
        subprocess.run([str(ROOT / "usr/bin/ctr"), "--address", str(RUN / "containerd.sock"),
                        "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", task],
                       capture_output=True, check=False)


def _kill_cgroup_processes() -> None:
    for folder in _kubepods_cgroups():
        for pid in _cgroup_pids(folder):
            start = _start_time(pid)
            if start is not None:
                _signal({"pid": pid, "start_time": start}, signal.SIGKILL)


def _unmount_all() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(5):
        mounts = sorted(set(_our_mounts()), key=len, reverse=True)
        if not mounts:
            return
        for point in mounts:
            libc.umount2(point.encode(), 2)  # MNT_DETACH


def _remove_cgroups() -> None:
    for folder in _kubepods_cgroups():
        for attempt in range(50):
            for child in sorted((p for p in folder.rglob("*") if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True) + [folder]:
                try:
                    child.rmdir()
                except OSError:
                    pass
            if not folder.exists():
                break
            time.sleep(0.1 * (attempt < 10) + 0.02)


def down(quiet: bool = False) -> list[str]:
    """Stop everything up() started, clean mounts, cgroups and sysctls; return leftovers()."""
    if not RUN.exists():
        # No node of ours: only empty kubepods cgroups (rmdir refuses non-empty ones) go.
        if not any(_cgroup_pids(folder) for folder in _kubepods_cgroups()):
            _remove_cgroups()
        return leftovers()
    if not quiet:
        say("teardown: stopping the kubelet, then the containers")
    _stop("kubelet", grace=15)
    _kill_containers()
    _stop("containerd", grace=15)
    _kill_cgroup_processes()
    for pid_entry in os.listdir("/proc"):
        if pid_entry.isdigit():
            try:
                exe = os.readlink(f"/proc/{pid_entry}/exe")
            except OSError:
                continue
            if exe.startswith(str(ROOT) + "/"):  # a containerd shim of ours, reparented
                start = _start_time(int(pid_entry))
                if start is not None:
                    _signal({"pid": int(pid_entry), "start_time": start}, signal.SIGKILL)
    _stop("kube-apiserver")
    _stop("etcd")
    time.sleep(0.2)
    _unmount_all()
    _remove_cgroups()
    sysctls = RUN / "sysctls.json"
    if sysctls.exists():
        for name, value in json.loads(sysctls.read_text()).items():
            try:
                Path("/proc/sys", name).write_text(value)
            except OSError as error:
                say(f"teardown: could not restore {name}={value}: {error}")
    host = RUN / "host.json"
    if host.exists() and not json.loads(host.read_text())["shim_dir_existed"]:
        shutil.rmtree(SHIM_DIR, ignore_errors=True)
    left = leftovers()
    if not left:
        shutil.rmtree(RUN, ignore_errors=True)
    if not quiet:
        say("teardown: clean" if not left else f"teardown: LEFT BEHIND {left}")
    return left


def status() -> dict[str, Any]:
    """Which recorded processes are alive, and what is left behind."""
    return {"processes": {n: _alive(r) for n, r in _records().items()},
            "leftovers": leftovers()}


def main(argv: list[str] | None = None) -> int:
    """Command line: build | up | down | status."""
    parser = argparse.ArgumentParser(prog="python -m tests.k8s.real.cluster")
    parser.add_argument("command", choices=["build", "up", "down", "status"])
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build_binaries()
            fetch_packages()
            build_images()
        elif args.command == "up":
            try:
                up()
            except ClusterError as error:
                if not isinstance(error, AlreadyRunning):
                    down(quiet=True)  # a half-started node leaves nothing behind
                raise
        elif args.command == "down":
            return 1 if down() else 0
        else:
            print(json.dumps(status(), indent=1))
    except ClusterError as error:
        print(f"k8s-real: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

