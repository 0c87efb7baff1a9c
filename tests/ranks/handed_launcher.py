"""``gradsync run ARGS`` with a template handed down: run by the test session's template
(tests/harness.py, "One import of torch for every job"), which imported torch, torch._dynamo,
gradsync and the launcher once, so neither this launcher nor its job's template imports them.

    handed_launcher.py ARGS...    # as python -m gradsync ARGS

Forks the job's template first (``gradsync.run.forkserver.main``: this process's child, so
that the ranks it forks are reparented to this process, the launcher, a subreaper), names it in
``GRADSYNC_TEMPLATE`` (gradsync/run/forkserver.py, "A template handed down"), then runs the
launcher as ``python -m gradsync`` would.
"""

import os
import runpy
import socket
import sys

from gradsync.run import forkserver

ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
forkserver.become_subreaper()
sys.stdout.flush()
sys.stderr.flush()
template = os.fork()
if template == 0:  # the template: its own session, /dev/null in, its output on stderr
    ours.close()
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    # Detached: main makes its own socket of the descriptor, and a second owner would close it
    # again at this process's exit, in a rank by then whatever reused its number.
    sys.exit(forkserver.main([str(theirs.detach())]))
theirs.close()
os.environ[forkserver.HANDED] = f"{ours.detach()}:{template}"
sys.argv = ["gradsync", *sys.argv[1:]]
sys.path[0] = os.getcwd()  # as -m has it
runpy.run_module("gradsync", run_name="__main__", alter_sys=True)
