"""A pytest plugin: CPU seconds per test module, of the pytest process and of its children.

    PYTHONPATH=scripts PYTEST_ADDOPTS="-p pytest_cpu_probe" make test

Around every test it reads ``getrusage`` of the process (``RUSAGE_SELF``: the test's own
work, graph compiles included, plus the little the background thread does) and of its
reaped children (``RUSAGE_CHILDREN``: a child's CPU counts when it is waited for, so the
background fixtures' children land on whichever test was running then). The terminal
summary lists the session's totals and the modules with the most CPU; with
``CPU_PROBE_JSON=DIR`` every session also writes ``DIR/cpu_probe_<pid>.json`` (rows: test
id, self CPU s, children CPU s, wall s). Measured figures of docs/testing.md.
"""
import json
import os
import resource
import time
from collections import defaultdict

_start = {}
_rows = []


def _cpu(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def pytest_runtest_setup(item):
    _start[item.nodeid] = (_cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN),
                           time.perf_counter())


def pytest_runtest_teardown(item, nextitem):
    own, children, wall = _start.pop(item.nodeid)
    _rows.append((item.nodeid, _cpu(resource.RUSAGE_SELF) - own,
                  _cpu(resource.RUSAGE_CHILDREN) - children, time.perf_counter() - wall))


def pytest_terminal_summary(terminalreporter):
    own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    per_module = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for nodeid, s, c, w in _rows:
        row = per_module[nodeid.split("::")[0]]
        row[0] += s
        row[1] += c
        row[2] += w
        row[3] += 1
    write = terminalreporter.write_line
    write(f"cpu probe: this process {own:.0f} CPU-s, its children {children:.0f} CPU-s")
    write(f"{'module':48s} {'self s':>7s} {'child s':>8s} {'wall s':>7s} {'tests':>6s}")
    for name, (s, c, w, n) in sorted(per_module.items(), key=lambda kv: -kv[1][0])[:12]:
        write(f"{name:48s} {s:7.0f} {c:8.0f} {w:7.0f} {n:6d}")
    folder = os.environ.get("CPU_PROBE_JSON")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"cpu_probe_{os.getpid()}.json"), "w") as fh:
            json.dump({"self_s": own, "children_s": children, "rows": _rows}, fh)
