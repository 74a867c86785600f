"""The GPU run book: what the compiler and the device do to ga_optax's window.

One command checks and measures ga_optax on the machine at hand::

  python benchmarks/gpu_report.py --output-dir DIR            # full sizes
  python benchmarks/gpu_report.py --output-dir DIR --quick    # smoke run
  python benchmarks/gpu_report.py --output-dir DIR --section step_time

Each section runs on its own (a failure is recorded in its place, and the
next one runs), names what measured it, and writes ``DIR/<section>.json``
and ``.md`` as it ends; ``DIR/gpu_report.json`` and ``.md`` hold every
section so far, so a run cut short keeps what it measured. A section that
would start after ``--budget-s`` seconds (300: a lent GPU's five minutes)
is skipped, so the most wanted come first. A run without a GPU says at the
top that none of its figures is a GPU figure. In order: ``environment``;
``compiled_h100`` (``benchmarks/compiled.py``'s steps compiled by XLA:GPU
for a compile-only H100, which needs the CUDA plugin and, without a GPU,
``JAX_PLATFORMS=cpu``); ``window_time`` (every form of a window timed per
call and per window, ``benchmarks/window_time.py``); ``cond_window`` (the
one-conditional window: its conditionals, copies and host waits under this
jax, ``benchmarks/cond_window.py``); ``summation_orders`` (the demo's large
batch in two orders, ``benchmarks/summation_orders.py``); ``compiled_here``
(``compiled_h100`` for the device at hand); ``step_time``, ``in_step``,
``host_memory``, ``largest_batch`` (``benchmarks/largest_batch.py``) and
``peak_memory`` (where the device has ``memory_stats()``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Runs as a script from any directory, ga_optax installed or not: the
# repository root holds the package and the `benchmarks` helpers.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks import batch_fit, compiled_steps, host_offload, timing  # noqa: E402
from benchmarks import cond_window as cond_lib  # noqa: E402
from benchmarks import environment as environment_lib  # noqa: E402
from benchmarks import summation_orders as orders_lib  # noqa: E402
from benchmarks import window_time as window_lib  # noqa: E402
from benchmarks import workloads as workloads_lib  # noqa: E402
from ga_optax._src import audits  # noqa: E402

MIB = 2**20
H100 = "XLA:GPU for a compile-only H100; nothing ran"
STEP_ROWS = (
  "plain Adam step",
  "optax.MultiSteps",
  "ga_optax.accumulate",
  "ga_optax.accumulate_and_apply",
)
WARMUP = 1
Record = dict[str, Any]


class Skipped(Exception):
  """This machine lacks what a section needs; the reason is recorded."""


@dataclasses.dataclass(frozen=True)
class Section:
  """A part of the report: its name, what measures it, how, its markdown."""

  name: str
  backend: str
  measure: Callable[[], Record]
  render: Callable[[Record], list[str]]


def top_label() -> str:
  device = jax.devices()[0]
  if device.platform == "gpu":
    return f"GPU run on {device.device_kind}"
  return (
    f"{device.platform.upper()} run: no GPU; none of these figures is a GPU"
    " figure (the H100 section is what XLA:GPU compiles; nothing ran on one)"
  )


def cell(key: str, value: Any) -> str:
  if key.endswith("bytes") and isinstance(value, int):
    return f"{value / MIB:.3f} MiB"
  return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(rows: list[Record], caption: str = "") -> list[str]:
  """Markdown of rows that share their keys, the keys as the header."""
  keys = list(rows[0]) if rows else ["(none)"]
  return [
    *([caption, ""] if caption else []),
    "| " + " | ".join(keys) + " |",
    "|" + "---|" * len(keys),
    *("| " + " | ".join(cell(k, row[k]) for k in keys) + " |" for row in rows),
    "",
  ]


def per_workload(records: dict[str, list[Record]]) -> list[str]:
  return [line for name, rows in records.items() for line in table(rows, name)]


def environment(command: str, quick: bool) -> Record:
  record = environment_lib.environment(command)
  device = jax.devices()[0]
  record["versions"]["jaxlib"] = importlib.metadata.version("jaxlib")
  for dist in importlib.metadata.distributions():
    if re.match(r"jax[-_](cuda|rocm)", dist.metadata["Name"] or ""):
      record["versions"][dist.metadata["Name"]] = dist.version
  memory_kinds = [memory.kind for memory in device.addressable_memories()]
  record["device"].update(memory_kinds=memory_kinds)
  record["device"].update(memory_stats=device.memory_stats())
  # Two GPU runs can differ by their CUDA version alone.
  record["device"].update(platform_version=device.client.platform_version)
  record["environment_variables"] = {
    name: value
    for name, value in sorted(os.environ.items())
    if name.startswith(("XLA_", "JAX_"))
  }
  record.update(backend=device.platform, gpu=device.platform == "gpu")
  return {**record, "label": top_label(), "quick": quick}


def environment_lines(record: Record) -> list[str]:
  facts = {**record["device"], **record["machine"], **record["versions"]}
  facts.update(record["environment_variables"], date=record["date"])
  return table([{"what": key, "value": value} for key, value in facts.items()])


def compile_for_h100(step: Callable[..., Any], *args: Any) -> Any:
  try:
    return audits.compile_for_gpu(step, *args, donate_argnums=(0, 1))
  except audits.GpuCompilerUnavailable as error:
    raise Skipped(str(error)) from error


def compile_here(step: Callable[..., Any], *args: Any) -> Any:
  return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()


def compiled_section(
  quick: bool, compile_step: Callable[..., Any], h100: Record | None = None
) -> Record:
  """Each step's paths, window sides and target ratios, as compiled; with
  the H100's figures, its ratios beside."""
  workload = workloads_lib.mlp(*((256, 2) if quick else (2048, 4)), 8, 4)
  paths = {}
  for name, (step, state, batch) in compiled_steps.steps(workload).items():
    program = compile_step(step, workload.params, state, batch)
    paths[name] = compiled_steps.audit(program)
    paths[name]["window_sides"] = audits.window_sides(program)
  ratios = compiled_steps.ratios(paths)
  if h100:
    for row, theirs in zip(ratios, h100["ratios"], strict=True):
      row["h100_ratio"] = theirs["ratio"]
  windows = compiled_steps.windows(paths, workload.every_k)
  return {
    "workload": workload.description,
    "paths": paths,
    "ratios": ratios,
    "windows": windows,
  }


def compiled_lines(record: Record, compiled_for: str) -> list[str]:
  paths, ratios = record["paths"], record["ratios"]
  lines = [record["workload"], ""]
  lines += [compiled_steps.tables(paths, ratios, compiled_for), ""]
  lines += [compiled_steps.windows_table(record["windows"], compiled_for), ""]
  sides = [
    {"step": name, **path["window_sides"]} for name, path in paths.items()
  ]
  beside = [
    {"figure": row["figure"], compiled_for: row["ratio"], "H100": theirs}
    for row in ratios
    if (theirs := row.get("h100_ratio")) is not None
  ]
  return lines + table(sides) + (table(beside) if beside else [])


def time_workloads(quick: bool) -> list[workloads_lib.Workload]:
  if quick:
    return [workloads_lib.mlp(width=256, depth=2, microbatch=8, every_k=4)]
  return workloads_lib.reference_workloads(quick=False)


def over_references(result: Record, plain: Record, multi: Record) -> Record:
  """A contender's medians, and their ratios to plain Adam's and MultiSteps'."""
  row = {key: result[key] for key in ("micro_ms", "closing_ms")}
  for label, reference in (("plain_adam", plain), ("multi_steps", multi)):
    # A step that closes no window has its one median in both fields.
    for key in ("micro_ms", "closing_ms"):
      row[f"{key}_over_{label}"] = result[key] / reference[key]
  return row


def step_time_section(quick: bool, repeats: int) -> Record:
  """benchmarks/run.py's medians, over plain Adam's and MultiSteps'."""
  records = {}
  for workload in time_workloads(quick):
    record = timing.measure_workload(workload, repeats, WARMUP)
    found = record["contenders"]
    plain, multi = found["plain Adam step"], found["optax.MultiSteps"]
    record["ratios"] = [
      {"contender": name, **over_references(found[name], plain, multi)}
      for name in STEP_ROWS
    ]
    record["figures"] = timing.figures(workload.name, record)
    records[workload.name] = record
  return records


def step_time_lines(records: Record) -> list[str]:
  lines = []
  for record in records.values():
    lines += table(record["ratios"], record["description"])
    lines += table(record["figures"], "benchmarks/run.py's figures")
  return lines


def in_step_section(quick: bool, repeats: int) -> Record:
  """Alternating single calls of each window: medians, ratio to the scan."""
  records = {}
  for workload in time_workloads(quick):
    loss_fn, k = workload.loss_fn, workload.every_k
    windows = {
      "ga_optax.microbatched_value_and_grad": jax.jit(
        ga_optax.microbatched_value_and_grad(loss_fn, k)
      ),
      "hand-written lax.scan": jax.jit(
        compiled_steps.hand_written_scan(loss_fn, k)
      ),
    }
    calls: dict[str, list[float]] = {name: [] for name in windows}
    for round_index in range(WARMUP + repeats):
      # Alternating the order spreads slow spells over both windows.
      for name in list(windows)[:: 1 if round_index % 2 else -1]:
        start = time.perf_counter()
        jax.block_until_ready(
          windows[name](workload.params, workload.window_batch)
        )
        if round_index >= WARMUP:
          calls[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: float(np.median(times)) for name, times in calls.items()}
    scan = medians["hand-written lax.scan"]
    records[workload.name] = [
      {"window": name, "median_ms": median, "over_scan": median / scan}
      for name, median in medians.items()
    ]
  return records


def host_workloads(quick: bool) -> dict[str, workloads_lib.Workload]:
  found = host_offload.workloads(quick)
  return {"reference": found["reference"]} if quick else found


def host_memory_section(quick: bool, repeats: int) -> Record:
  """benchmarks/host_memory.py's bytes and times, state in pinned_host."""
  kinds = [memory.kind for memory in jax.devices()[0].addressable_memories()]
  if "pinned_host" not in kinds:
    raise Skipped(f"the device offers no pinned_host memory, only {kinds}")
  records = {}
  for name, workload in host_workloads(quick).items():
    records[name] = host_offload.measure(workload, repeats, WARMUP)
    records[name]["figures"] = host_offload.figures(records[name])
  return records


def peak_memory_section(quick: bool) -> Record:
  """Each host-memory step in a fresh process: its peak bytes."""
  if jax.devices()[0].memory_stats() is None:
    raise Skipped(f"the {jax.default_backend()} backend has no memory_stats()")
  return {
    name: [
      {"configuration": config.name, **host_offload.peak_of(name, index, quick)}
      for index, config in enumerate(host_offload.CONFIGS)
    ]
    for name in host_workloads(quick)
  }


def sections(args: argparse.Namespace, report: Record) -> list[Section]:
  device = jax.devices()[0]
  here = f"{device.platform}: {device.device_kind} x {jax.device_count()}"
  quick, repeats = args.quick, args.repeats
  h100 = lambda: report.get("compiled_h100", {}).get("results")  # noqa: E731
  return [
    Section("environment", here, lambda: environment(args.command, quick),
            environment_lines),
    Section("compiled_h100", H100,
            lambda: compiled_section(quick, compile_for_h100),
            lambda record: compiled_lines(record, "H100")),
    Section("window_time", here, lambda: window_lib.measure(quick, repeats),
            lambda records: per_workload({record["caption"]: record["rows"]
                                          for record in records.values()})),
    Section("cond_window", f"{here}, and {H100}",
            lambda: cond_lib.figures(quick),
            lambda record: table(record["rows"], record["workload"])),
    Section("summation_orders", here, lambda: orders_lib.measure(quick),
            lambda record: table(record["runs"], record["command"])
            + table(record["distances"])),
    Section("compiled_here", here,
            lambda: compiled_section(quick, compile_here, h100()),
            lambda record: compiled_lines(record, jax.default_backend())),
    Section("step_time", here, lambda: step_time_section(quick, repeats),
            step_time_lines),
    Section("in_step", here, lambda: in_step_section(quick, 3 * repeats),
            per_workload),
    Section("host_memory", here, lambda: host_memory_section(quick, repeats),
            lambda records: per_workload(
              {name: record["figures"] for name, record in records.items()})),
    Section("largest_batch", here,
            lambda: batch_fit.measure(*batch_fit.budget(
              args.memory_budget_mib, args.memory_fraction, quick), quick),
            lambda record: table(record["largest"],
                                 batch_fit.caption(record))),
    Section("peak_memory", here, lambda: peak_memory_section(quick),
            per_workload),
  ]  # fmt: skip


def run_section(section: Section, over_budget: bool) -> tuple[Record, str]:
  """One section's record and markdown; a failure is recorded, not raised."""
  print(f"{section.name} ...", file=sys.stderr, flush=True)
  started = time.perf_counter()
  record: Record = {"backend": section.backend}
  lines = [f"## {section.name} ({section.backend})", ""]
  try:
    if over_budget:
      raise Skipped("the run's time budget (--budget-s) was spent before it")
    record.update(status="ok", results=section.measure())
    lines += section.render(record["results"])
  except Skipped as reason:
    record.update(status="skipped", reason=str(reason))
    lines += [f"Skipped: {reason}", ""]
  except Exception as error:  # one failure must not end the run
    record.update(status="failed", error=f"{type(error).__name__}: {error}")
    record["traceback"] = traceback.format_exc()
    # A fresh process's own error is in its stderr, not in the exception.
    record["stderr"] = str(getattr(error, "stderr", ""))[-4000:]
    lines += [f"**Failed**: `{record['error'][:500]}`", ""]
  record["elapsed_s"] = time.perf_counter() - started
  return record, "\n".join(lines)


def write(directory: pathlib.Path, name: str, record: Any, text: str) -> None:
  dumped = json.dumps(record, indent=1, default=str)
  (directory / f"{name}.json").write_text(dumped)
  (directory / f"{name}.md").write_text(text + "\n")


def main(argv: list[str] | None = None) -> Record:
  """Runs the sections in order, writing each as it ends; the report."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  results = REPO_ROOT / "benchmarks" / "results" / "gpu_report"
  parser.add_argument("--output-dir", type=pathlib.Path, default=results)
  parser.add_argument("--quick", action="store_true", help="small and fast")
  parser.add_argument("--repeats", type=int, help="rounds (10; quick: 2)")
  parser.add_argument("--memory-budget-mib", type=float)
  # Headroom for the runtime's own buffers and fragmentation.
  parser.add_argument("--memory-fraction", type=float, default=0.9)
  parser.add_argument("--section", action="append", help="only these")
  # A lent GPU's five minutes: no section starts after them.
  parser.add_argument("--budget-s", type=float, default=300.0)
  args = parser.parse_args(argv)
  started = time.perf_counter()
  args.repeats = args.repeats or (2 if args.quick else 10)
  given = sys.argv[1:] if argv is None else argv
  args.command = " ".join(["python benchmarks/gpu_report.py", *given])
  args.output_dir.mkdir(parents=True, exist_ok=True)
  report: Record = {}
  markdown = [f"# ga_optax GPU run book\n\n**{top_label()}.**\n"]
  for section in sections(args, report):
    if args.section and section.name not in {"environment", *args.section}:
      continue
    # What the others are measured on is always recorded.
    over_budget = section.name != "environment" and (
      time.perf_counter() - started >= args.budget_s
    )
    report[section.name], text = run_section(section, over_budget)
    markdown.append(text)
    write(args.output_dir, section.name, report[section.name], text)
    write(args.output_dir, "gpu_report", report, "\n".join(markdown))
  print("\n".join(markdown))
  return report


if __name__ == "__main__":
  main()
