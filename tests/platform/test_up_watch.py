"""How `atrium up` tells a stop from a failure once everything runs (atrium/up.py `_watch`).

Ctrl-C reaches every process of the terminal's group at once, so a child can exit on it
before `atrium up` itself has handled it: that must read as a stop (exit 0), not as "a
process exited" (exit 1). Each case runs in a process of its own, as its signals are its own.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HARNESS = """
import os, signal, subprocess, sys
from atrium.up import _watch

def child(code):
    return subprocess.Popen([sys.executable, "-c", code])

case = sys.argv[1]
if case == "ctrl-c-after-a-child-exited":
    gone = child("pass")
    gone.wait()  # the child went first, and the Ctrl-C that made it go is still pending
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)
    _watch([gone])
elif case == "sigterm-while-children-run":
    alive = child("import os, signal, time; time.sleep(0.5); "
                  "os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)")
    _watch([alive])
    alive.kill()
elif case == "a-child-exited-alone":
    gone = child("import sys; sys.exit(3)")
    _watch([gone])
print("stopped", flush=True)
"""


@pytest.mark.parametrize(("case", "code", "said"), [
    ("ctrl-c-after-a-child-exited", 0, "stopped"),
    ("sigterm-while-children-run", 0, "stopped"),
    ("a-child-exited-alone", 1, "atrium: a process exited; stopped the rest"),
])
def test_a_stop_signal_is_a_stop_and_a_lone_exit_is_a_failure(case, code, said):
    done = subprocess.run([sys.executable, "-c", HARNESS, case], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert said in done.stdout + done.stderr
