"""What else ran on the machine while a served run was measured (Linux `/proc`).

A step model predicts the engine's own time; on a shared machine other processes take part of
the server's core and stretch its steps by an amount no model of the step can know. The
validation therefore pins the server to one core and samples, per window:

  * the load average (`os.getloadavg`): runnable processes on the whole machine;
  * the server process's CPU time over the window (all its threads): its share of one core;
  * the core's busy time (`/proc/stat`) minus the server's: what other processes took from the
    server's core (`others_share`). Above `DISTURBED_SHARE` in any window the run is flagged as
    disturbed, not fitted around.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass

DISTURBED_SHARE = 0.05  # other processes on the server's core, fraction of a window


@dataclass(frozen=True)
class LoadWindow:
    t: float  # window start, seconds since the monitor started
    seconds: float
    loadavg_1m: float
    server_share: float  # server process CPU time / wall time (1.0 = its whole core)
    core_busy_share: float  # the pinned core's busy time / wall time
    others_share: float  # core busy - server: other processes on the server's core


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _core_busy_seconds(cpu: int) -> float:
    """Time one core ran processes (user, nice, system) or was taken by the hypervisor
    (steal) since boot; interrupt time is left out, as processes' own times leave it out."""
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                v = [int(x) for x in line.split()[1:]] + [0] * 8
                return (v[0] + v[1] + v[2] + v[7]) / os.sysconf("SC_CLK_TCK")
    raise ValueError(f"/proc/stat has no cpu{cpu}")


class LoadMonitor:
    """Samples the server's core every `window` seconds in a background thread."""

    def __init__(self, pid: int, cpu: int, window: float = 2.0) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0 seconds, got {window}")
        _core_busy_seconds(cpu)  # fails early on a core that does not exist
        self.pid, self.cpu, self.window = pid, cpu, window
        self.windows: list[LoadWindow] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), _proc_cpu_seconds(self.pid), _core_busy_seconds(self.cpu)

    def _run(self) -> None:
        try:
            last = self._sample()
        except OSError:
            return
        while True:
            stopped = self._stop.wait(self.window)
            try:
                now = self._sample()
            except OSError:  # the server exited
                return
            dt = now[0] - last[0]
            if dt > 0.2 * self.window:
                server = (now[1] - last[1]) / dt
                core = (now[2] - last[2]) / dt
                self.windows.append(LoadWindow(
                    last[0] - self._t0, dt, os.getloadavg()[0], server, core,
                    max(0.0, core - server)))
            last = now
            if stopped:
                return


def summarize(windows: list[LoadWindow]) -> dict:
    """Plain numbers for the validation JSON: the worst and mean of each share, and the verdict."""
    if not windows:
        return {"windows": 0, "disturbed": None}
    total = sum(w.seconds for w in windows)
    mean = lambda k: sum(getattr(w, k) * w.seconds for w in windows) / total  # noqa: E731
    worst = max(w.others_share for w in windows)
    return {"windows": len(windows), "seconds": total,
            "loadavg_1m_max": max(w.loadavg_1m for w in windows),
            "loadavg_1m_mean": mean("loadavg_1m"),
            "server_share_mean": mean("server_share"),
            "others_share_mean": mean("others_share"), "others_share_max": worst,
            "disturbed": worst > DISTURBED_SHARE,
            "per_window": [asdict(w) for w in windows]}
