"""The mutation check: plant each curated defect, run the tests that claim it.

Usage (from anywhere, with the development environment active)::

  python mutation/run.py              # every mutant of mutation/mutants.py
  python mutation/run.py --list       # their names, guarantees and tests
  python mutation/run.py --only NAME  # one mutant (repeat for several)
  python mutation/run.py --baseline   # first, the same tests unmutated
  python mutation/run.py --only NAME --tests tests/test_x.py::test_y
                                      # whether that test catches NAME
  python mutation/run.py --jobs 2     # two mutants at a time

The working tree (tracked files and untracked ones git does not ignore) is
copied once, at the start, so that every mutant is applied to the same
source even while the tree changes. Every edit's snippet must occur exactly
once in that copy, else the run stops before any test (the library changed:
re-target the mutant). For each mutant the copy is copied again to a
temporary directory and the mutant's edits are applied there. Pytest
then runs the mutant's tests from the copy's root with the copy first on
the path, in a process of its own forked from one that imported the
third-party packages once (``warm_pytest``): the test process imports the
mutated package (the ``harness_plugin`` plugin checks it), and so does
every subprocess the tests start, since they put their own repository
root, the copy, first on the path. A mutant is killed when some test
fails, and survives when all pass. The exit status is 0 only when every
mutant is killed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import NamedTuple

import warm_pytest
from mutants import MUTANTS, Mutant

ROOT = pathlib.Path(__file__).resolve().parent.parent
HARNESS = pathlib.Path(__file__).resolve().parent
# Pytest's short summary: "FAILED tests/test_x.py::test_y[case] - message".
SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)")


class StaleMutant(Exception):
  """An edit's snippet is not found exactly once in the current source."""


class Outcome(NamedTuple):
  """What the tests did with one mutant."""

  name: str
  status: str  # "killed", "survived" or "error"
  failing: list[str]
  seconds: float
  output_tail: str


def working_tree_files() -> list[str]:
  """Tracked files and untracked ones git does not ignore, that exist."""
  listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    capture_output=True,
    check=True,
  ).stdout.decode()
  return [path for path in listed.split("\0") if (ROOT / path).is_file()]


def copy_working_tree(destination: pathlib.Path) -> None:
  for path in working_tree_files():
    target = destination / path
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / path, target)


def check_edits(mutant: Mutant, root: pathlib.Path = ROOT) -> None:
  """Raises StaleMutant unless every snippet occurs exactly once under root."""
  for edit in mutant.edits:
    if not edit.path.startswith("ga_optax/"):
      raise StaleMutant(f"{mutant.name}: {edit.path} is not under ga_optax/")
    if edit.old == edit.new:
      raise StaleMutant(
        f"{mutant.name}: an edit of {edit.path} changes nothing"
      )
    source = (root / edit.path).read_text()
    count = source.count(edit.old)
    if count != 1:
      raise StaleMutant(
        f"{mutant.name}: the snippet to replace occurs {count} times in"
        f" {edit.path} (expected exactly once); re-target the mutant."
        f" Snippet:\n{edit.old}"
      )


def apply_edits(mutant: Mutant, root: pathlib.Path) -> None:
  check_edits(mutant, root)
  for edit in mutant.edits:
    path = root / edit.path
    path.write_text(path.read_text().replace(edit.old, edit.new))


def run_tests(
  root: pathlib.Path,
  tests: Sequence[str],
  changed: Sequence[str],
  timeout: int,
  first_failure: bool = False,
  window_form: str | None = None,
) -> tuple[int, str]:
  """Runs pytest on ``tests`` in the copy at ``root``; (exit code, output).

  ``window_form`` pins the window's form (``GA_OPTAX_WINDOW_FORM``); None
  leaves the choice to the platform, whatever the caller's environment says.
  """
  variables = {
    "GA_OPTAX_WINDOW_FORM": window_form,
    "GA_OPTAX_MUTANT_ROOT": str(root),
    "GA_OPTAX_MUTANT_FILES": os.pathsep.join(changed),
  }
  arguments = [
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "harness_plugin",
    "-rfE",
    "--no-header",
    *(["-x"] if first_failure else []),
    *tests,
  ]
  return warm_pytest.run(
    root, [str(root), str(HARNESS)], variables, arguments, timeout
  )


def failing_tests(output: str) -> list[str]:
  # A failure is named twice: the moment it fails (tests/conftest.py) and
  # in pytest's summary.
  named = (SUMMARY_LINE.match(line) for line in output.splitlines())
  return list(dict.fromkeys(match.group(1) for match in named if match))


def run_mutant(
  snapshot: pathlib.Path,
  mutant: Mutant | None,
  tests: Sequence[str],
  timeout: int,
  first_failure: bool = False,
  window_form: str | None = None,
) -> Outcome:
  """Copies ``snapshot``, applies ``mutant`` (None: no edit), runs ``tests``.

  ``window_form``: the form for a mutant that pins none (and the baseline);
  None leaves it to the platform.
  """
  name = mutant.name if mutant else "baseline"
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"ga_optax_{name}_") as directory:
    root = pathlib.Path(directory)
    shutil.copytree(snapshot, root, dirs_exist_ok=True)
    changed: list[str] = []
    if mutant is not None:
      apply_edits(mutant, root)
      changed = sorted({edit.path for edit in mutant.edits})
    code, output = run_tests(
      root,
      tests,
      changed,
      timeout,
      first_failure,
      window_form=(mutant and mutant.window_form) or window_form,
    )
  seconds = time.perf_counter() - start
  # 1: some test failed. 0: all passed. Anything else (collection error,
  # usage error from the import guard, timeout) is not a verdict.
  status = {0: "survived", 1: "killed"}.get(code, "error")
  tail = "\n".join(output.strip().splitlines()[-25:])
  return Outcome(name, status, failing_tests(output), seconds, tail)


def describe(mutant: Mutant) -> str:
  lines = [f"{mutant.name}  [{mutant.guarantee}]", f"  {mutant.defect}"]
  lines += [f"  edits {edit.path}" for edit in mutant.edits]
  lines += [f"  test  {test}" for test in mutant.tests]
  if mutant.window_form:
    lines.append(f"  form  {mutant.window_form}")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--only",
    action="append",
    metavar="NAME",
    help="run only this mutant (repeatable)",
  )
  parser.add_argument(
    "--list", action="store_true", help="list the mutants and exit"
  )
  parser.add_argument(
    "--baseline",
    action="store_true",
    help="first run the selected mutants' tests on the unmutated copy",
  )
  parser.add_argument(
    "--tests",
    nargs="+",
    metavar="NODE_ID",
    help="run these tests instead of each mutant's own (to show that one"
    " test catches a defect)",
  )
  parser.add_argument(
    "--first-failure",
    action="store_true",
    help="stop each mutant's tests at the first failure (faster; reports"
    " one failing test per killed mutant)",
  )
  parser.add_argument(
    "--window-form",
    choices=("loops", "conditional"),
    help="run every mutant that pins no window form in this one (by"
    " default the platform's: the CPU's is the conditional form)",
  )
  parser.add_argument(
    "--jobs",
    type=int,
    default=1,
    help="mutants tested at once, each in its own pytest process (default"
    " 1; one per core is the most that helps)",
  )
  parser.add_argument(
    "--timeout",
    type=int,
    default=900,
    help="seconds allowed per mutant's test run (default 900)",
  )
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}")

  known = {mutant.name: mutant for mutant in MUTANTS}
  unknown = sorted(set(args.only or ()) - set(known))
  if unknown:
    parser.error(f"unknown mutants {unknown}; --list names them")
  selected = [m for m in MUTANTS if not args.only or m.name in args.only]
  if args.list:
    print("\n\n".join(describe(mutant) for mutant in selected))
    return 0

  with (
    warm_pytest.server(),
    tempfile.TemporaryDirectory(prefix="ga_optax_snapshot_") as directory,
  ):
    snapshot = pathlib.Path(directory)
    copy_working_tree(snapshot)
    return run_all(snapshot, selected, args)


def run_all(
  snapshot: pathlib.Path, selected: list[Mutant], args: argparse.Namespace
) -> int:
  """Runs the selected mutants on ``snapshot``; the exit status."""
  # Every snippet is checked before anything runs: a stale mutant is a
  # harness error, not a result.
  stale = []
  for mutant in selected:
    try:
      check_edits(mutant, snapshot)
    except StaleMutant as error:
      stale.append(str(error))
  if stale:
    print("stale mutants:\n" + "\n\n".join(stale), file=sys.stderr)
    return 2

  start = time.perf_counter()
  if args.baseline:
    tests = args.tests or list(
      dict.fromkeys(test for mutant in selected for test in mutant.tests)
    )
    outcome = run_mutant(
      snapshot, None, tests, args.timeout, window_form=args.window_form
    )
    print(f"baseline ({len(tests)} test ids): {outcome.seconds:.0f} s")
    if outcome.status != "survived":
      print(outcome.output_tail)
      print("the tests fail unmutated: no mutant verdict would mean anything")
      return 2

  def verdict(mutant: Mutant) -> Outcome:
    return run_mutant(
      snapshot,
      mutant,
      args.tests or mutant.tests,
      args.timeout,
      args.first_failure,
      args.window_form,
    )

  outcomes = []
  # Each mutant's tests run in a subprocess of its own copy: threads only
  # wait on them. The verdicts print in the mutants' order.
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for outcome in pool.map(verdict, selected):
      outcomes.append(outcome)
      report(outcome)

  killed = sum(outcome.status == "killed" for outcome in outcomes)
  elapsed = time.perf_counter() - start
  print(f"\n{killed}/{len(outcomes)} mutants killed in {elapsed:.0f} s")
  for outcome in outcomes:
    if outcome.status != "killed":
      print(f"  {outcome.status}: {outcome.name}")
  return 0 if killed == len(outcomes) else 1


def report(outcome: Outcome) -> None:
  print(
    f"{outcome.status:8} {outcome.name} ({outcome.seconds:.0f} s,"
    f" {len(outcome.failing)} failing)",
    flush=True,
  )
  for test in outcome.failing:
    print(f"           {test}")
  if outcome.status == "error":
    print(outcome.output_tail)


if __name__ == "__main__":
  sys.exit(main())
