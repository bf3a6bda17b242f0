"""``make mutation``: mutation testing with mutmut (pinned in the Makefile; configured in pyproject.toml's
``[tool.mutmut]``) of the ledger core, the scheduler, the simulator, the server, the fleet and the runtime's
KV storage (``kv_store``, ``kv_quant``, ``host_store``, ``transfer``, ``attention``), module by module,
and the kill rates.

    .venv/bin/python tests/mutation.py run [MODULE ...]    # mutmut on each module, then the report
    .venv/bin/python tests/mutation.py report [MODULE ...] # the report of what the last runs found
    .venv/bin/python tests/mutation.py rerun [MODULE ...]  # the survivors again, after adding tests
    .venv/bin/python tests/mutation.py sample [--count N] [--per-package] [--seed S] [--jobs J] [--no-fresh] [--reuse]
                                              [MODULE ...]

``sample`` estimates the kill rate over every mutant of the modules (every package above by default:
days of one core) from a uniform random sample of them, seeded (``--per-package``: ``--count`` mutants of
each package, each package's drawn on its own generator, so that its rate has its own interval and its
draw does not depend on which other packages are asked; ``--no-fresh`` skips the last, fresh-interpreter
pass, and the report says so; ``--reuse`` takes the statuses of the last run of the same sample and runs only
the fresh-interpreter pass, after that pass was interrupted): it runs only the sampled
mutants (with ``KVLEDGER_NATIVE=0``; each survivor of the packages with a C path again with the C part
loaded, as ``make test`` runs; then in a fresh interpreter: the core's and the scheduler's over the
planner's quick tests, for code that runs at import, the server's over its in-process server tests,
whose server module state is then built with the mutant active) and prints the kill rate per package
and over the sample, each with its 95% (Wilson) interval. Equivalent mutants met in the sample are listed in
``mutation_equivalent.txt`` like any other and drop out of the denominator. The first ``sample`` on a
fresh checkout makes mutmut generate every mutant and map the tests (a run whose pattern matches no
mutant: about six minutes here). A sample whose survivors then got kill tests no longer estimates
anything: draw the next estimate with a new ``--seed``.

A MODULE is a dotted name (``kvledger.scheduler.victims``) or a package (``kvledger.scheduler``); the
default is every module of every package in ``PACKAGES`` (which follows ``[tool.mutmut]``'s
``only_mutate`` and ``do_not_mutate``). The run is one mutmut worker
(``--max-children 1``) per module, under ``nice``, with ``KVLEDGER_NATIVE=0`` so the Python code being
mutated is the code the tests run, and the short fuzz on a fixed seed and episode count (so that a
mutant is killed or not the same way every run, but for thread interleavings).

The kill rate counts only mutants that are not equivalent: ``tests/mutation_equivalent.txt`` lists, one
per line, each mutant judged equivalent (no behaviour a user could notice changes) with a one-line
reason. A reason starting ``[native]`` marks a mutant on the C part's path only, which this run (with
``KVLEDGER_NATIVE=0``) cannot reach; it was planted by hand with the C part loaded and killed, and is
counted apart ("native"). A reason starting ``[cuda]`` marks a mutant that only a CUDA device can tell
apart (a copy stream, pinned memory, a device-side index): it is *not* equivalent, only unreachable on
this CPU machine, and is counted apart ("cuda"); ``sample`` prints the rate with those counted as
survived beside the rate over what a CPU can reach. A timeout counts as killed (the mutant made a test
hang); "no tests" counts as survived.
"""

from __future__ import annotations

import fnmatch
import math
import os
import random
import re
import subprocess
import sys
import time
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT = Path(__file__).with_name("mutation_equivalent.txt")
MUTMUT = [sys.executable, "-m", "mutmut"]
ENV = {
    "KVLEDGER_NATIVE": "0",
    "KVLEDGER_FUZZ_SEED": "20261201",
    "KVLEDGER_FUZZ_EPISODES": "ledger=20,threads=1,scheduler=40",
}
# The packages mutated, in report order; of the runtime only the modules [tool.mutmut] names.
# The core's two halves are reported apart: the ledger (``kvledger.core``) and its sizing (``kvledger.core.sizing``).
PACKAGES = ("kvledger.core", "kvledger.core.sizing", "kvledger.scheduler", "kvledger.workloads", "kvledger.placement",
            "kvledger.sim", "kvledger.server", "kvledger.fleet", "kvledger.runtime")
KILLED = {"killed", "timeout"}
# The fresh-interpreter pass of ``sample`` (see there), per package: for the core and the scheduler,
# tensor-free tests of what the core computes at import; for the server, the in-process server tests
# (tests/server/inproc.py: the app `kvledger serve` assembles, run in the test process, so mutmut maps them
# too), for what the server builds at import.
PLANNER_TESTS = ("tests/core/test_inventory.py", "tests/core/test_plan.py", "tests/core/test_geometry.py",
                 "tests/core/test_identity_known_answers.py", "tests/test_golden.py")
INPROC_SERVER_TESTS = ("tests/server/test_inproc_openai_surface.py", "tests/server/test_inproc_errors.py",
                       "tests/server/test_inproc_admin_and_metrics.py", "tests/server/test_inproc_lifecycle.py")
# The runtime's: its KV-storage tests with the C kernels loaded (as ``make test`` runs them), for the
# kernels' path (``NativePagedAttention``), which mutmut maps with ``KVLEDGER_NATIVE=0`` to no test at all.
RUNTIME_KV_TESTS = ("tests/runtime/test_attention_scale_and_dtype.py",
                    "tests/runtime/test_kv_storage_formats_roundtrip.py",
                    "tests/runtime/test_kv_storage_tiers_and_transfers.py", "tests/runtime/test_runtime_attention.py",
                    "tests/runtime/test_runtime_kv_store.py", "tests/runtime/test_kv_formats.py")
FRESH_TESTS = {"kvledger.core": PLANNER_TESTS, "kvledger.core.sizing": PLANNER_TESTS,
               "kvledger.scheduler": PLANNER_TESTS, "kvledger.server": INPROC_SERVER_TESTS,
               "kvledger.runtime": RUNTIME_KV_TESTS}
FRESH_ENV = {"kvledger.runtime": {"KVLEDGER_NATIVE": "1"}}
FRESH_TIMEOUT_S = {"kvledger.server": 900}
# Packages whose code takes another path with the C parts loaded (the core's, the runtime's kernels).
NATIVE_PACKAGES = {"kvledger.core", "kvledger.core.sizing", "kvledger.scheduler", "kvledger.runtime"}


def _mutmut_config() -> dict:
    with (REPO / "pyproject.toml").open("rb") as fh:
        return tomllib.load(fh)["tool"]["mutmut"]


def package_modules(package: str) -> list[str]:
    """The modules of ``package`` that mutmut mutates (``only_mutate`` less ``do_not_mutate``), sorted;
    a package's ``__init__`` is left out (its mutants would be named as the package's)."""
    cfg = _mutmut_config()
    folder = REPO / "src" / package.replace(".", "/")
    out = []
    for path in sorted(folder.glob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if path.stem == "__init__" or any(fnmatch.fnmatch(rel, p) for p in cfg.get("do_not_mutate", [])):
            continue
        if any(fnmatch.fnmatch(rel, p) for p in cfg.get("only_mutate", [])):
            out.append(f"{package}.{path.stem}")
    return out


def modules(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names or list(PACKAGES):
        out += package_modules(name) if name in PACKAGES else [name]
    return out


def equivalents() -> dict[str, str]:
    """mutant name -> why it is equivalent."""
    out = {}
    if EQUIVALENT.exists():
        for line in EQUIVALENT.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, why = line.partition(" ")
                out[name] = why.strip()
    return out


def apart_kind(reason: str) -> str:
    """How a listed mutant is counted apart: ``native`` (killed by hand with the C part loaded), ``cuda``
    (only a CUDA device tells it apart: not equivalent, unreachable here) or ``equivalent``."""
    if reason.startswith("[native]"):
        return "native"
    return "cuda" if reason.startswith("[cuda]") else "equivalent"


def results() -> dict[str, str]:
    """Every mutant mutmut knows, with its status (killed, survived, timeout, no tests, not checked...)."""
    proc = subprocess.run([*MUTMUT, "results", "--all", "true"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, **ENV))
    out = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\s*(\S+): (.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def package_of(mutant: str) -> str:
    """The package of ``PACKAGES`` a mutant belongs to (``kvledger.sim``, ``kvledger.runtime``, ...): the
    innermost one, so the core's sizing half (``kvledger.core.sizing``) is reported apart from its ledger."""
    mod = module_of(mutant)
    return max((p for p in PACKAGES if mod.startswith(p + ".")), key=len, default=mod.rsplit(".", 1)[0])


def module_of(mutant: str) -> str:
    return mutant.split(".x")[0] if ".x" in mutant else mutant.rsplit(".", 1)[0]


def report(names: list[str]) -> int:
    wanted = modules(names)
    status = results()
    eq = equivalents()
    rows = []
    total: Counter[str] = Counter()
    for mod in wanted:
        mine = {k: v for k, v in status.items() if module_of(k) == mod}
        if not mine:
            continue
        c = Counter()
        for name, st in mine.items():
            if st == "not checked":
                c["unchecked"] += 1
            elif name in eq and st not in KILLED:
                c[apart_kind(eq[name])] += 1
            elif st in KILLED:
                c["killed"] += 1
            else:
                c["survived"] += 1
        c["mutants"] = len(mine)
        total.update(c)
        rows.append((mod, c))
    head = ("module", "mutants", "killed", "equiv", "native", "surv", "unchecked", "kill rate")
    print(f"{head[0]:34s} {head[1]:>8s} {head[2]:>7s} {head[3]:>6s} {head[4]:>6s} {head[5]:>6s} {head[6]:>9s} "
          f"{head[7]:>9s}")
    for mod, c in [*rows, ("TOTAL", total)]:
        denom = c["killed"] + c["survived"]
        rate = f"{100 * c['killed'] / denom:.1f}%" if denom else "-"
        print(f"{mod:34s} {c['mutants']:8d} {c['killed']:7d} {c['equivalent']:6d} {c['native']:6d} {c['survived']:6d} "
              f"{c['unchecked']:9d} {rate:>9s}")
    surv = surviving(names)
    if surv:
        print(f"\n{len(surv)} surviving non-equivalent mutants (mutmut show NAME shows one):")
        for name in surv:
            print(f"  {name}: {status[name]}")
    return 0


def run(names: list[str]) -> int:
    started = time.perf_counter()
    for mod in modules(names):
        t0 = time.perf_counter()
        print(f"== mutmut: {mod}", flush=True)
        cmd = ["nice", "-n", "10", *MUTMUT, "run", "--max-children", "1", f"{mod}.*"]
        proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **ENV), capture_output=True, text=True)
        tail = [line for line in proc.stdout.replace("\r", "\n").splitlines() if "mutations/second" in line]
        print(f"   {time.perf_counter() - t0:.0f} s {tail[-1] if tail else ''}", flush=True)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
            return proc.returncode
    print(f"mutation run: {time.perf_counter() - started:.0f} s", flush=True)
    return report(names)


def surviving(names: list[str]) -> list[str]:
    wanted = modules(names)
    eq = equivalents()
    return sorted(k for k, v in results().items()
                  if module_of(k) in wanted and v not in KILLED | {"not checked"} and k not in eq)


def rerun(names: list[str]) -> int:
    """Run the surviving non-equivalent mutants of ``names`` again (after adding tests), in one mutmut
    call, then the report."""
    todo = surviving(names)
    if not todo:
        print("no surviving non-equivalent mutants to run again")
        return report(names)
    t0 = time.perf_counter()
    print(f"== mutmut: {len(todo)} surviving mutants again", flush=True)
    cmd = ["nice", "-n", "10", *MUTMUT, "run", "--max-children", "1", *todo]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **ENV), capture_output=True, text=True)
    print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
        return proc.returncode
    return report(names)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``k / n`` (sound for small samples and rates near 1)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def sample(argv: list[str]) -> int:
    """Run a seeded uniform sample of the modules' mutants and report the kill rate it estimates."""
    count, seed, jobs, names, per_package, fresh, reuse = 200, 1, 1, [], False, True, False
    it = iter(argv)
    for arg in it:
        if arg == "--per-package":
            per_package = True
        elif arg == "--no-fresh":  # the server's pass is a minute or more per server survivor
            fresh = False
        elif arg == "--reuse":  # the statuses of the last run of this very sample (after an interrupted pass)
            reuse = True
        elif arg in ("--count", "--seed", "--jobs"):
            value = next(it, None)
            if value is None or not value.isdigit() or int(value) < (0 if arg == "--seed" else 1):
                print(f"mutation.py sample: {arg} needs a {'non-negative' if arg == '--seed' else 'positive'} "
                      f"integer, got {value!r}", file=sys.stderr)
                return 2
            if arg == "--count":
                count = int(value)
            elif arg == "--seed":
                seed = int(value)
            else:
                jobs = int(value)
        else:
            names.append(arg)
    wanted = set(modules(names))
    status = results()
    if not status:
        # A run whose pattern matches no mutant makes mutmut generate every mutant and map the tests, then
        # stop ("nothing matches") before it tests any: the sample below then runs only what it draws.
        print("== mutmut: generating every mutant and mapping the tests", flush=True)
        proc = subprocess.run(["nice", "-n", "10", *MUTMUT, "run", "--max-children", str(jobs),
                               "kvledger.__no_mutant__"], cwd=REPO, env={**os.environ, **ENV},
                              capture_output=True, text=True)
        status = results()
        if not status:
            print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
            return proc.returncode or 1
    population = sorted(k for k in status if module_of(k) in wanted)
    if not population:
        print(f"mutation.py sample: no mutants of {' '.join(sorted(wanted)) or 'those modules'}", file=sys.stderr)
        return 2
    if per_package:  # ``count`` of each package, each drawn on its own generator: the same whichever are asked
        chosen = []
        for pkg in PACKAGES:
            mine = [k for k in population if package_of(k) == pkg]
            chosen += random.Random(f"{seed}/{pkg}").sample(mine, min(count, len(mine)))
        chosen.sort()
    else:
        chosen = sorted(random.Random(seed).sample(population, min(count, len(population))))
    # Every sampled mutant runs again: a result from before a change of the tests or the code is stale.
    # ``--reuse`` keeps the statuses of the last run of this very sample (its mutmut and C-part passes
    # done, its last pass interrupted): only the fresh-interpreter pass runs.
    reused = reuse and all(status[k] != "not checked" for k in chosen)
    todo = [] if reused else chosen
    t0 = time.perf_counter()
    print(f"== mutmut: {len(chosen)} of {len(population)} mutants (seed {seed}), "
          f"{jobs} worker(s); load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if todo:
        cmd = ["nice", "-n", "10", *MUTMUT, "run", "--max-children", str(jobs), *todo]
        proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **ENV), capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
            return proc.returncode
        status = results()
    print(f"   {time.perf_counter() - t0:.0f} s; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    # `make test` runs with the C part loaded: a mutant that survives the pure-Python run gets a second
    # chance with it loaded (its path may be one only the C part takes), and is killed if either run
    # kills it.
    survivors = [k for k in chosen if status[k] not in KILLED and package_of(k) in NATIVE_PACKAGES]
    if survivors and not reused:
        t0 = time.perf_counter()
        print(f"== mutmut: the {len(survivors)} survivors with a C path again with the C part loaded", flush=True)
        cmd = ["nice", "-n", "10", *MUTMUT, "run", "--max-children", str(jobs), *survivors]
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV, "KVLEDGER_NATIVE": "1"},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
            return proc.returncode
        status = results()
        print(f"   {time.perf_counter() - t0:.0f} s; {sum(status[k] in KILLED for k in survivors)} killed there")
    # mutmut runs each mutant in a process forked after the package was imported, so code that runs at
    # import (the GPU catalogue, the weight formats) runs unmutated. A survivor gets a last chance in a
    # fresh interpreter with the mutant active from the start, over the planner's quick tests.
    fresh_kills: set[str] = set()
    survivors = [k for k in chosen if status[k] not in KILLED and package_of(k) in FRESH_TESTS and fresh]
    if survivors:
        t0 = time.perf_counter()
        print(f"== the {len(survivors)} survivors again, each in a fresh interpreter", flush=True)
        clean = set()
        for pkg in sorted({package_of(k) for k in survivors}):  # the tests must pass with no mutant, or a
            if fresh_run(pkg, "") is True:                        # failure would kill nothing
                clean.add(pkg)
            else:
                print(f"   {pkg}: the fresh-interpreter tests fail without a mutant; pass skipped", flush=True)
        runnable = [k for k in survivors if package_of(k) in clean]
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # each run is a process of its own
            for k, passed in zip(runnable, pool.map(lambda k: fresh_run(package_of(k), k), runnable), strict=True):
                if passed is not True:
                    fresh_kills.add(k)
        print(f"   {time.perf_counter() - t0:.0f} s; {len(fresh_kills)} killed there")
    eq = equivalents()
    c: Counter[str] = Counter()
    by_part: dict[str, Counter[str]] = {}
    left = []
    for k in chosen:
        st = status[k]
        if st in KILLED or k in fresh_kills:
            kind = "killed"
        elif k in eq:
            kind = apart_kind(eq[k])
        else:
            kind = "survived"
            left.append(k)
        c[kind] += 1
        by_part.setdefault(package_of(k), Counter())[kind] += 1
    for pkg, pc in sorted(by_part.items()):
        pn = pc["killed"] + pc["survived"]
        plo, phi = wilson(pc["killed"], pn)
        print(f"   {pkg}: {pc['killed']} / {pn} = {pn and 100 * pc['killed'] / pn:.1f}% "
              f"(95% interval {100 * plo:.1f}-{100 * phi:.1f}%) of {sum(pc.values())} sampled; "
              f"{pc['equivalent']} equivalent, {pc['native']} native, {pc['survived']} survived"
              + (f"; {pc['cuda']} need a GPU (counted as survived: {pc['killed']} / {pn + pc['cuda']} = "
                 f"{100 * pc['killed'] / (pn + pc['cuda']):.1f}%)" if pc["cuda"] else ""))
    n = c["killed"] + c["survived"]
    lo, hi = wilson(c["killed"], n)
    rate = f"{100 * c['killed'] / n:.1f}%" if n else "-"
    print(f"sampled kill rate of non-equivalent mutants: {c['killed']} / {n} = {rate} "
          f"(95% interval {100 * lo:.1f}-{100 * hi:.1f}%); {c['equivalent']} equivalent, {c['native']} native, "
          f"{c['cuda']} need a GPU")
    if not fresh:
        print("   (--no-fresh: no fresh-interpreter pass of the survivors)")
    if left:
        print(f"\n{len(left)} surviving non-equivalent mutants of the sample (mutmut show NAME shows one):")
        for k in left:
            print(f"  {k}: {status[k]}")
    return 0


def fresh_run(package: str, mutant: str) -> bool | None:
    """``package``'s fresh-interpreter tests with ``mutant`` active from the start (no mutant: ``""``), with
    ``mutants/src`` first on the path of this process and of any it starts: True if they pass, False if
    they fail, None on a timeout (counted as killed, as mutmut counts one)."""
    env = {**os.environ, **ENV, **FRESH_ENV.get(package, {}), "MUTANT_UNDER_TEST": mutant,
           "PYTHONPATH": str(REPO / "mutants" / "src")}
    cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           *FRESH_TESTS[package]]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=FRESH_TIMEOUT_S.get(package, 300))
    except subprocess.TimeoutExpired:
        return None
    return proc.returncode == 0


COMMANDS = {"run": run, "report": report, "rerun": rerun, "sample": sample}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
