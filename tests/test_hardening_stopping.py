"""Stopping does not wait for the interpreter: the stop grace period is kept by a watchdog thread that learns of
SIGINT / SIGTERM through the signal module's wakeup descriptor, so a run whose main thread is inside one long native
call still ends within the grace period, with the documented line and exit status 128 + the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sara.train.stopping import EXIT_MARGIN_S

GRACE_S = 1.5

# The main thread sleeps 60 s in ONE libc call. With SIGINT / SIGTERM blocked in the main thread (after the watchdog
# started, so the watchdog's thread still takes them), the signal never interrupts that call, as it would not a long
# matrix product or generation call: Python's own handler cannot run before the call returns.
NATIVE = textwrap.dedent("""
    import ctypes, os, signal, sys
    from sara.train.guards import StopSignals
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc = ctypes.CDLL(None)
    with StopSignals(grace_s=float(sys.argv[1])) as stop:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print("ready", flush=True)
        libc.sleep(60)
    print("returned", stop.received, flush=True)
""")


def _start(grace_s: float = GRACE_S) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", NATIVE, str(grace_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr \
        else ""
    time.sleep(0.2)  # inside the native call
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no exit within {timeout} s of the signal; stderr: {err!r}")
    return proc.returncode, out, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_one_long_native_call_stops_within_the_grace(sig):
    proc = _start()
    t0 = time.monotonic()
    proc.send_signal(sig)
    rc, out, err = _finish(proc, GRACE_S + EXIT_MARGIN_S + 10)
    waited = time.monotonic() - t0
    name = signal.Signals(sig).name
    assert rc == 128 + sig, (rc, out, err)
    assert GRACE_S - 0.2 < waited < GRACE_S + EXIT_MARGIN_S, waited
    lines = err.strip().splitlines()
    assert lines == [
        f"sara: {name}: stopping after the running step (within {GRACE_S:g} s; a second signal stops at once)",
        f"sara: {name}: still running {GRACE_S:g} s after it; stopping now, without finishing or checkpointing the "
        "running step (SARA_STOP_GRACE_S sets the wait)"], err
    assert "returned" not in out


def test_a_second_signal_during_a_native_call_stops_at_once():
    proc = _start(grace_s=30.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    rc, _, err = _finish(proc, 20)
    assert rc == 128 + signal.SIGTERM and time.monotonic() - t0 < 5, (rc, err)
    assert err.strip().splitlines()[-1] == "sara: SIGTERM again: stopping now (status 143)", err


def test_a_run_that_ends_in_time_is_not_stopped_and_gives_the_descriptor_back():
    """The watchdog of a block that ended before its grace exits nothing, and the previous wakeup descriptor is back."""
    script = textwrap.dedent("""
        import os, signal, time
        from sara.train.guards import StopSignals
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        r, w = os.pipe(); os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        with StopSignals(grace_s=0.3) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        time.sleep(1.0)  # past the grace and the margin: nothing happens
        print("ended", stop.received, signal.set_wakeup_fd(-1) == w, flush=True)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0 and res.stdout.split() == ["ended", "SIGTERM", "True"], (res.stdout, res.stderr)
