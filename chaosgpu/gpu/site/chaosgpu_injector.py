# ruff: noqa: UP031, UP006, UP035, UP045
"""chaosgpu's in-process fault injector for Python jobs (self-contained: standard library, plus
torch and libcuda only when a fault needs them).

Loaded by sitecustomize.py when CHAOSGPU_INJECT_DIR is set. `arm()` writes
`<dir>/<key>.armed` (who this process is) and starts one daemon thread that looks every 50 ms
for `<dir>/<key>.trigger`, where key = "<pid namespace inode>-<pid in that namespace>-<start
time>": a trigger names exactly one process, and a reused PID gets another key. The thread
reads the trigger (a JSON document written atomically by chaosgpu), removes it, writes
`<dir>/<key>.ack-<id>.json` (accepted or the reason it was refused), then does the fault:

- gpu-hang: a kernel that spins on the device until released or `duration_s` has passed, on
  the legacy default stream of the device whose primary context this process uses: every
  blocking stream of the process (torch's default stream) queues behind it, so the rank's next
  synchronisation blocks while the process stays alive. Needs libcuda and an active context.
- hold-gil: one call into libc that sleeps while holding the GIL (`duration_s`, or forever):
  every Python thread of the process stops.
- raise: raises an exception in the main thread (asynchronously: at its next Python bytecode).
- segfault: loads from the unmapped first page (a genuine SIGSEGV).
- oom: makes the next CUDA allocations of torch's caching allocator fail with
  torch.cuda.OutOfMemoryError (memory fraction pinned at what is allocated, cache emptied),
  until released or `duration_s` has passed.

`<dir>/<key>.release` ends a gpu-hang or an oom early. Once torch has initialised CUDA, the
thread also attaches torch's out-of-memory observer, so an OOM in the rank (injected or not) is
recorded in `<dir>/<key>.oom.jsonl` for chaosgpu to see from outside. Nothing else changes in
the process while no trigger comes.
"""

import ctypes
import json
import os
import sys
import threading
import time

POLL_S = 0.05
OBSERVER_EVERY_S = 1.0
MODES = ("gpu-hang", "hold-gil", "raise", "segfault", "oom")
EXCEPTIONS = ("RuntimeError", "OutOfMemoryError", "KeyboardInterrupt")
CU_STREAM_LEGACY = 1
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02

# Spins until *flag != 0 or duration_ns (0: forever) has passed, by the GPU's global timer.
HANG_PTX = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry chaosgpu_hang(.param .u64 flag, .param .u64 duration_ns)
{
  .reg .pred %p;
  .reg .b32 %v;
  .reg .b64 %f, %d, %t0, %t, %e;
  ld.param.u64 %f, [flag];
  ld.param.u64 %d, [duration_ns];
  mov.u64 %t0, %globaltimer;
LOOP:
  ld.volatile.global.u32 %v, [%f];
  setp.ne.u32 %p, %v, 0;
  @%p bra DONE;
  setp.eq.u64 %p, %d, 0;
  @%p bra WAIT;
  mov.u64 %t, %globaltimer;
  sub.u64 %e, %t, %t0;
  setp.ge.u64 %p, %e, %d;
  @%p bra DONE;
WAIT:
  nanosleep.u32 2000;
  bra LOOP;
DONE:
  ret;
}
"""


class ChaosGPUInjectedFault(RuntimeError):
    """The exception chaosgpu raises in a rank's main thread (mode "raise")."""


# one mutable record of this process's arming; a type comment, as the job's Python may be old
_state = {"armed": False, "key": None, "dir": None, "thread": None, "hang": None,
          "oom": None, "observer": False, "main": None}  # type: dict


def process_key():
    """This process's key: "<pid namespace inode>-<pid here>-<start time in clock ticks>"."""
    link = os.readlink("/proc/self/ns/pid")
    inode = "".join(ch for ch in link if ch.isdigit())
    with open("/proc/self/stat", "rb") as handle:
        stat = handle.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return "%s-%d-%d" % (inode, os.getpid(), int(fields[19]))


def _write_json(path, document):
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w") as handle:
        json.dump(document, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _path(suffix):
    return os.path.join(_state["dir"], "%s.%s" % (_state["key"], suffix))


def arm():
    """Arm this process: write the armed file and start the watcher thread (once)."""
    if _state["armed"]:
        return
    folder = os.environ["CHAOSGPU_INJECT_DIR"]
    if not os.path.isdir(folder):
        raise RuntimeError("CHAOSGPU_INJECT_DIR %r is not a directory" % (folder,))
    _state.update(dir=folder, key=process_key(), main=threading.main_thread().ident)
    _write_json(_path("armed"), {
        "pid": os.getpid(), "key": _state["key"], "argv": sys.argv[:1] or [sys.executable],
        "executable": sys.executable, "python": sys.version.split()[0],
        "t_armed": time.time(), "modes": list(MODES), "tag": os.environ.get("CHAOSGPU_TAG"),
        "rank": os.environ.get("RANK")})
    thread = threading.Thread(target=_watch, name="chaosgpu-injector", daemon=True)
    _state.update(armed=True, thread=thread)
    import atexit

    atexit.register(_disarm)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)
    thread.start()


def _disarm():
    try:
        os.unlink(_path("armed"))
    except OSError:
        pass


def _forget_in_child():
    # A forked child is another process: it is not armed (its key differs, its thread is gone).
    _state.update(armed=False, thread=None, hang=None, oom=None)


def _watch():
    last_observer_check = 0.0
    while True:
        time.sleep(POLL_S)
        if not _state["armed"]:
            return
        try:
            trigger = _path("trigger")
            if os.path.exists(trigger):
                _take(trigger)
            release = _path("release")
            if os.path.exists(release):
                os.unlink(release)
                _release("release file")
            now = time.monotonic()
            if not _state["observer"] and now - last_observer_check >= OBSERVER_EVERY_S:
                last_observer_check = now
                _attach_oom_observer()
        except Exception as error:  # keep watching; say what went wrong once per event
            sys.stderr.write("chaosgpu injector: %s: %s\n" % (type(error).__name__, error))


def _take(trigger):
    try:
        with open(trigger) as handle:
            request = json.load(handle)
    finally:
        os.unlink(trigger)
    ident = str(request.get("id") or "noid")
    ack = {"id": ident, "mode": request.get("mode"), "pid": os.getpid(), "key": _state["key"],
           "t_received": time.time(), "accepted": False, "error": None, "detail": {}}
    ack_path = _path("ack-%s.json" % ("".join(c for c in ident if c.isalnum() or c in "-_"),))
    mode = request.get("mode")
    try:
        if mode not in MODES:
            raise ValueError("unknown mode %r (one of %s)" % (mode, ", ".join(MODES)))
        duration = request.get("duration_s")
        if duration is not None and (not isinstance(duration, (int, float)) or duration <= 0):
            raise ValueError("duration_s must be > 0 or null, got %r" % (duration,))
        run = {"gpu-hang": _gpu_hang, "hold-gil": _hold_gil, "raise": _raise,
               "segfault": _segfault, "oom": _oom}[mode]
        after = run(request, ack["detail"])
        ack["accepted"] = True
    except Exception as error:
        ack["error"] = "%s: %s" % (type(error).__name__, error)
        after = None
    ack["t_done"] = time.time()
    _write_json(ack_path, ack)
    if after is not None:
        after()


# ------------------------------------------------------------------ CUDA through the driver API


def _cuda():
    lib = ctypes.CDLL("libcuda.so.1")
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib, result, call):
    if result:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError("%s failed: %s" % (call, (name.value or b"?").decode()))


def _active_device(lib, wanted):
    """The CUDA ordinal whose primary context this process uses (`wanted` when given)."""
    count = ctypes.c_int(0)
    _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    active = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        _check(lib, lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        flags, on = ctypes.c_uint(0), ctypes.c_int(0)
        _check(lib, lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(on)),
               "cuDevicePrimaryCtxGetState")
        if on.value:
            active.append((ordinal, device))
    if wanted is not None:
        for ordinal, device in active:
            if ordinal == wanted:
                return ordinal, device
        raise RuntimeError("this process has no CUDA context on device %r (active: %s)"
                           % (wanted, [a[0] for a in active]))
    if not active:
        raise RuntimeError("this process has no active CUDA context: it does not use a GPU")
    if len(active) > 1:
        raise RuntimeError("this process uses several GPUs %s: name one with device"
                           % ([a[0] for a in active],))
    return active[0]


def _gpu_hang(request, detail):
    if _state["hang"] is not None:
        raise RuntimeError("a gpu-hang is already in place in this process")
    lib = _cuda()
    ordinal, device = _active_device(lib, request.get("device"))
    context = ctypes.c_void_p()
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
           "cuDevicePrimaryCtxRetain")
    _check(lib, lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib, lib.cuModuleLoadData(ctypes.byref(module),
                                         ctypes.create_string_buffer(HANG_PTX.encode())),
               "cuModuleLoadData")
        _check(lib, lib.cuModuleGetFunction(ctypes.byref(function), module, b"chaosgpu_hang"),
               "cuModuleGetFunction")
        host = ctypes.c_void_p()
        _check(lib, lib.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(4),
                                       CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP),
               "cuMemHostAlloc")
        flag = ctypes.cast(host, ctypes.POINTER(ctypes.c_uint32))
        flag[0] = 0
        device_flag = ctypes.c_uint64(0)
        _check(lib, lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device_flag), host, 0),
               "cuMemHostGetDevicePointer")
        duration = request.get("duration_s")
        nanos = ctypes.c_uint64(int(duration * 1e9) if duration else 0)
        args = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(device_flag), ctypes.c_void_p),
                                     ctypes.cast(ctypes.byref(nanos), ctypes.c_void_p))
        _check(lib, lib.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0,
                                       ctypes.c_void_p(CU_STREAM_LEGACY), args, None),
               "cuLaunchKernel")
    finally:
        popped = ctypes.c_void_p()
        lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    _state["hang"] = {"flag": flag, "module": module, "host": host, "lib": lib}
    detail.update(device=ordinal, stream="legacy default stream", duration_s=duration,
                  launched_at=time.time())
    if duration:
        timer = threading.Timer(duration, _forget_hang)
        timer.daemon = True
        timer.start()
    return None


def _forget_hang():
    # The kernel ends by itself after its duration; keep the flag memory (tiny) for safety.
    _state["hang"] = None


def _hold_gil(request, detail):
    duration = request.get("duration_s")
    detail.update(duration_s=duration, holds="the GIL, in one libc call")

    def hold():
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
        if duration:
            seconds = int(duration)

            class Timespec(ctypes.Structure):
                _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

            wanted = Timespec(seconds, int((duration - seconds) * 1e9))
            left = Timespec(0, 0)
            while libc.nanosleep(ctypes.byref(wanted), ctypes.byref(left)) != 0:
                wanted = Timespec(left.tv_sec, left.tv_nsec)
        else:
            while True:
                libc.pause()

    return hold


def _exception(name):
    if name in (None, "RuntimeError"):
        return ChaosGPUInjectedFault
    if name == "KeyboardInterrupt":
        return KeyboardInterrupt
    if name == "OutOfMemoryError":
        torch = sys.modules.get("torch")
        error = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
        return error if error is not None else MemoryError
    raise ValueError("unknown exception %r (one of %s)" % (name, ", ".join(EXCEPTIONS)))


def _raise(request, detail):
    error = _exception(request.get("exception"))
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = (ctypes.c_ulong, ctypes.py_object)
    main = threading.main_thread()
    if not main.is_alive() or main.ident != _state["main"]:
        raise RuntimeError("the main thread could not be reached (it has ended)")
    detail.update(exception="%s.%s" % (error.__module__, error.__name__),
                  note="raised at the main thread's next Python bytecode")

    # The raise comes after the ack is written: an uncaught exception ends the interpreter,
    # which cut the ack's write short (seen: the ack left as its temporary file, the fault
    # reported as not delivered although it was).
    def fire():
        set_async(ctypes.c_ulong(_state["main"]), error)

    return fire


def _segfault(request, detail):
    detail.update(signal="SIGSEGV", how="load from address 16 (the unmapped first page)")

    def crash():
        sys.stderr.flush()
        return ctypes.c_int.from_address(16).value  # a load from the unmapped first page: SIGSEGV

    return crash


def _torch_cuda():
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None or not cuda.is_initialized():
        raise RuntimeError("torch has not initialised CUDA in this process")
    return torch


def _oom(request, detail):
    if _state["oom"] is not None:
        raise RuntimeError("an oom fault is already in place in this process")
    torch = _torch_cuda()
    ordinal, _ = _active_device(_cuda(), request.get("device"))
    total = torch.cuda.get_device_properties(ordinal).total_memory
    allocated = torch.cuda.memory_allocated(ordinal)
    fraction = min(1.0, max(0.0, allocated / float(total)))
    torch.cuda.set_per_process_memory_fraction(fraction, ordinal)
    torch.cuda.empty_cache()
    _state["oom"] = {"device": ordinal, "torch": torch}
    duration = request.get("duration_s")
    detail.update(device=ordinal, allocated_bytes=allocated, fraction=fraction,
                  duration_s=duration)
    if duration:
        timer = threading.Timer(duration, _release, args=("duration over",))
        timer.daemon = True
        timer.start()
    return None


def _release(why):
    done = []
    hang = _state["hang"]
    if hang is not None:
        hang["flag"][0] = 1
        _state["hang"] = None
        done.append("gpu-hang")
    oom = _state["oom"]
    if oom is not None:
        oom["torch"].cuda.set_per_process_memory_fraction(1.0, oom["device"])
        _state["oom"] = None
        done.append("oom")
    _write_json(_path("released.json"), {"t": time.time(), "why": why, "released": done})


def _attach_oom_observer():
    torch = sys.modules.get("torch")
    cuda = sys.modules.get("torch.cuda")
    if torch is None or cuda is None or not getattr(cuda, "is_initialized", lambda: False)():
        return
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        _state["observer"] = True  # this torch has none: nothing to attach, stop looking
        return
    path = _path("oom.jsonl")

    def observe(device, alloc, device_allocated, device_free):
        with open(path, "a") as handle:
            handle.write(json.dumps({"t": time.time(), "device": device, "requested": alloc,
                                     "allocated": device_allocated, "free": device_free,
                                     "pid": os.getpid(), "tag": os.environ.get("CHAOSGPU_TAG"),
                                     "rank": os.environ.get("RANK")}) + "\n")

    attach(observe)
    _state["observer"] = True
