"""Host discovery of an elastic job: the ``--host-discovery-script``, run in a thread.

As Horovod's, the script prints one ``host:slots`` (or ``host``) line per usable host; no line
at all means no host now. The launcher (``elastic.py``) reads ``Discovery.hosts``, the latest
good answer, and ``Discovery.version``, bumped when the answer changes. A script that fails
(a non-zero status, a bad line, no answer within ten intervals or 10 s) is reported once per
distinct error, and the hosts it listed before are kept: a flaky script does not empty the job.
"""

from __future__ import annotations

import subprocess
import threading

from .hosts import Host, parse_hosts
from .processes import Output

__all__ = ["Discovery", "parse_discovered"]


def parse_discovered(text: str) -> list[Host]:
    """Parses a discovery script's output: one ``host:slots`` or ``host`` a line, blank lines
    ignored, no line at all meaning no host now (the rules: ``hosts.py``).

    Raises:
        ValueError: a bad line (the message quotes it) or a host listed twice.
    """
    return parse_hosts(text, source="host discovery script", separator="\n", allow_empty=True)


class Discovery:
    """Runs the discovery script in a thread; ``hosts`` is its latest good answer."""

    def __init__(self, script: str, interval: float, output: Output):
        self.script, self.interval, self.output = script, interval, output
        self.hosts: list[Host] | None = None
        self.version = 0  # bumped when the answer changes
        self._stop = threading.Event()
        self._warned = ""
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="gradsync-discovery")

    def start(self) -> "Discovery":
        self._run_once()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._run_once()

    def _run_once(self) -> None:
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                  timeout=max(10.0, self.interval * 10))
            if done.returncode != 0:
                raise ValueError(f"exited with status {done.returncode}: "
                                 f"{done.stderr.strip()[-200:]}")
            hosts = parse_discovered(done.stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            if str(exc) != self._warned:
                self._warned = str(exc)
                self.output.message(f"host discovery script {self.script!r} failed: {exc}; "
                                    "keeping the hosts it listed before")
            return
        if hosts != self.hosts:
            self.hosts = hosts
            self.version += 1
