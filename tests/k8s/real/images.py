"""The test node's container images, built locally as docker-archive tarballs (no registry).

Two images:

- `PAUSE_IMAGE`: one static binary built from pause.c with gcc (the pod sandbox's process).
- `NODE_IMAGE` (also tagged `AGENT_IMAGE`, the DaemonSet's placeholder name): busybox-static
  (sh, sleep, nohup, kill...), Debian's python3 with its standard library (the in-target programs,
  the workers, preStop hooks), tini-static at /usr/bin/tini, and chaosgpu itself with the few
  packages the node agent imports, behind /usr/bin/chaosgpu.

An archive is rebuilt only when the hash of its inputs changes. `ctr images import` loads it.
"""

import hashlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PAUSE_IMAGE = "chaosgpu.test/pause:1"
NODE_IMAGE = "chaosgpu.test/node:1"
AGENT_IMAGE = "docker.io/library/chaosgpu-agent:0.1.0"
PYTHON = "/usr/bin/python3.11"
_STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                "site-packages", "dist-packages", "config-3.11-x86_64-linux-gnu"}
_HOST_TOOLS = ("nohup",)
_AGENT_DEPS = ("pynvml.py", "requests", "urllib3", "idna", "certifi", "charset_normalizer",
               # the agent's HTTP server and its metrics exposition, with aiohttp's own needs
               "aiohttp", "aiohappyeyeballs", "aiosignal", "attr", "attrs", "frozenlist",
               "multidict", "propcache", "yarl", "typing_extensions.py", "prometheus_client")
_LAUNCHER = """#!/usr/bin/python3
import sys
sys.path.insert(0, "/opt/chaosgpu")
from chaosgpu.cli import main
sys.exit(main())
"""


def _ldd(path: Path) -> list[Path]:
    done = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    found = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            found.append(Path(parts[2]))
        elif parts and parts[0].startswith("/"):
            found.append(Path(parts[0]))
    return found


def _copy(source: Path, root: Path, target: str) -> None:
    destination = root / target.lstrip("/")
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, destination, follow_symlinks=True)


def _node_rootfs(root: Path, busybox: Path) -> None:
    """Lay out NODE_IMAGE's files under `root`."""
    for folder in ("bin", "usr/bin", "etc", "tmp", "proc", "sys", "dev", "run", "root",
                   "opt/chaosgpu"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    _copy(busybox, root, "/bin/busybox")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in applets:
        if applet != "busybox" and not (root / "bin" / applet).exists():
            os.symlink("busybox", root / "bin" / applet)
    for tool in _HOST_TOOLS:  # commands the catalog uses that this busybox build lacks
        if tool not in applets:
            _copy(Path("/usr/bin") / tool, root, f"/usr/bin/{tool}")
            for library in _ldd(Path("/usr/bin") / tool):
                _copy(library, root, str(library))
    # py-spy (statically linked; a dependency of chaosgpu) lets the agent read the ranks'
    # stacks, which its job verdicts need
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if os.access(py_spy, os.X_OK):
        _copy(Path(py_spy), root, "/usr/bin/py-spy")
    _copy(Path(PYTHON), root, PYTHON)
    os.symlink("python3.11", root / "usr/bin/python3")
    stdlib = Path("/usr/lib/python3.11")
    shutil.copytree(stdlib, root / str(stdlib).lstrip("/"), symlinks=False,
                    ignore=lambda d, names: [n for n in names if n in _STDLIB_SKIP
                                             or not os.path.exists(os.path.join(d, n))])
    libraries = set(_ldd(Path(PYTHON)))
    for extension in (stdlib / "lib-dynload").glob("*.so"):
        libraries.update(_ldd(extension))
    for library in libraries:
        _copy(library, root, str(library))
    _copy(Path("/usr/bin/tini-static"), root, "/usr/bin/tini")
    shutil.copytree(REPO / "chaosgpu", root / "opt/chaosgpu/chaosgpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("probes", "actions"):
        shutil.copytree(REPO / name, root / "opt/chaosgpu/chaosgpu/intarget" / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in _AGENT_DEPS:
        module = importlib.import_module(name.removesuffix(".py"))
        source = Path(str(module.__file__))
        if source.name == "__init__.py":
            source = source.parent
        if source.is_dir():
            shutil.copytree(source, root / "opt/chaosgpu" / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            _copy(source, root, f"/opt/chaosgpu/{name}")
    (root / "usr/bin/chaosgpu").write_text(_LAUNCHER)
    os.chmod(root / "usr/bin/chaosgpu", 0o755)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                     "nobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")


def _layer(root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if info.isfile():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def write_archive(path: Path, tags: list[str], root: Path, command: list[str],
                  env: list[str]) -> None:
    """Write a docker-archive tarball (one layer: the tree at `root`) tagged with `tags`."""
    layer = _layer(root)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": command, "Env": env, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "chaosgpu tests/k8s/real/images.py"}],
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": tags,
                            "Layers": ["layer/layer.tar"]}]).encode()
    temporary = path.with_suffix(".partial")
    with tarfile.open(temporary, "w") as tar:
        for name, data in ((config_name, config), ("layer/layer.tar", layer),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    temporary.replace(path)


def _inputs_key(*paths: Path) -> str:
    digest = hashlib.sha256()
    for base in paths:
        files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def build(folder: Path, busybox: Path) -> dict[str, tuple[Path, list[str]]]:
    """Build (or reuse) both archives under `folder`; return {name: (archive, tags)}."""
    folder.mkdir(parents=True, exist_ok=True)
    built: dict[str, tuple[Path, list[str]]] = {}
    pause_key = _inputs_key(HERE / "pause.c")
    pause = folder / f"pause-{pause_key}.tar"
    if not pause.exists():
        staging = folder / "pause-rootfs"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        subprocess.run(["gcc", "-Os", "-static", "-o", str(staging / "pause"),
                        str(HERE / "pause.c")], check=True)
        write_archive(pause, [PAUSE_IMAGE], staging, ["/pause"], [])
        shutil.rmtree(staging)
    built["pause"] = (pause, [PAUSE_IMAGE])
    node_key = _inputs_key(HERE / "images.py", REPO / "chaosgpu", REPO / "probes",
                           REPO / "actions", busybox)
    node = folder / f"node-{node_key}.tar"
    if not node.exists():
        staging = folder / "node-rootfs"
        shutil.rmtree(staging, ignore_errors=True)
        _node_rootfs(staging, busybox)
        write_archive(node, [NODE_IMAGE, AGENT_IMAGE], staging, ["/bin/sh"],
                      ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
        shutil.rmtree(staging)
    built["node"] = (node, [NODE_IMAGE, AGENT_IMAGE])
    for stale in folder.glob("*.tar"):
        if stale not in (pause, node):
            stale.unlink()
    return built
